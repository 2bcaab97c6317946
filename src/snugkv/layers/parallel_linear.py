"""Linear layers and embeddings split over tensor-parallel ranks (Megatron style).

- `ColumnParallelLinear` splits output rows: each rank computes its slice, nothing is exchanged.
  A merged projection (gate|up, q|k|v) splits each stacked part separately, so a rank's slice is
  `[gate_r | up_r]`, and the layer after it sees the same layout as at tp=1.
- `QKVParallelLinear` splits by heads: this rank's query heads, and the KV heads they read
  (replicated when there are fewer KV heads than ranks).
- `RowParallelLinear` splits input columns and sums the partial products with an all-reduce;
  the bias is added once, after the sum.
- `VocabParallelEmbedding` keeps a contiguous block of vocabulary rows; ids outside it give zero
  rows and an all-reduce assembles the embedding. `ParallelLMHead` projects onto the block and
  gathers the full logits on every rank.

Each layer knows how its parameters relate to the full (unsharded) tensors: `full_shape(name, part)` and
`shard_weight(name, full, part)` give this rank's slice of a checkpoint tensor (or of one stacked
part of it). Weight loading and random weights both go through that, so every rank keeps only its
slice and tp=1 and tp=N hold the same numbers. At tp=1 every layer is the plain layer, with no
communication. Layers get the `TensorParallel` object explicitly; they never read a global.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from snugkv.distributed.group import TensorParallel


@runtime_checkable
class ShardedLayer(Protocol):
    """A layer that knows how its parameters relate to the full (unsharded) checkpoint tensors."""

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]: ...

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor: ...


def _rows(full: torch.Tensor, start: int, count: int, dim: int = 0) -> torch.Tensor:
    """`full.narrow(dim, start, count)`, zero-padded where the range runs past the end."""
    available = max(0, min(count, full.shape[dim] - start))
    piece = full.narrow(dim, start, available)
    if available == count:
        return piece
    pad_shape = list(full.shape)
    pad_shape[dim] = count - available
    return torch.cat([piece, full.new_zeros(pad_shape)], dim=dim)


class ColumnParallelLinear(nn.Module):
    """`y_r = x W_r^T + b_r` where W_r stacks this rank's rows of every part.

    `part_slices[i] = (start, count)`: the rows of full part `i` (of `output_sizes[i]` rows) this
    rank keeps. Default: an even split of every part.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        tp: TensorParallel,
        part_slices: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        if part_slices is None:
            part_slices = [
                (tp.rank * (size // tp.world_size), tp.split(size, "output size")) for size in output_sizes
            ]
        self.part_slices = tuple(part_slices)
        self.local_sizes = tuple(count for _, count in self.part_slices)
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size))
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes))) if bias else None

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]:
        rows = sum(self.output_sizes) if part is None else self.output_sizes[part]
        return (rows, self.input_size) if name == "weight" else (rows,)

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's rows of part `part` of a full tensor, or of every part when `part` is None."""
        if part is not None:
            start, count = self.part_slices[part]
            return _rows(full, start, count)
        pieces = full.split(self.output_sizes, dim=0)
        return torch.cat([_rows(p, s, c) for p, (s, c) in zip(pieces, self.part_slices)], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={list(self.local_sizes)} of {list(self.output_sizes)}, tp={self.tp.world_size}"


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v merged; this rank keeps its query heads and the KV heads they read."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        tp: TensorParallel,
    ) -> None:
        local_q = tp.split(num_heads, "num_attention_heads")
        kv_start, local_kv = tp.kv_heads(num_heads, num_kv_heads)
        q_slice = (tp.rank * local_q * head_dim, local_q * head_dim)
        kv_slice = (kv_start * head_dim, local_kv * head_dim)
        super().__init__(
            hidden_size,
            (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
            bias=bias,
            tp=tp,
            part_slices=(q_slice, kv_slice, kv_slice),
        )
        self.num_heads, self.num_kv_heads = local_q, local_kv


class RowParallelLinear(nn.Module):
    """`y = sum_r x_r W_r^T + b`: this rank holds an even block of input columns."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.local_input_size = tp.split(input_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]:
        return (self.output_size, self.input_size) if name == "weight" else (self.output_size,)

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor:
        if name != "weight":
            return full
        return full.narrow(1, self.tp.rank * self.local_input_size, self.local_input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in={self.local_input_size} of {self.input_size}, out={self.output_size}, tp={self.tp.world_size}"


class VocabParallelEmbedding(nn.Module):
    """This rank holds vocabulary rows `[vocab_start, vocab_start + rows_per_rank)` (the last block
    is zero-padded when the vocabulary does not divide)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = -(-num_embeddings // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]:
        return (self.num_embeddings, self.embedding_dim)

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor:
        return _rows(full, self.vocab_start, self.rows_per_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"rows {self.vocab_start}..{self.vocab_start + self.rows_per_rank} of {self.num_embeddings}, "
            f"dim={self.embedding_dim}, tp={self.tp.world_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden rows onto this rank's vocabulary block and gathers `[n, vocab]` on every rank.

    Shares the embedding's sharding, so a tied head can reuse the embedding's parameter.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if not self.tp.enabled:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., : self.num_embeddings]
