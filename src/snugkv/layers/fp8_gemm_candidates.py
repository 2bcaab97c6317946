"""The FP8 GEMMs a layer may run, as candidates for the measurement in layers/fp8_gemm_choice.py.

`candidates(shape)` lists what is tried for a batch of `shape.rows` rows of a `[N, K]` weight,
short on purpose: every Triton configuration compiles once per process, and every (shape, batch
bucket) times every candidate at warm-up. Each `Candidate` runs one way of computing the layer's
GEMM (kernels/fp8_gemm.py, kernels/fp8_small_gemm.py, `torch._scaled_mm`) and says what it
multiplies: `activations="fp8"` (W8A8, as the layer's scheme says) or `"float"` (weight-only: the
unquantized input times the fp8 weight), so the chooser checks it against the right reference.

- up to 128 rows: the swap-AB tensor-core kernel with fp8 activations (64-row weight tiles, and
  128-row ones from 64 rows), split over K where the weight tiles alone leave SMs idle; weight-only
  up to 16 rows;
- one row (row weight scales): the wide GEMV, weight-only and W8A8, and the two older one-row
  kernels that were fastest at b638307 (rows 4x2048, GEMV 32 rows); 2-4 rows: the rows kernel;
- the fused Triton kernel with its default tiles (always; also what an unmeasured key gets inside
  a capture), its 128-wide tiles at 16-64 rows, prequantized tensor-core tiles from 16 rows;
- quantization plus `torch._scaled_mm` (cuBLASLt / CUTLASS).
`SNUGKV_FP8_GEMM=triton|scaled_mm` keeps one family; `SNUGKV_FP8_WEIGHT_ONLY=0` drops weight-only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from snugkv.kernels.fp8_gemm import (
    ROWS_KERNEL_MAX_ROWS,
    GemmConfig,
    default_gemm_config,
    fp8_linear_gemv_triton,
    fp8_linear_rows_triton,
    fp8_linear_scaled_mm,
    fp8_linear_triton,
)
from snugkv.kernels.fp8_quant import quantize_fp8_activation_triton
from snugkv.kernels.fp8_small_gemm import choose_split_k, fp8_linear_gemv_wide, fp8_linear_swapab
from snugkv.layers.quantization import ActivationScales, Fp8Scheme

_FAMILY_ENV = "SNUGKV_FP8_GEMM"
_WEIGHT_ONLY_ENV = "SNUGKV_FP8_WEIGHT_ONLY"
SWAPAB_MAX_ROWS = 128  # above this the batch fills 128-row tensor-core tiles: the usual GEMMs
WEIGHT_ONLY_MAX_ROWS = 16  # weight-only tensor-core MMAs convert every weight once per 16 rows
DEFAULT_SM_COUNT = 132  # an H100 / H200; CPU runs (the interpreter) size splits for one


class Fp8Params(Protocol):
    """An FP8 layer's parameters (layers/fp8_linear.install_fp8); `input_scale` with static scales."""

    weight: torch.Tensor
    weight_scale: torch.Tensor


class Fp8Linear(Protocol):
    """What a GEMM needs of a layer's FP8 state (layers/fp8_linear.Fp8Linear, which imports this)."""

    @property
    def scheme(self) -> Fp8Scheme: ...
    @property
    def act_mode(self) -> str: ...
    @property
    def block_n(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Candidate:
    label: str
    family: str  # "triton" or "scaled_mm"
    run: Callable[[Fp8Linear, Fp8Params, torch.Tensor, torch.Tensor | None], torch.Tensor]
    activations: str = "fp8"  # "fp8" (W8A8, as the scheme says) or "float" (weight-only)


@dataclass(frozen=True, slots=True)
class GemmShape:
    """What the candidate list depends on."""

    rows: int
    out_features: int
    in_features: int
    row_scales: bool  # per-row weight scales (tensor / channel), not 128x128 blocks
    sm_count: int = DEFAULT_SM_COUNT


def batch_bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


def static_scale(quant: Fp8Linear, layer: Fp8Params) -> torch.Tensor | None:
    if quant.scheme.activations is not ActivationScales.STATIC_TENSOR:
        return None
    scale: torch.Tensor = getattr(layer, "input_scale")  # noqa: B009 (present only with static scales)
    return scale


def fused(config: GemmConfig) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_triton(
            x,
            layer.weight,
            layer.weight_scale,
            act=quant.act_mode,
            block_n=quant.block_n,
            static_scale=static_scale(quant, layer),
            bias=bias,
            config=config,
        )

    return Candidate(f"triton-fused {config.label}", "triton", run)


def _prequantized(config: GemmConfig) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        pre = quantize_fp8_activation_triton(
            x.contiguous(),
            quant.act_mode,
            group_size=quant.scheme.block_k,
            static_scale=static_scale(quant, layer),
        )
        return fp8_linear_triton(
            x,
            layer.weight,
            layer.weight_scale,
            act=quant.act_mode,
            block_n=quant.block_n,
            bias=bias,
            prequantized=pre,
            config=config,
        )

    return Candidate(f"triton-prequantized {config.label}", "triton", run)


def _gemv(rows_per_program: int) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_gemv_triton(
            x,
            layer.weight,
            layer.weight_scale,
            act=quant.act_mode,
            block_n=quant.block_n,
            static_scale=static_scale(quant, layer),
            bias=bias,
            rows_per_program=rows_per_program,
        )

    return Candidate(f"triton-gemv {rows_per_program} rows", "triton", run)


def _rows(rows_per_program: int, block_k: int, num_warps: int) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_rows_triton(
            x,
            layer.weight,
            layer.weight_scale,
            act=quant.act_mode,
            static_scale=static_scale(quant, layer),
            bias=bias,
            rows_per_program=rows_per_program,
            block_k=block_k,
            num_warps=num_warps,
        )

    return Candidate(f"triton-rows {rows_per_program}x{block_k}w{num_warps}", "triton", run)


def _swapab(
    activations: str, tile_n: int, tile_m: int, split_k: int, num_warps: int = 4, num_stages: int = 4
) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_swapab(
            x,
            layer.weight,
            layer.weight_scale,
            activations=activations,
            act=quant.act_mode,
            block_n=quant.block_n,
            static_scale=static_scale(quant, layer),
            bias=bias,
            tile_n=tile_n,
            tile_m=tile_m,
            split_k=split_k,
            num_warps=num_warps,
            num_stages=num_stages,
        )

    kind = "weight-only" if activations == "float" else "fp8"
    label = f"triton-swapab {kind} {tile_n}x{tile_m} split{split_k} w{num_warps}s{num_stages}"
    return Candidate(label, "triton", run, activations)


def _gemv_wide(activations: str, rows_per_program: int, split_k: int) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_gemv_wide(
            x,
            layer.weight,
            layer.weight_scale,
            activations=activations,
            act=quant.act_mode,
            static_scale=static_scale(quant, layer),
            bias=bias,
            rows_per_program=rows_per_program,
            split_k=split_k,
        )

    kind = "weight-only" if activations == "float" else "fp8"
    return Candidate(
        f"triton-gemv-wide {kind} {rows_per_program}x512 split{split_k}", "triton", run, activations
    )


def _scaled_mm(
    quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return fp8_linear_scaled_mm(
        x.contiguous(),
        layer.weight,
        layer.weight_scale,
        act=quant.act_mode,
        block_n=quant.block_n,
        static_scale=static_scale(quant, layer),
        bias=bias,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def candidates(shape: GemmShape) -> list[Candidate]:
    """What is tried for a batch of `shape.rows` (see the module docstring). Short on purpose:
    every Triton configuration compiles once per process, and every key times every candidate."""
    rows, n, k = shape.rows, shape.out_features, shape.in_features
    bucket = batch_bucket(rows)
    found = [fused(default_gemm_config(rows))]
    if bucket <= SWAPAB_MAX_ROWS:
        tile_m = max(16, bucket)
        for tile_n in (64, 128) if tile_m >= 64 else (64,):
            split = choose_split_k(_cdiv(n, tile_n), k, 128, shape.sm_count)
            found.append(_swapab("fp8", tile_n, tile_m, split))
        if bucket <= WEIGHT_ONLY_MAX_ROWS:
            found.append(_swapab("float", 64, tile_m, choose_split_k(_cdiv(n, 64), k, 128, shape.sm_count)))
    if rows == 1 and shape.row_scales:
        split = choose_split_k(_cdiv(n, 8), k, 512, shape.sm_count)
        found += [_gemv_wide("float", 8, split), _gemv_wide("fp8", 8, split)]
        found += [_rows(4, 2048, 4), _gemv(32)]  # the fastest one-row kernels at b638307
    elif rows <= ROWS_KERNEL_MAX_ROWS and shape.row_scales:
        found.append(_rows(8, 1024, 4))
    if 16 <= rows <= 64:
        found.append(fused(GemmConfig(default_gemm_config(rows).block_m, 128, num_warps=4, num_stages=3)))
    if rows >= 16:
        if rows > SWAPAB_MAX_ROWS:
            found.append(_prequantized(default_gemm_config(rows)))
        found.append(_prequantized(GemmConfig(64, 128, num_warps=4, num_stages=4)))
    found.append(Candidate("scaled_mm", "scaled_mm", _scaled_mm))
    family = os.environ.get(_FAMILY_ENV, "").strip()
    if family:
        found = [c for c in found if c.family == family]
    if os.environ.get(_WEIGHT_ONLY_ENV, "1").strip() == "0":
        found = [c for c in found if c.activations == "fp8"]
    return found
