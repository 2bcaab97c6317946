"""Creating the process groups of one tensor-parallel rank.

`init_tensor_parallel` joins the default group (NCCL when the ranks run on GPUs, gloo on CPU),
pins the rank's GPU, and adds a gloo group over the same ranks for control traffic (sampled tokens,
memory sizing), which must never wait behind GPU work. It never turns NVLink multicast on: the
variables that disable it are set before NCCL is first touched.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from snugkv.distributed.group import TensorParallel

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) is off in every process snugkv starts: the lent machines require it.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast() -> None:
    os.environ.update(NO_MULTICAST_ENV)


# How long a rank waits in a collective before giving up (SNUGKV_TP_TIMEOUT_S overrides it).
DEFAULT_TIMEOUT_S = 600.0
# Waiting for a person (the next chat turn) is not a hang: that group never times out in practice.
JOIN_TIMEOUT_S = 300.0  # every rank has joined by then, or the launch fails
WAIT_FOR_USER_TIMEOUT = timedelta(days=30)


def init_tensor_parallel(
    rank: int,
    world_size: int,
    *,
    init_method: str,
    device_type: str,
    timeout_s: float | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> TensorParallel:
    """Join the group of `world_size` ranks at `init_method` (for example `tcp://127.0.0.1:29500`).
    A group across hosts passes this rank's index on its host (its GPU) and the host's rank count;
    by default every rank is on this host and `rank` is the GPU."""
    disable_multicast()
    if world_size == 1:
        return TensorParallel()
    if timeout_s is None:
        timeout_s = float(os.environ.get("SNUGKV_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    timeout = timedelta(seconds=timeout_s)
    # Joining waits for every rank to start (import torch, read the model): on a busy host that can
    # take longer than a short collectives timeout, so the rendezvous gets its own.
    store, _, _ = next(
        dist.rendezvous(
            init_method, rank, world_size, timeout=timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        )
    )
    gpu = rank if local_rank is None else local_rank
    ranks_here = world_size if local_world_size is None else local_world_size
    if device_type == "cuda":
        if torch.cuda.device_count() < ranks_here:
            raise RuntimeError(
                f"--tp {world_size} needs {ranks_here} GPUs on this host; it has {torch.cuda.device_count()}"
            )
        torch.cuda.set_device(gpu)
        dist.init_process_group(
            "nccl",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=torch.device("cuda", gpu),
        )
    else:
        # Ranks share the host's cores: oversubscribed OpenMP threads spin against each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if device_type == "cuda" else device_group
    wait_group = dist.new_group(backend="gloo", timeout=WAIT_FOR_USER_TIMEOUT)
    logger.debug("rank %d of %d joined (%s)", rank, world_size, dist.get_backend(device_group))
    return TensorParallel(rank, world_size, device_group, cpu_group, wait_group)


def destroy_tensor_parallel(*, meet_first: bool = True) -> None:
    """Leave the groups. Normally every rank first meets at a barrier: a rank that tears its
    connections down while another still talks over them can abort that rank inside gloo. After a
    failure (`meet_first=False`) there is nobody to meet: the other ranks are in other collectives."""
    if not dist.is_initialized():
        return
    try:
        if meet_first:
            dist.barrier()
    finally:
        dist.destroy_process_group()
