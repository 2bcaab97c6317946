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
`weight_slices(part)` says the same as `shard_weight` in numbers (which rows or columns of the full
tensor, placed where), so quantization scales (layers/fp8_linear.py) follow the weight's cut.

A linear layer may be quantized (`quant`, set by snugkv.models.quantization before the weights are
materialised): its `weight` is then float8_e4m3fn with scales beside it, and `quant` runs the GEMM.
Otherwise the GEMM is `F.linear`, or for 1-4 rows on a GPU what layers/dense_gemm_choice.py
measured faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from snugkv.distributed.group import TensorParallel
from snugkv.layers.dense_gemm_choice import dense_linear

if TYPE_CHECKING:
    from snugkv.layers.fp8_linear import Fp8Linear


@runtime_checkable
class ShardedLayer(Protocol):
    """A layer that knows how its parameters relate to the full (unsharded) checkpoint tensors."""

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]: ...

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class WeightSlice:
    """Entries `[start, start + count)` along `dim` (-2: output rows, -1: input columns) of a full
    checkpoint tensor with `full_size` entries there go to `[local_start, local_start + count)` of
    this rank's parameter; the other dim is kept whole."""

    dim: int
    start: int
    count: int
    local_start: int
    full_size: int


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
        self.quant: Fp8Linear | None = None

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]:
        rows = sum(self.output_sizes) if part is None else self.output_sizes[part]
        return (rows, self.input_size) if name == "weight" else (rows,)

    def weight_slices(self, part: int | None) -> tuple[WeightSlice, ...]:
        """The rows of part `part`'s full tensor this rank keeps, or of the merged full tensor (every
        part stacked) when `part` is None."""
        parts = range(len(self.output_sizes)) if part is None else (part,)
        full_size = sum(self.output_sizes) if part is None else self.output_sizes[part]
        slices = []
        for index in parts:
            offset = sum(self.output_sizes[:index]) if part is None else 0
            start, count = self.part_slices[index]
            slices.append(WeightSlice(-2, offset + start, count, sum(self.local_sizes[:index]), full_size))
        return tuple(slices)

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's rows of part `part` of a full tensor, or of every part when `part` is None."""
        pieces = [_rows(full, s.start, s.count) for s in self.weight_slices(part)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(self, x, self.bias)
        return dense_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        quant = f", {self.quant.scheme.name}" if self.quant is not None else ""
        return f"in={self.input_size}, out={list(self.local_sizes)} of {list(self.output_sizes)}, tp={self.tp.world_size}{quant}"


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
        self.quant: Fp8Linear | None = None

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]:
        return (self.output_size, self.input_size) if name == "weight" else (self.output_size,)

    def weight_slices(self, part: int | None) -> tuple[WeightSlice, ...]:
        start = self.tp.rank * self.local_input_size
        return (WeightSlice(-1, start, self.local_input_size, 0, self.input_size),)

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor:
        if name != "weight":
            return full
        (cut,) = self.weight_slices(part)
        return full.narrow(1, cut.start, cut.count)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(self, x, bias)
        return dense_linear(x, self.weight, bias)

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, no bias, no all-reduce (for a caller that reduces it with
        others once: the MoE layer's shared experts); FP8 when the layer is."""
        return self._linear(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self._linear(x, self.bias)
        out = self.tp.all_reduce(self._linear(x, None))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        quant = f", {self.quant.scheme.name}" if self.quant is not None else ""
        return f"in={self.local_input_size} of {self.input_size}, out={self.output_size}, tp={self.tp.world_size}{quant}"


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
        logits = dense_linear(hidden, self.weight)
        if not self.tp.enabled:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., : self.num_embeddings]
