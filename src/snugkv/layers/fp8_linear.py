"""FP8 linear layers: the parameters a quantized linear layer holds, how checkpoint tensors fill
them, and the GEMM its forward runs.

`install_fp8(layer, scheme, ...)` (on the meta model, before materialising) turns a tensor-parallel
linear layer (layers/parallel_linear.py) into an FP8 one:
- `weight`: float8_e4m3fn `[N_local, K_local]`;
- `weight_scale`: float32, per row `[N_local, 1]` for per-tensor and per-channel checkpoints (a
  per-tensor scale repeated over its part's rows, exact, so merged q|k|v or gate|up parts keep
  their own scales), or per block `[ceil(N_local / bn), ceil(K_local / bk)]`. Where a merged part
  or this rank's rows do not start on a block (SmolLM2's q is 4.5 blocks of 128 rows), the block
  scales are kept per row instead, `[N_local, ceil(K_local / bk)]` (each row its block's scales:
  exact, 4 bytes per 128 weights); a rank's columns must start on a block (activation groups
  follow them), or the layer is refused;
- `input_scale`: float32 `[1]`, static activations only: the largest of the merged parts' scales
  (they all quantize the same input; the largest clips none of them).
They are parameters, so the memory ledger counts them as weights and the weight arena holds them.

Loading (`Fp8Linear.load`): an FP8 checkpoint tensor is sliced as the layer cuts its weight
(`weight_slices`), its scales by the same cut (`shard_scale`); a float tensor (`--quantization fp8`,
random weights) is quantized whole first, then sliced, so tp=1 and tp=N hold the same bits.
`finish_loading` checks that every part got its weight, scale and input scale.

Forward: on CUDA (compute capability >= 8.9) the FP8 GEMM that measured fastest for this shape and
batch size (layers/fp8_gemm_choice.py). On CPU there is no FP8 GEMM: `finish_loading` dequantizes
the weight into `weight_dequantized` (the compute dtype) and forward is a plain GEMM on it
(layers/cpu_gemm.py: float32 arithmetic on a CPU without 16-bit matrix instructions), so
every CPU test runs the same loader. `emulate_fp8_activations()` also rounds the CPU's activations
as the GPU kernels do (what the agreement measurement uses to report the W8A8 numbers on CPU).
Must never import parallel_linear (which refers to this module's types).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from snugkv.kernels.fp8_quant import quantize_fp8_activation_reference
from snugkv.layers import cpu_gemm
from snugkv.layers.fp8_gemm_choice import run_fp8_gemm
from snugkv.layers.quantization import (
    FP8_DTYPE,
    SCALE_LEAVES,
    ActivationScales,
    Fp8Scheme,
    QuantizationError,
    WeightScales,
    check_block_cut,
    dequantize_weight,
    load_weight_or_scale,
    shard_scale,
)

CHECKPOINT_LEAVES = ("weight", *SCALE_LEAVES, "input_scale")
DUMMY_INPUT_SCALE = 1.0  # random weights have no calibration: static activations get scale 1
ACT_MODE = {
    ActivationScales.DYNAMIC_TOKEN: "token",
    ActivationScales.DYNAMIC_GROUP: "group",
    ActivationScales.STATIC_TENSOR: "static",
}
_emulate_activations = False


class SlicedLinear(Protocol):
    """What a quantized layer must offer (ColumnParallelLinear and RowParallelLinear do)."""

    weight: nn.Parameter

    def full_shape(self, name: str, part: int | None = None) -> tuple[int, ...]: ...

    def weight_slices(self, part: int | None) -> tuple[WeightSliceLike, ...]: ...


class WeightSliceLike(Protocol):
    @property
    def dim(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def local_start(self) -> int: ...
    @property
    def full_size(self) -> int: ...


@contextlib.contextmanager
def emulate_fp8_activations(enabled: bool = True) -> Iterator[None]:
    """On CPU, quantize each FP8 layer's input as its GPU kernel would, inside the block."""
    global _emulate_activations
    previous, _emulate_activations = _emulate_activations, enabled
    try:
        yield
    finally:
        _emulate_activations = previous


def install_fp8(
    layer: nn.Module, scheme: Fp8Scheme, *, compute_dtype: torch.dtype, dequantize: bool, name: str
) -> Fp8Linear:
    """Give `layer` (on the meta device) its FP8 parameters and an `Fp8Linear` as `layer.quant`.

    `dequantize`: keep a compute-dtype copy of the weight for `F.linear` (CPU). Refuses, before any
    weight is read, a tensor-parallel cut of the input columns that splits a weight block.
    """
    storage = scheme
    if scheme.weights is WeightScales.BLOCK:
        _check_column_cuts(layer, scheme, name)  # type: ignore[arg-type]
        if not _rows_on_blocks(layer, scheme):  # type: ignore[arg-type]
            storage = replace(scheme, block_n=1)
    quant = Fp8Linear(scheme, storage, compute_dtype=compute_dtype, dequantize=dequantize, name=name)
    current: torch.Tensor = layer.weight  # type: ignore[assignment]
    shape, device = tuple(current.shape), current.device
    layer.weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
    scale_shape = storage.scale_shape(shape) if scheme.weights is WeightScales.BLOCK else (shape[0], 1)
    layer.weight_scale = nn.Parameter(torch.empty(scale_shape, device=device), requires_grad=False)
    if scheme.activations is ActivationScales.STATIC_TENSOR:
        layer.input_scale = nn.Parameter(torch.empty(1, device=device), requires_grad=False)
    if dequantize:
        layer.register_buffer(
            "weight_dequantized", torch.empty(shape, dtype=compute_dtype, device=device), persistent=False
        )
    setattr(layer, "quant", quant)  # noqa: B010 (the layer's own attribute, typed there)
    return quant


def _rows_on_blocks(layer: SlicedLinear, scheme: Fp8Scheme) -> bool:
    """Whether every part's rows on this rank start (and end, but for a part's last block) on a block."""
    for part in _parts(layer):
        for cut in layer.weight_slices(part):
            if cut.dim != -2:
                continue
            end = cut.start + cut.count
            if cut.start % scheme.block_n or cut.local_start % scheme.block_n:
                return False
            if end % scheme.block_n and (end != cut.full_size or (part is None and len(_parts(layer)) > 1)):
                return False
    return True


def _check_column_cuts(layer: SlicedLinear, scheme: Fp8Scheme, name: str) -> None:
    for part in _parts(layer):
        for cut in layer.weight_slices(part):
            if cut.dim == -1:
                check_block_cut(
                    scheme, dim=-1, start=cut.start, count=cut.count, full_size=cut.full_size, what=name
                )


class Fp8Linear:
    """The FP8 half of one linear layer: its scheme, the loading bookkeeping, and its forward.

    `storage` is the scheme of the scales as kept: `scheme` itself, or with block scales kept per
    row (`block_n=1`) where rows do not start on blocks."""

    def __init__(
        self,
        scheme: Fp8Scheme,
        storage: Fp8Scheme,
        *,
        compute_dtype: torch.dtype,
        dequantize: bool,
        name: str,
    ) -> None:
        self.scheme = scheme
        self.storage = storage
        self.compute_dtype = compute_dtype
        self.dequantize = dequantize
        self.name = name
        self._weights: dict[int | None, bool] = {}  # part -> its weight was float (quantized here)
        self._scales: set[int | None] = set()
        self._input_scales: dict[int | None, float] = {}

    @property
    def act_mode(self) -> str:
        return ACT_MODE[self.scheme.activations]

    @property
    def block_n(self) -> int | None:
        """Rows per kept block scale (128, or 1 when kept per row); None for row scales."""
        return self.storage.block_n if self.scheme.weights is WeightScales.BLOCK else None

    # -- loading ---------------------------------------------------------------------------
    def load(self, layer: SlicedLinear, leaf: str, tensor: torch.Tensor, part: int | None, what: str) -> None:
        """One checkpoint tensor (`weight`, `weight_scale`/`weight_scale_inv`, `input_scale`) of part
        `part` (None: the layer's whole, unmerged tensor) into this rank's parameters."""
        if leaf == "input_scale":
            if tensor.numel() != 1:
                raise QuantizationError(f"{what} has {tensor.numel()} values; a static input scale has one")
            if self.scheme.activations is not ActivationScales.STATIC_TENSOR:
                raise QuantizationError(
                    f"{what}: a static input scale, but the quantization_config says {self.scheme.activations}"
                )
            if part in self._input_scales:
                raise QuantizationError(f"the checkpoint holds {what} twice")
            self._input_scales[part] = float(tensor.float().reshape(()))
            return
        load_weight_or_scale(
            leaf,
            tensor,
            scheme=self.scheme,
            full_shape=layer.full_shape("weight", part),
            weights_seen=self._weights,
            scales_seen=self._scales,
            part=part,
            store_weight=lambda q: self._store_weight(layer, q, part),
            store_scale=lambda scale: self._store_scale(layer, scale, part, what),
            what=what,
            taker="an FP8 layer takes",
        )

    def _store_weight(self, layer: SlicedLinear, q: torch.Tensor, part: int | None) -> None:
        with torch.no_grad():
            for cut in layer.weight_slices(part):
                layer.weight.narrow(cut.dim, cut.local_start, cut.count).copy_(
                    q.narrow(cut.dim, cut.start, cut.count)
                )

    def _store_scale(self, layer: SlicedLinear, scale: torch.Tensor, part: int | None, what: str) -> None:
        """`scale` in the checkpoint layout of part `part`'s full weight, into this rank's scales."""
        destination: torch.Tensor = layer.weight_scale  # type: ignore[attr-defined]
        scheme = self.scheme
        with torch.no_grad():
            for cut in layer.weight_slices(part):
                if scheme.weights is WeightScales.BLOCK and cut.dim == -2 and self.storage.block_n == 1:
                    rows = scale.repeat_interleave(scheme.block_n, dim=-2).narrow(-2, cut.start, cut.count)
                    destination.narrow(-2, cut.local_start, cut.count).copy_(rows)
                    continue
                piece = shard_scale(
                    scale,
                    scheme,
                    dim=cut.dim,
                    start=cut.start,
                    count=cut.count,
                    full_size=cut.full_size,
                    what=what,
                )
                if scheme.weights is WeightScales.BLOCK:
                    target, piece = self._block_target(destination, scale, piece, cut)
                elif cut.dim == -2:
                    target = destination.narrow(-2, cut.local_start, cut.count)
                else:
                    target = destination  # row-parallel: every output row is this rank's
                target.copy_(piece.expand_as(target))
        self._scales.add(part)

    def _block_target(
        self, destination: torch.Tensor, scale: torch.Tensor, piece: torch.Tensor, cut: WeightSliceLike
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a block-scale piece goes; kept per row, a column cut's piece is repeated per row."""
        if cut.dim == -2:  # rows on blocks (per-row rows are handled before)
            block = self.scheme.block_n
            return destination.narrow(-2, cut.local_start // block, piece.shape[-2]), piece
        columns = destination.narrow(-1, cut.local_start // self.scheme.block_k, piece.shape[-1])
        if self.storage.block_n == 1:
            piece = piece.repeat_interleave(self.scheme.block_n, dim=-2)[..., : destination.shape[-2], :]
        return columns, piece

    def init_dummy(self, layer: SlicedLinear, generator: torch.Generator, std: float) -> None:
        """Random weights drawn as an unquantized layer of the compute dtype draws them (same
        generator calls), then quantized: an FP8 model's random weights are its bf16 twin's, rounded."""
        full = torch.empty(layer.full_shape("weight"), dtype=self.compute_dtype, device=layer.weight.device)
        full.normal_(0.0, std, generator=generator)
        self.load(layer, "weight", full, None, f"{self.name}.weight (random)")
        if self.scheme.activations is ActivationScales.STATIC_TENSOR:
            self._input_scales[None] = DUMMY_INPUT_SCALE

    def finish_loading(self, layer: SlicedLinear) -> None:
        """Refuse a layer some part of which got no weight, scale or input scale; then, on CPU,
        dequantize. Resets the bookkeeping, so the weights can be loaded again (wake)."""
        weights, scales, inputs = self._weights, self._scales, self._input_scales
        self._weights, self._scales, self._input_scales = {}, set(), {}
        complete = {None} if None in weights else set(_parts(layer))
        if set(weights) != complete:
            missing = sorted(complete - set(weights), key=str)
            raise QuantizationError(f"{self.name}: the checkpoint lacks the weight (part(s) {missing})")
        unscaled = [p for p, was_float in weights.items() if not was_float and p not in scales]
        if unscaled:
            raise QuantizationError(
                f"{self.name}: FP8 weight(s) of part(s) {unscaled} came without weight_scale / weight_scale_inv"
            )
        if self.scheme.activations is ActivationScales.STATIC_TENSOR:
            if set(inputs) != set(weights):
                raise QuantizationError(
                    f"{self.name}: static activation scales need an input_scale for every part; "
                    f"got them for {sorted(inputs, key=str)} of {sorted(weights, key=str)}"
                )
            with torch.no_grad():
                layer.input_scale.fill_(max(inputs.values()))  # type: ignore[attr-defined]
        if self.dequantize:
            with torch.no_grad():
                layer.weight_dequantized.copy_(  # type: ignore[attr-defined]
                    dequantize_weight(layer.weight, layer.weight_scale, self.storage, self.compute_dtype)  # type: ignore[attr-defined]
                )

    # -- forward ---------------------------------------------------------------------------
    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + bias` for `x [..., K]`."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if self.dequantize:
            if _emulate_activations:
                rows = self._round_activations(layer, rows)
            out = cpu_gemm.linear(rows, layer.weight_dequantized, bias)  # type: ignore[arg-type]
        else:
            out = run_fp8_gemm(self, layer, rows, bias)  # type: ignore[arg-type]
        return out.reshape(*lead, out.shape[-1])

    def _round_activations(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        static = getattr(layer, "input_scale", None)
        q, scale = quantize_fp8_activation_reference(
            rows.contiguous(), self.act_mode, group_size=self.scheme.block_k, static_scale=static
        )
        if self.act_mode == "group":
            scale = scale.repeat_interleave(self.scheme.block_k, dim=1)[:, : rows.shape[1]]
        return (q.float() * scale).to(rows.dtype)


def _parts(layer: SlicedLinear) -> tuple[int | None, ...]:
    """The parts a merged layer's checkpoint stores apart (q, k, v), or (None,) for one tensor."""
    sizes = getattr(layer, "output_sizes", ())
    return tuple(range(len(sizes))) if len(sizes) > 1 else (None,)
