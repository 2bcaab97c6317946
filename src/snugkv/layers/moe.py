"""The sparse MLP of a mixture-of-experts decoder layer: router, stacked experts, shared experts.

`SparseMoE` owns a layer's expert parameters and how they split over tensor-parallel ranks; the
numerics (routing, the grouped GEMMs, their torch reference) live in snugkv.kernels.moe_experts.
- `gate` (`MoERouter`): the router, `[E, H]`, whole on every rank, so every rank routes alike.
- `experts` (`StackedExperts`): every expert's weights in two parameters, `w13` (gate rows, then
  up rows, per expert: `[E, 2I, H]`) and `w2` (`[E, H, I]`), each stored 2-D (`[E * 2I, H]`,
  `[E * H, I]`: the same memory) so a checkpoint's per-expert tensors load into row ranges. Under
  tensor parallelism every expert's intermediate dimension splits as a dense MLP's does: a rank
  keeps I / tp rows of each gate and up and the same I / tp columns of down.
- `shared_experts` (DeepSeek-V2): a dense gated MLP every token goes through, split the same way.
The routed and shared outputs are this rank's partial sums; they are added, then all-reduced once.

Nothing here keeps a buffer between calls: the routing and sorting buffers are made per call, at
sizes fixed by the token count (never by the routing), so the activation peak the engine measures
and the graphs' pools cover every routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from snugkv.distributed.group import TensorParallel
from snugkv.kernels.moe_experts import ExpertScale, ExpertScales, fused_moe
from snugkv.kernels.moe_routing import Routing, select_experts
from snugkv.layers.activation import GatedActivation
from snugkv.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from snugkv.layers.fp8_experts import Fp8Experts


@dataclass(frozen=True, slots=True)
class MoEShape:
    """What a MoE layer needs from its model's config."""

    hidden_size: int
    intermediate_size: int  # per routed expert, before tensor parallelism
    routing: Routing
    router_float32: bool = False  # DeepSeek-V2 computes the router in float32
    shared_intermediate_size: int = 0  # all shared experts together; 0: none
    shared_bias: bool = False

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts


class MoERouter(nn.Module):
    """Router logits `[T, E]` (float32 when `float32`, else in the hidden dtype), replicated."""

    def __init__(self, num_experts: int, hidden_size: int, *, float32: bool) -> None:
        super().__init__()
        self.float32 = float32
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32 if float32 else None)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class ExpertWeights(nn.Module):
    """One stacked parameter of every expert, `weight` 2-D, with this rank's part of each expert.

    `kind="w13"`: `[E * 2 * I_r, H]`; checkpoint part `2e` is expert e's gate `[I, H]`, part
    `2e + 1` its up. `kind="w2"`: `[E * H, I_r]`; part `e` is expert e's down `[H, I]`.
    """

    def __init__(
        self, kind: str, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel
    ):
        super().__init__()
        if kind not in ("w13", "w2"):
            raise ValueError(f"expert weights are w13 or w2, not {kind!r}")
        self.kind, self.tp = kind, tp
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts,
            hidden_size,
            intermediate_size,
        )
        self.local_intermediate = tp.split(intermediate_size, "moe_intermediate_size")
        if kind == "w13":
            self.part_sizes = (self.local_intermediate,) * (2 * num_experts)
            shape = (num_experts * 2 * self.local_intermediate, hidden_size)
        else:
            self.part_sizes = (hidden_size,) * num_experts
            shape = (num_experts * hidden_size, self.local_intermediate)
        self.weight = nn.Parameter(torch.empty(shape))
        self.quant: Fp8Experts | None = None  # FP8 experts (layers/fp8_experts.install_fp8_experts)
        self.weight_dequantized: torch.Tensor  # FP8 on CPU only

    def stacked(self) -> torch.Tensor:
        """`[E, 2I_r, H]` (w13) or `[E, H, I_r]` (w2): a view of the parameter (FP8: of the fp8
        weight on GPU, of the dequantized one on CPU)."""
        weight = self.weight_dequantized if self.quant is not None and self.quant.dequantize else self.weight
        return weight.view(self.num_experts, -1, weight.shape[1])

    def fp8_scale(self) -> ExpertScale | None:
        """The scales the kernels apply to `stacked()`, when it is fp8 (GPU FP8 experts)."""
        if self.quant is None or self.quant.dequantize:
            return None
        return self.quant.scale(self)

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]:
        experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        if self.kind == "w13":
            return (inter, hidden) if part is not None else (experts * 2 * inter, hidden)
        return (hidden, inter) if part is not None else (experts * hidden, inter)

    def shard_weight(self, name: str, full: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's rows of a gate or up part (its columns of a down part), or of every part."""
        start, count = self.tp.rank * self.local_intermediate, self.local_intermediate
        if self.kind == "w2":
            return full.narrow(1, start, count)
        if part is not None:
            return full.narrow(0, start, count)
        hidden = full.shape[1]
        per_part = full.view(self.num_experts * 2, self.intermediate_size, hidden)
        return per_part.narrow(1, start, count).reshape(-1, hidden)

    def extra_repr(self) -> str:
        return f"{self.kind}: {self.num_experts} experts, I={self.local_intermediate} of {self.intermediate_size}"


class StackedExperts(nn.Module):
    def __init__(self, shape: MoEShape, tp: TensorParallel) -> None:
        super().__init__()
        args = (shape.num_experts, shape.hidden_size, shape.intermediate_size, tp)
        self.w13 = ExpertWeights("w13", *args)
        self.w2 = ExpertWeights("w2", *args)

    def fp8_scales(self) -> ExpertScales | None:
        w13, w2 = self.w13.fp8_scale(), self.w2.fp8_scale()
        return None if w13 is None or w2 is None else ExpertScales(w13, w2)


class SharedExperts(nn.Module):
    """The shared experts' dense gated MLP; `partial` is this rank's share before the all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (intermediate_size,) * 2, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act = GatedActivation("silu")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        # the down projection without its own all-reduce: the MoE layer reduces once for both parts
        return self.down_proj.local_linear(self.act(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """`forward(hidden [T, H]) -> [T, H]`: the routed experts' weighted sum, plus the shared experts."""

    def __init__(self, shape: MoEShape, tp: TensorParallel) -> None:
        super().__init__()
        self.shape, self.tp = shape, tp
        self.routing = shape.routing
        self.gate = MoERouter(shape.num_experts, shape.hidden_size, float32=shape.router_float32)
        self.experts = StackedExperts(shape, tp)
        self.shared_experts: SharedExperts | None = None
        if shape.shared_intermediate_size:
            self.shared_experts = SharedExperts(
                shape.hidden_size, shape.shared_intermediate_size, bias=shape.shared_bias, tp=tp
            )

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int32 [T, k]) this layer picks for `hidden`."""
        return select_experts(self.gate(hidden), self.routing)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = fused_moe(
            hidden,
            self.gate(hidden),
            self.experts.w13.stacked(),
            self.experts.w2.stacked(),
            self.routing,
            scales=self.experts.fp8_scales(),
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(hidden)
        if self.tp.enabled:
            out = self.tp.all_reduce(out)
        if self.shared_experts is not None and self.shared_experts.down_proj.bias is not None:
            out = out + self.shared_experts.down_proj.bias
        return out

    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights on this rank (what a token that picks it reads)."""
        weight = self.experts.w13.weight
        return (
            (weight.numel() + self.experts.w2.weight.numel())
            * weight.element_size()
            // self.shape.num_experts
        )
