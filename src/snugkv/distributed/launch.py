"""Starting one process per tensor-parallel rank (`--tp N`).

`launch(target, tp_size, args)` spawns `tp_size` processes (torch.multiprocessing, spawn start
method), each of which sets the no-multicast variables, joins the groups and calls
`target(tp, *args)`. With `tp_size == 1` it calls `target` in this process, with no groups at all.
Rank 0's return value comes back to the caller; a rank that raises fails the whole launch.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from snugkv.distributed.group import TensorParallel
from snugkv.distributed.setup import destroy_tensor_parallel, disable_multicast, init_tensor_parallel

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rank_main(
    rank: int,
    world_size: int,
    init_method: str,
    device_type: str,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    log_level: int,
) -> None:
    disable_multicast()
    logging.basicConfig(level=log_level if rank == 0 else max(log_level, logging.WARNING))
    tp = init_tensor_parallel(rank, world_size, init_method=init_method, device_type=device_type)
    try:
        value = target(tp, *args)
        if rank == 0:
            results.put(value)
    finally:
        destroy_tensor_parallel()


def launch(
    target: Callable[..., Any],
    tp_size: int,
    args: tuple[Any, ...] = (),
    *,
    device_type: str | None = None,
) -> Any:
    """Run `target(tp, *args)` on `tp_size` ranks; returns rank 0's result.

    `target` must be importable (a module-level function): spawned processes import it by name.
    """
    if tp_size < 1:
        raise ValueError(f"--tp must be >= 1, got {tp_size}")
    disable_multicast()  # inherited by every child, and set again inside each one
    if tp_size == 1:
        return target(TensorParallel(), *args)
    device_type = device_type or default_device_type()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    log_level = logging.getLogger().getEffectiveLevel()
    processes = mp.start_processes(
        _rank_main,
        args=(tp_size, init_method, device_type, target, args, results, log_level),
        nprocs=tp_size,
        join=False,
        start_method="spawn",
    )
    # Read while waiting: a large result would otherwise block rank 0 on a full pipe.
    value = None
    while True:
        while not results.empty():
            value = results.get()
        if processes.join(timeout=0.1):
            break
    while not results.empty():
        value = results.get()
    return value


def rank_environment() -> dict[str, str]:
    """The no-multicast variables as this process sees them (tests check every rank has them)."""
    from snugkv.distributed.setup import NO_MULTICAST_ENV

    return {key: os.environ.get(key, "") for key in NO_MULTICAST_ENV}
