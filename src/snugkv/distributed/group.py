"""`TensorParallel`: this rank, the world size, the groups, and the collectives the layers use.

One small frozen object holds everything a sharded layer needs to know. At `world_size == 1` every
collective is the identity and nothing touches `torch.distributed`, so tp=1 runs exactly the
single-process code. Tensors go over `device_group` (NCCL on GPU, gloo on CPU), and so do the
scheduler's sampled token ids (they stay on the device); control values (sizing, the token ids
of the runner's synchronous `sample`) go over `cpu_group` (always gloo).

The only module-level state is the "current" object that model constructors read while a model
is built (`use_tensor_parallel`): the loader builds models with a fixed signature, so this is how a
model learns its rank without every architecture taking a new argument. Layers never read it;
they get the object from the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(ValueError):
    """A model shape that cannot be split over the requested number of ranks."""


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    wait_group: dist.ProcessGroup | None = None  # gloo, no practical timeout: waits on a person

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def _cpu(self) -> dist.ProcessGroup:
        if self.cpu_group is None:
            raise RuntimeError(f"rank {self.rank} of {self.world_size} has no CPU process group")
        return self.cpu_group

    # -- how heads and rows split --------------------------------------------------------
    def split(self, total: int, what: str) -> int:
        """`total / world_size`, with an error naming `what` when it does not divide."""
        if total % self.world_size:
            raise TensorParallelError(f"{what}={total} cannot be split evenly over --tp {self.world_size}")
        return total // self.world_size

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV head count) this rank keeps.

        KV heads split evenly when there are at least as many as ranks; otherwise each rank keeps
        the single KV head its query heads read (so several ranks hold the same head).
        """
        local_q = self.split(num_heads, "num_attention_heads")
        if num_kv_heads >= self.world_size:
            count = self.split(num_kv_heads, "num_key_value_heads")
        elif self.world_size % num_kv_heads:
            raise TensorParallelError(
                f"num_key_value_heads={num_kv_heads} is below --tp {self.world_size} and does not divide it"
            )
        else:
            count = 1
        group = num_heads // num_kv_heads
        return self.rank * local_q // group, count

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (identity at tp=1)."""
        if self.enabled:
            dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[..., n]` on every rank -> `[..., world_size * n]`, rank-major (identity at tp=1)."""
        if not self.enabled:
            return tensor
        rows = tensor.reshape(-1, tensor.shape[-1]).contiguous()
        gathered = torch.empty(
            (self.world_size * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device
        )
        _all_gather_single(gathered, rows, group=self.device_group)
        merged = gathered.view(self.world_size, *rows.shape).permute(1, 0, 2).reshape(rows.shape[0], -1)
        return merged.reshape(*tensor.shape[:-1], merged.shape[-1])

    def broadcast_from_first(self, values: list[int]) -> list[int]:
        """Rank 0's integers on every rank, over the CPU group (the same length on every rank)."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        group = self._cpu()
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
        return tensor.tolist()

    def broadcast_tensor_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place, over the device group: on a GPU (NCCL) it is
        queued on the stream and the host does not wait (identity at tp=1)."""
        if self.enabled:
            group = self.device_group
            dist.broadcast(tensor, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        return tensor

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank, over the CPU group."""
        if not self.enabled:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(tensor.item())

    def broadcast_object_from_first(self, value: Any, *, wait_for_user: bool = False) -> Any:
        """Rank 0's picklable `value` on every rank (others pass anything, e.g. None), over the CPU
        group; `wait_for_user` when rank 0 may first wait on a person (the next chat turn), which the
        collectives' timeout must not cut short."""
        if not self.enabled:
            return value
        group = self.wait_group if wait_for_user and self.wait_group is not None else self._cpu()
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]


# torch >= 2.12 renamed the concatenating all-gather; the device has 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_current = TensorParallel()


def current_tensor_parallel() -> TensorParallel:
    """The object set by the innermost `use_tensor_parallel` (tp=1 outside any)."""
    return _current


@contextlib.contextmanager
def use_tensor_parallel(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Models built inside this block are sharded for `tp`."""
    global _current
    previous, _current = _current, tp
    try:
        yield tp
    finally:
        _current = previous
