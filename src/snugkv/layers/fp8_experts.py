"""FP8 mixture-of-experts weights: a stacked expert parameter (layers/moe.ExpertWeights, `w13` or
`w2`) held as float8_e4m3fn with float32 scales, filled from per-expert checkpoint tensors.

`install_fp8_experts(layer, scheme, ...)` (on the meta model, before materialising) gives the layer:
- `weight`: float8_e4m3fn, the same 2-D shape as the float parameter (`[E * 2 * I_r, H]` for w13,
  `[E * H, I_r]` for w2);
- `weight_scale`: float32, per row `[rows, 1]` (per-tensor and per-channel checkpoints,
  `--quantization fp8`: a per-tensor scale repeated over its part's rows), or per 128 x 128 block
  `[rows / 128, ceil(cols / 128)]`, or, where a part's rows are off the block grid (I_r or H not a
  multiple of 128), per row `[rows, ceil(cols / 128)]` (each row its block's scales: exact);
- on CPU `weight_dequantized` (the compute dtype), what the torch reference multiplies.
Every checkpoint part (`experts.{e}.gate_proj` is part 2e of w13, `up_proj` 2e + 1, `down_proj`
part e of w2; models/moe.py) is quantized by itself when it comes as float, so a part's scales are
its own, as a published FP8 checkpoint's are; this rank keeps its rows of gate and up and its
columns of down, and the scales that go with them (a column cut must start on a block).

The experts run weight-only (kernels/moe_experts.py: the fp8 weight converted to the activations'
dtype inside the grouped GEMM, its scales applied per row or per block): a static `input_scale` in
the checkpoint is accepted and not used. `ExpertWeights.quant` is the `Fp8Experts` below; the shared
loader (models/weights.py) hands it the layer's checkpoint tensors, as it does an FP8 linear layer's.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from snugkv.distributed.group import TensorParallel
from snugkv.kernels.moe_experts import ExpertScale
from snugkv.layers.quantization import (
    FP8_DTYPE,
    Fp8Scheme,
    QuantizationError,
    WeightScales,
    check_block_cut,
    load_weight_or_scale,
    shard_scale,
)


class StackedExpertLayer(Protocol):
    """What the FP8 state needs of layers/moe.ExpertWeights."""

    kind: str
    weight: nn.Parameter
    num_experts: int
    hidden_size: int
    intermediate_size: int
    local_intermediate: int
    tp: TensorParallel

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]: ...


def _cut(layer: StackedExpertLayer) -> tuple[int, int, int, int]:
    """(dim, start, count, full size) of this rank's piece of one full checkpoint part."""
    start = layer.tp.rank * layer.local_intermediate
    dim = -2 if layer.kind == "w13" else -1  # w13 keeps rows of gate / up, w2 columns of down
    return dim, start, layer.local_intermediate, layer.intermediate_size


def _part_rows(layer: StackedExpertLayer, part: int) -> tuple[int, int]:
    """(first local row, rows) of checkpoint part `part` in the stacked parameter."""
    rows = layer.local_intermediate if layer.kind == "w13" else layer.hidden_size
    return part * rows, rows


def num_parts(layer: StackedExpertLayer) -> int:
    return layer.num_experts * (2 if layer.kind == "w13" else 1)


def install_fp8_experts(
    layer: nn.Module, scheme: Fp8Scheme, *, compute_dtype: torch.dtype, dequantize: bool, name: str
) -> Fp8Experts:
    """Give `layer` (an ExpertWeights on the meta device) its FP8 parameters and `layer.quant`.
    Refuses, before any weight is read, a tensor-parallel cut of down's columns inside a block."""
    experts: StackedExpertLayer = layer  # type: ignore[assignment]
    rows, cols = experts.weight.shape
    rows_per_scale = 1
    if scheme.weights is WeightScales.BLOCK:
        dim, start, count, full = _cut(experts)
        if dim == -1:
            check_block_cut(scheme, dim=-1, start=start, count=count, full_size=full, what=name)
        part_rows = _part_rows(experts, 0)[1]
        rows_per_scale = scheme.block_n if part_rows % scheme.block_n == 0 else 1
        scale_shape: tuple[int, ...] = (rows // rows_per_scale, -(-cols // scheme.block_k))
    else:
        scale_shape = (rows, 1)
    device = experts.weight.device
    layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE, device=device), requires_grad=False)
    layer.weight_scale = nn.Parameter(torch.empty(scale_shape, device=device), requires_grad=False)
    if dequantize:
        layer.register_buffer(
            "weight_dequantized",
            torch.empty(rows, cols, dtype=compute_dtype, device=device),
            persistent=False,
        )
    quant = Fp8Experts(scheme, rows_per_scale, compute_dtype=compute_dtype, dequantize=dequantize, name=name)
    setattr(layer, "quant", quant)  # noqa: B010 (the layer's own attribute, typed there)
    return quant


class Fp8Experts:
    """The FP8 half of one stacked expert parameter: loading bookkeeping and the kernels' scales."""

    def __init__(
        self,
        scheme: Fp8Scheme,
        rows_per_scale: int,
        *,
        compute_dtype: torch.dtype,
        dequantize: bool,
        name: str,
    ) -> None:
        self.scheme = scheme
        self.rows_per_scale = rows_per_scale  # block scales: 128, or 1 where rows are kept apart
        self.compute_dtype = compute_dtype
        self.dequantize = dequantize
        self.name = name
        self._weights: dict[int | None, bool] = {}  # part -> its weight was float (quantized here)
        self._scales: set[int | None] = set()

    @property
    def per_block(self) -> bool:
        return self.scheme.weights is WeightScales.BLOCK

    def load(self, layer: nn.Module, leaf: str, tensor: torch.Tensor, part: int | None, what: str) -> None:
        """One checkpoint tensor (`weight`, `weight_scale` / `weight_scale_inv`, `input_scale`) of
        expert part `part` into this rank's parameters."""
        experts: StackedExpertLayer = layer  # type: ignore[assignment]
        if part is None:
            raise QuantizationError(
                f"{what}: FP8 experts load from per-expert tensors (experts.N.gate_proj / up_proj / "
                "down_proj), not from one tensor of every expert"
            )
        if leaf == "input_scale":  # the experts run weight-only: a static activation scale is unused
            if tensor.numel() != 1:
                raise QuantizationError(f"{what} has {tensor.numel()} values; a static input scale has one")
            return
        expert = part
        load_weight_or_scale(
            leaf,
            tensor,
            scheme=self.scheme,
            full_shape=experts.full_shape("weight", expert),
            weights_seen=self._weights,
            scales_seen=self._scales,
            part=expert,
            store_weight=lambda q: self._store_weight(experts, q, expert),
            store_scale=lambda scale: self._store_scale(experts, scale, expert, what),
            what=what,
            taker="FP8 experts take",
        )

    def _store_weight(self, layer: StackedExpertLayer, q: torch.Tensor, part: int) -> None:
        dim, start, count, _ = _cut(layer)
        first, rows = _part_rows(layer, part)
        with torch.no_grad():
            layer.weight.narrow(0, first, rows).copy_(q.narrow(dim, start, count))

    def _store_scale(self, layer: StackedExpertLayer, scale: torch.Tensor, part: int, what: str) -> None:
        """`scale` in the checkpoint layout of part `part`'s full weight, into this rank's scales."""
        dim, start, count, full = _cut(layer)
        first, rows = _part_rows(layer, part)
        destination: torch.Tensor = layer.weight_scale  # type: ignore[attr-defined]
        scheme = self.scheme
        with torch.no_grad():
            if not self.per_block:  # one scale per row: a tensor scale repeated, a channel one cut
                piece = shard_scale(
                    scale, scheme, dim=dim, start=start, count=count, full_size=full, what=what
                )
                destination.narrow(0, first, rows).copy_(piece.expand(rows, 1))
            elif dim == -2:  # w13: this rank's rows of gate or up
                if self.rows_per_scale == 1:
                    piece = scale.repeat_interleave(scheme.block_n, dim=0).narrow(0, start, count)
                    destination.narrow(0, first, rows).copy_(piece)
                else:
                    piece = shard_scale(
                        scale, scheme, dim=dim, start=start, count=count, full_size=full, what=what
                    )
                    destination.narrow(0, first // scheme.block_n, piece.shape[0]).copy_(piece)
            else:  # w2: every row of down, this rank's columns
                piece = shard_scale(
                    scale, scheme, dim=dim, start=start, count=count, full_size=full, what=what
                )
                if self.rows_per_scale == 1:
                    destination.narrow(0, first, rows).copy_(
                        piece.repeat_interleave(scheme.block_n, dim=0)[:rows]
                    )
                else:
                    destination.narrow(0, first // scheme.block_n, piece.shape[0]).copy_(piece)
        self._scales.add(part)

    def init_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Random weights drawn as the float twin draws them (the full stacked tensor, the same
        generator calls), then each part quantized by itself."""
        experts: StackedExpertLayer = layer  # type: ignore[assignment]
        full = torch.empty(
            experts.full_shape("weight"), dtype=self.compute_dtype, device=experts.weight.device
        )
        full.normal_(0.0, std, generator=generator)
        part_rows = full.shape[0] // num_parts(experts)
        for part in range(num_parts(experts)):
            self.load(
                layer, "weight", full.narrow(0, part * part_rows, part_rows), part, f"{self.name} (random)"
            )

    def finish_loading(self, layer: nn.Module) -> None:
        """Refuse a layer some part of which got no weight or no scale; then, on CPU, dequantize.
        Resets the bookkeeping, so the weights can be loaded again (wake)."""
        experts: StackedExpertLayer = layer  # type: ignore[assignment]
        weights, scales = self._weights, self._scales
        self._weights, self._scales = {}, set()
        missing = sorted(set(range(num_parts(experts))) - set(weights))
        if missing:
            raise QuantizationError(
                f"{self.name}: the checkpoint lacks the weight of expert part(s) {missing[:8]}"
            )
        unscaled = sorted(
            p for p, was_float in weights.items() if p is not None and not was_float and p not in scales
        )
        if unscaled:
            raise QuantizationError(
                f"{self.name}: FP8 weight(s) of expert part(s) {unscaled[:8]} came without weight_scale / "
                "weight_scale_inv"
            )
        if self.dequantize:
            weight = experts.weight.view(experts.num_experts, -1, experts.weight.shape[-1])
            dequantized: torch.Tensor = layer.weight_dequantized  # type: ignore[assignment]
            with torch.no_grad():
                dequantized.copy_(self.scale(layer).dequantized(weight, self.compute_dtype).flatten(0, 1))

    def scale(self, layer: nn.Module) -> ExpertScale:
        """The kernels' view of the scales: `[E, rows / rows_per_scale, columns]` per expert."""
        experts: StackedExpertLayer = layer  # type: ignore[assignment]
        scale: torch.Tensor = layer.weight_scale  # type: ignore[assignment]
        return ExpertScale(
            scale.view(experts.num_experts, -1, scale.shape[-1]), self.rows_per_scale, self.per_block
        )
