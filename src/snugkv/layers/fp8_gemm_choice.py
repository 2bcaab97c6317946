"""Which FP8 GEMM a layer runs, chosen by measurement per shape and batch size.

For each (weight layout, activation scales, N, K, dtype, bias, batch bucket) the first forward that
meets it outside a graph capture (the engine's warm-up before each decode and piecewise graph
capture) runs every candidate on the layer's own input, checks each against the float32 torch
reference (the first 64 rows: a layout bug shows in any row), times the ones that agree (CUDA
events, median of 10), and keeps the fastest for every later call of that key, in this process.
Batch buckets are powers of two, so a captured graph's batch always finds its bucket measured.

Candidates (kernels/fp8_gemm.py): the fused Triton kernel with a few tile shapes; for one row, the
Triton GEMV (no tensor cores) with 16, 32 or 64 weight rows per program; quantization
plus the Triton kernel on a prequantized input (batches above 64); quantization plus
`torch._scaled_mm` (row-wise scales, or cuBLAS's 1x128 x 128x128 block scaling where this torch
has it). A candidate that raises or disagrees is dropped for that key and logged once.

`SNUGKV_FP8_GEMM=triton|scaled_mm` restricts the candidates to one family (benchmarks, tests).
`measurements()` returns every timing taken, for `snugkv bench` to print. A forward that meets an
unmeasured key during a capture (none should: warm-up runs first) gets the fused Triton kernel
with its default tiles, logged once. Nothing here synchronizes inside a capture.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from snugkv.kernels.fp8_gemm import (
    ROWS_KERNEL_MAX_ROWS,
    GemmConfig,
    default_gemm_config,
    fp8_linear_gemv_triton,
    fp8_linear_reference,
    fp8_linear_rows_triton,
    fp8_linear_scaled_mm,
    fp8_linear_triton,
)
from snugkv.kernels.fp8_quant import quantize_fp8_activation_triton
from snugkv.layers.quantization import ActivationScales, Fp8Scheme

logger = logging.getLogger(__name__)
CHECK_ROWS = 64
_TIMED_RUNS, _WARMUP_RUNS = 10, 3
_FAMILY_ENV = "SNUGKV_FP8_GEMM"


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
class GemmKey:
    layout: str  # "row" or "block<bn>"
    act: str
    out_features: int
    in_features: int
    dtype: torch.dtype
    has_bias: bool
    batch_bucket: int
    device_index: int


@dataclass(frozen=True, slots=True)
class Candidate:
    label: str
    family: str  # "triton" or "scaled_mm"
    run: Callable[[Fp8Linear, Fp8Params, torch.Tensor, torch.Tensor | None], torch.Tensor]


def batch_bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


def _static(quant: Fp8Linear, layer: Fp8Params) -> torch.Tensor | None:
    if quant.scheme.activations is not ActivationScales.STATIC_TENSOR:
        return None
    scale: torch.Tensor = getattr(layer, "input_scale")  # noqa: B009 (present only with static scales)
    return scale


def _fused(config: GemmConfig) -> Candidate:
    def run(quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear_triton(
            x,
            layer.weight,
            layer.weight_scale,
            act=quant.act_mode,
            block_n=quant.block_n,
            static_scale=_static(quant, layer),
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
            static_scale=_static(quant, layer),
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
            static_scale=_static(quant, layer),
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
            static_scale=_static(quant, layer),
            bias=bias,
            rows_per_program=rows_per_program,
            block_k=block_k,
            num_warps=num_warps,
        )

    return Candidate(f"triton-rows {rows_per_program}x{block_k}w{num_warps}", "triton", run)


def _scaled_mm(
    quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return fp8_linear_scaled_mm(
        x.contiguous(),
        layer.weight,
        layer.weight_scale,
        act=quant.act_mode,
        block_n=quant.block_n,
        static_scale=_static(quant, layer),
        bias=bias,
    )


def candidates(rows: int, row_scales: bool = True) -> list[Candidate]:
    """What is tried for a batch of `rows`: without tensor cores for 1..4 rows (wide K chunks for
    row-scaled weights), narrower tiles for small batches (more programs to spread the weight read
    over the SMs), the prequantized path from 16 rows on."""
    default = default_gemm_config(rows)
    found = [_fused(default)]
    if rows <= ROWS_KERNEL_MAX_ROWS and row_scales:
        found += [_rows(8, 1024, 4), _rows(4, 2048, 4), _rows(16, 512, 4), _rows(8, 2048, 8)]
    if rows == 1:
        found += [_gemv(16), _gemv(32)]
    if rows <= 64:
        found.append(_fused(GemmConfig(default.block_m, 32, num_warps=4, num_stages=4)))
        found.append(_fused(GemmConfig(default.block_m, 128, num_warps=4, num_stages=3)))
    if rows >= 16:
        found.append(_prequantized(default))
        found.append(_prequantized(GemmConfig(64, 128, num_warps=4, num_stages=4)))
    found.append(Candidate("scaled_mm", "scaled_mm", _scaled_mm))
    family = os.environ.get(_FAMILY_ENV, "").strip()
    return [c for c in found if c.family == family] if family else found


class GemmChooser:
    """The per-process table of choices and the timings that made them."""

    def __init__(self) -> None:
        self.choices: dict[GemmKey, Candidate] = {}
        self.timings: list[dict[str, Any]] = []
        self._warned: set[GemmKey] = set()

    def key(self, quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None) -> GemmKey:
        out_features, in_features = layer.weight.shape
        layout = "row" if quant.block_n is None else f"block{quant.block_n}"
        return GemmKey(
            layout,
            quant.act_mode,
            int(out_features),
            int(in_features),
            x.dtype,
            bias is not None,
            batch_bucket(x.shape[0]),
            x.device.index or 0,
        )

    def pick(
        self, quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
    ) -> Candidate:
        key = self.key(quant, layer, x, bias)
        chosen = self.choices.get(key)
        if chosen is not None:
            return chosen
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if key not in self._warned:
                self._warned.add(key)
                logger.warning(
                    "FP8 GEMM %s met first inside a graph capture: fused Triton, default tiles", key
                )
            return _fused(default_gemm_config(x.shape[0]))
        chosen = self._measure(key, quant, layer, x, bias)
        self.choices[key] = chosen
        return chosen

    def _measure(
        self, key: GemmKey, quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
    ) -> Candidate:
        check = x[:CHECK_ROWS].contiguous()
        expected = fp8_linear_reference(
            check,
            layer.weight,
            layer.weight_scale,
            act=quant.act_mode,
            block_n=quant.block_n,
            static_scale=_static(quant, layer),
            bias=bias,
        ).float()
        tolerance = 0.02 * float(expected.abs().max()) + 1e-3
        best: tuple[float, Candidate] | None = None
        row: dict[str, Any] = {
            "layout": key.layout,
            "act": key.act,
            "n": key.out_features,
            "k": key.in_features,
            "rows": int(x.shape[0]),
        }
        for candidate in candidates(x.shape[0], quant.block_n is None):
            try:
                got = candidate.run(quant, layer, check, bias).float()
                error = float((got - expected).abs().max())
                if not error <= tolerance:
                    logger.info(
                        "FP8 GEMM %s disagrees with the reference on %s (max error %.3g)",
                        candidate.label,
                        key,
                        error,
                    )
                    row[candidate.label] = "wrong"
                    continue
                seconds = _median_seconds(lambda c=candidate: c.run(quant, layer, x, bias))  # type: ignore[misc]
            except Exception as exc:  # a scaling this torch / cuBLAS lacks, a tile this GPU cannot hold
                logger.info(
                    "FP8 GEMM %s is unavailable for %s: %s", candidate.label, key, str(exc).splitlines()[0]
                )
                row[candidate.label] = "unavailable"
                continue
            row[candidate.label] = round(seconds * 1e6, 2)  # microseconds
            if best is None or seconds < best[0]:
                best = (seconds, candidate)
        if best is None:
            raise RuntimeError(
                f"no FP8 GEMM runs {key} on this GPU (tried {', '.join(c.label for c in candidates(x.shape[0]))})"
            )
        row["chosen"] = best[1].label
        self.timings.append(row)
        logger.debug("FP8 GEMM for %s: %s", key, row)
        return best[1]


_L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2: each timed run reads its weight from HBM


def _median_seconds(fn: Callable[[], object]) -> float:
    """Median of `_TIMED_RUNS`, each after the L2 cache was filled with other (clean) lines: in a
    model's step the weight comes from HBM (the other layers' weights evicted it), so a warm-L2 time
    would flatter the kernels of weights that fit in L2. The flush reads, never writes: dirty lines
    left by a write would be written back during the timed kernel (at 3a9e09d on the H200 that
    added ~10-20 us to every time)."""
    flush = torch.ones(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    for _ in range(_WARMUP_RUNS):
        fn()
    times = []
    for _ in range(_TIMED_RUNS):
        flush.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


CHOOSER = GemmChooser()


def run_fp8_gemm(
    quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The chosen FP8 GEMM of this layer for `x [M, K]`."""
    return CHOOSER.pick(quant, layer, x, bias).run(quant, layer, x, bias)


def measurements() -> list[dict[str, Any]]:
    """Every measured key: each candidate's microseconds (or why it was dropped) and the choice."""
    return list(CHOOSER.timings)
