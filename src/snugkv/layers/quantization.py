"""FP8 weight schemes: what a scheme stores, and how a weight is quantized, dequantized and sharded.

A weight `W [..., N, K]` (N output rows, K input columns; leading dims, such as stacked experts,
are carried along) becomes `q` (float8_e4m3fn, same shape) and `scale` (float32) with
`W ~= q * scale`, the scale broadcast over its group:
- `tensor`: one scale per matrix, shape `[..., 1, 1]` (compressed-tensors `strategy: tensor`);
- `channel`: one per output row, `[..., N, 1]` (compressed-tensors `strategy: channel`);
- `block`: one per `block_n x block_k` tile, `[..., ceil(N / block_n), ceil(K / block_k)]`
  (`quant_method: fp8` with `weight_block_size`, stored as `weight_scale_inv`: it multiplies too).
Activations are quantized when the GEMM runs (kernels/fp8_quant.py): per token (dynamic), per
token and 128-column group (dynamic, with block weights) or with one static scale per tensor.

Sharding: a tensor-parallel rank keeps rows (column-parallel) or columns (row-parallel) of a full
weight; `shard_scale` gives the scales of exactly that piece, so a rank's `(q, scale)` is the
corresponding slice of the full quantized tensor and every tp size holds the same numbers. A block
scale can only follow a cut on a block boundary; any other cut is refused with the sizes involved.

This module owns the numerics of quantizing a weight (absmax / 448, round to nearest even); it never
touches a layer or a checkpoint file.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_FLOOR = 1e-12  # an all-zero group gets this scale rather than a division by zero


class WeightScales(enum.StrEnum):
    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"


class ActivationScales(enum.StrEnum):
    DYNAMIC_TOKEN = "dynamic-token"  # absmax of each row, at run time
    DYNAMIC_GROUP = "dynamic-group"  # absmax of each row's block_k columns, at run time
    STATIC_TENSOR = "static-tensor"  # one scale from the checkpoint (`input_scale`)


class QuantizationError(ValueError):
    """A quantized weight or scale that does not fit the layer it is loaded into, or a tensor-parallel
    cut the scales cannot follow; the message names the sizes and what to change."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How one linear layer's weight and input are quantized."""

    weights: WeightScales
    activations: ActivationScales
    block_n: int = 128  # block scales only: rows per scale
    block_k: int = 128  # block scales only: columns per scale (also the activation group size)

    def __post_init__(self) -> None:
        if self.activations is ActivationScales.DYNAMIC_GROUP and self.weights is not WeightScales.BLOCK:
            raise QuantizationError("per-group activation scales come only with block weight scales")
        if self.weights is WeightScales.BLOCK and self.activations is not ActivationScales.DYNAMIC_GROUP:
            raise QuantizationError(
                "block weight scales are run with dynamic per-group activation scales only "
                f"(got {self.activations})"
            )

    @property
    def name(self) -> str:
        """What the startup report and /server_info say: `fp8 (channel weights, dynamic-token activations)`."""
        weights = (
            f"block {self.block_n}x{self.block_k}" if self.weights is WeightScales.BLOCK else self.weights
        )
        return f"fp8 ({weights} weights, {self.activations} activations)"

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint-layout scale shape of a weight of `weight_shape` (see the module docstring)."""
        *lead, rows, cols = weight_shape
        if self.weights is WeightScales.TENSOR:
            return (*lead, 1, 1)
        if self.weights is WeightScales.CHANNEL:
            return (*lead, rows, 1)
        return (*lead, math.ceil(rows / self.block_n), math.ceil(cols / self.block_k))


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_n: int, block_k: int) -> torch.Tensor:
    """Block scales `[..., ceil(rows/bn), ceil(cols/bk)]` repeated to one per element `[..., rows, cols]`."""
    full = scale.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return full[..., :rows, :cols]


def quantize_weight(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of a float weight `[..., N, K]` in the scheme's checkpoint layout."""
    values = weight.float()
    rows, cols = values.shape[-2:]
    if scheme.weights is WeightScales.TENSOR:
        amax = values.abs().amax(dim=(-2, -1), keepdim=True)
        scale = amax.clamp(min=SCALE_FLOOR) / FP8_MAX
        expanded = scale
    elif scheme.weights is WeightScales.CHANNEL:
        amax = values.abs().amax(dim=-1, keepdim=True)
        scale = amax.clamp(min=SCALE_FLOOR) / FP8_MAX
        expanded = scale
    else:
        bn, bk = scheme.block_n, scheme.block_k
        padded_rows, padded_cols = math.ceil(rows / bn) * bn, math.ceil(cols / bk) * bk
        padded = torch.nn.functional.pad(values.abs(), (0, padded_cols - cols, 0, padded_rows - rows))
        tiles = padded.unflatten(-1, (padded_cols // bk, bk)).unflatten(-3, (padded_rows // bn, bn))
        amax = tiles.amax(dim=(-3, -1))  # [..., N/bn, K/bk]
        scale = amax.clamp(min=SCALE_FLOOR) / FP8_MAX
        expanded = _expand_blocks(scale, rows, cols, bn, bk)
    q = (values / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, dtype: torch.dtype
) -> torch.Tensor:
    """`q * scale` in `dtype`, the scale in the scheme's layout (or per row, `[..., N, 1]`, for the
    tensor and channel schemes: how layers keep them)."""
    rows, cols = q.shape[-2:]
    if scheme.weights is WeightScales.BLOCK:
        scale = _expand_blocks(scale.float(), rows, cols, scheme.block_n, scheme.block_k)
    return (q.float() * scale.float()).to(dtype)


def checkpoint_scale(
    scale: torch.Tensor, scheme: Fp8Scheme, weight_shape: tuple[int, ...], name: str
) -> torch.Tensor:
    """A checkpoint's scale tensor in the scheme's layout: a per-tensor scale may be stored as `[]` or
    `[1]`, a per-channel one as `[N]` or `[N, 1]`; anything else of the wrong size is refused."""
    expected = scheme.scale_shape(weight_shape)
    if tuple(scale.shape) == expected:
        return scale.float()
    if scale.numel() == math.prod(expected) and scheme.weights is not WeightScales.BLOCK:
        return scale.float().reshape(expected)
    raise QuantizationError(
        f"{name} has shape {tuple(scale.shape)} but a {scheme.weights} scale of a weight of shape "
        f"{weight_shape} has shape {expected} (does the quantization_config match the checkpoint?)"
    )


SCALE_LEAVES = ("weight_scale", "weight_scale_inv")  # both multiply (DeepSeek's "inv" name is historic)


def load_weight_or_scale(
    leaf: str,
    tensor: torch.Tensor,
    *,
    scheme: Fp8Scheme,
    full_shape: tuple[int, ...],
    weights_seen: dict[int | None, bool],
    scales_seen: set[int | None],
    part: int | None,
    store_weight: Callable[[torch.Tensor], None],
    store_scale: Callable[[torch.Tensor], None],
    what: str,
    taker: str,
) -> None:
    """A checkpoint's weight or weight scale of one part, as every FP8 loader takes it: a scale is
    stored once (in the scheme's layout), an FP8 weight of the part's full shape as it is, a 16- or
    32-bit float one quantized here with its scale stored beside; anything else, a wrong shape or
    a part seen twice, is a `QuantizationError` naming `what` (`taker` says who refuses a dtype).
    `weights_seen[part]` records whether the weight was float (quantized here); the `store_*`
    callables put the part's weight and scale in place (a linear layer's rows, an expert's)."""
    if leaf in SCALE_LEAVES:
        if part in scales_seen:
            raise QuantizationError(f"the checkpoint holds {what} (or its other scale name) twice")
        store_scale(checkpoint_scale(tensor, scheme, full_shape, what))
        return
    if tuple(tensor.shape) != full_shape:
        raise QuantizationError(
            f"{what} has shape {tuple(tensor.shape)} but the model expects {full_shape} "
            "(does the config match the weights?)"
        )
    if part in weights_seen:
        raise QuantizationError(f"the checkpoint holds {what} twice")
    if tensor.dtype == FP8_DTYPE:
        weights_seen[part] = False
        store_weight(tensor)
        return
    if tensor.dtype.is_floating_point and tensor.element_size() >= 2:
        q, scale = quantize_weight(tensor, scheme)
        weights_seen[part] = True
        store_weight(q)
        store_scale(scale)
        return
    raise QuantizationError(
        f"{what} is {tensor.dtype}; {taker} float8_e4m3fn weights with their scales, or "
        "16/32-bit float weights to quantize"
    )


def shard_scale(
    scale: torch.Tensor, scheme: Fp8Scheme, *, dim: int, start: int, count: int, full_size: int, what: str
) -> torch.Tensor:
    """The scales of weight rows (`dim=-2`) or columns (`dim=-1`) `[start, start + count)` of a full
    weight whose `dim` has `full_size` entries; `scale` is in the scheme's checkpoint layout."""
    if start < 0 or start + count > full_size:
        raise QuantizationError(f"{what}: a shard [{start}, {start + count}) outside {full_size} entries")
    if scheme.weights is WeightScales.TENSOR or (scheme.weights is WeightScales.CHANNEL and dim == -1):
        return scale
    if scheme.weights is WeightScales.CHANNEL:
        return scale.narrow(-2, start, count)
    block = check_block_cut(scheme, dim=dim, start=start, count=count, full_size=full_size, what=what)
    first = start // block
    return scale.narrow(dim, first, math.ceil((start + count) / block) - first)


def check_block_cut(scheme: Fp8Scheme, *, dim: int, start: int, count: int, full_size: int, what: str) -> int:
    """The block size along `dim`, after refusing a cut `[start, start + count)` that splits a block
    (the last block of a dim may be partial: a cut may end at `full_size`)."""
    block = scheme.block_n if dim == -2 else scheme.block_k
    end = start + count
    if start % block or (end % block and end != full_size):
        axis = "rows" if dim == -2 else "columns"
        raise QuantizationError(
            f"{what}: this tensor-parallel rank keeps {axis} [{start}, {end}) of {full_size}, which cuts a "
            f"{block}-wide block of the block-scaled FP8 weight; use a tp size whose shards are whole "
            f"blocks (each a multiple of {block} {axis}), or a checkpoint with per-channel scales"
        )
    return block
