"""Which FP8 GEMM a layer runs, chosen by measurement per shape and batch size.

For each (weight layout, activation scales, N, K, dtype, bias, batch bucket) the first forward that
meets it outside a graph capture (the engine's warm-up before each decode and piecewise graph
capture) runs every candidate on the layer's own input, checks each against the float32 torch
reference of what it computes (the first 64 rows: a layout bug shows in any row) and that a rerun
gives the same bits (split-K must be deterministic), times the ones that pass, and keeps the
fastest for every later call of that key, in this process. Batch buckets are powers of two, so a
captured graph's batch always finds its bucket measured.

Timing (`gemm_timing.interleaved_seconds`): the candidates of a key run round-robin, each run after an L2
flush, all enqueued behind a GPU spin so that the GPU never waits for a launch inside a timed run
(median of 10 per candidate), after a few ms of flushes that take the clocks out of idle. At b638307 each candidate was timed alone with a sync
after every run: the GPU idled between runs, and the torch profiler's kernel times of the chosen
GEMMs at batch 64 came to half of what the chooser had measured for them.

Candidates (kernels/fp8_gemm.py, kernels/fp8_small_gemm.py): up to 128 rows the swap-AB
tensor-core kernel (fp8 x fp8 after a quantization launch; weight-only up to 16 rows), split over
K where N leaves SMs idle; for one row the wide GEMV (weight-only, or W8A8 quantizing in the
kernel), and the older one-row kernels that were fastest at b638307; the fused Triton kernel with
its default tiles; prequantized tensor-core tiles from 16 rows; quantization plus
`torch._scaled_mm` (row-wise scales, or cuBLAS's 1x128 x 128x128 block scaling where this torch
has it). A candidate that raises (a tile this GPU cannot hold, a scaling this torch lacks) or
disagrees is dropped for that key and logged once.

Weight-only candidates (`activations="float"`) multiply the unquantized bf16 input by the fp8
weight: more accurate than W8A8 and what the CPU path computes, but not the same rounding as the
larger buckets' W8A8 GEMMs. Where one runs (buckets up to 16 rows) only the weight-only ones are
timed (`one_rounding`), so every bucket up to 16 rows rounds alike and every bucket above does too. `SNUGKV_FP8_WEIGHT_ONLY=0` leaves them out; `SNUGKV_FP8_GEMM=triton|scaled_mm`
restricts the candidates to one family (benchmarks, tests). `measurements()` returns every timing
taken and `summary()` the time the measuring took, for `snugkv bench` to print. A forward that
meets an unmeasured key during a capture (none should: warm-up runs first) gets the fused Triton
kernel with its default tiles, logged once. Nothing here synchronizes inside a capture.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from snugkv.kernels import compile_ahead
from snugkv.kernels.fp8_gemm import default_gemm_config, fp8_linear_reference
from snugkv.kernels.fp8_small_gemm import fp8_linear_weight_only_reference
from snugkv.layers import gemm_timing
from snugkv.layers.fp8_gemm_candidates import (
    DEFAULT_SM_COUNT,
    Candidate,
    Fp8Linear,
    Fp8Params,
    GemmShape,
    batch_bucket,
    candidates,
    fused,
    static_scale,
)

logger = logging.getLogger(__name__)
CHECK_ROWS = 64


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


@functools.cache
def sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


class GemmChooser:
    """The per-process table of choices and the timings that made them."""

    def __init__(self) -> None:
        self.choices: dict[GemmKey, Candidate] = {}
        self.timings: list[dict[str, Any]] = []
        self.seconds = 0.0  # spent measuring (compiles, checks, timed runs)
        self.timed_runs = 0
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
        if compile_ahead.active():  # no kernel runs in that pass: its default tiles compile, no choice yet
            return fused(default_gemm_config(x.shape[0]))
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if key not in self._warned:
                self._warned.add(key)
                logger.warning(
                    "FP8 GEMM %s met first inside a graph capture: fused Triton, default tiles", key
                )
            return fused(default_gemm_config(x.shape[0]))
        started = time.perf_counter()
        try:
            chosen = self._measure(key, quant, layer, x, bias)
        finally:
            self.seconds += time.perf_counter() - started
        self.choices[key] = chosen
        return chosen

    def _measure(
        self, key: GemmKey, quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
    ) -> Candidate:
        check = x[:CHECK_ROWS].contiguous()
        references: dict[str, tuple[torch.Tensor, float]] = {}

        def reference(activations: str) -> tuple[torch.Tensor, float]:
            if activations not in references:
                if activations == "float":
                    expected = fp8_linear_weight_only_reference(
                        check, layer.weight, layer.weight_scale, block_n=quant.block_n, bias=bias
                    ).float()
                else:
                    expected = fp8_linear_reference(
                        check,
                        layer.weight,
                        layer.weight_scale,
                        act=quant.act_mode,
                        block_n=quant.block_n,
                        static_scale=static_scale(quant, layer),
                        bias=bias,
                    ).float()
                references[activations] = (expected, 0.02 * float(expected.abs().max()) + 1e-3)
            return references[activations]

        row: dict[str, Any] = {
            "layout": key.layout,
            "act": key.act,
            "n": key.out_features,
            "k": key.in_features,
            "rows": int(x.shape[0]),
        }
        shape = GemmShape(
            int(x.shape[0]),
            key.out_features,
            key.in_features,
            quant.block_n is None,
            sm_count(key.device_index) if x.is_cuda else DEFAULT_SM_COUNT,
        )
        passed: list[Candidate] = []
        for candidate in candidates(shape):
            try:
                got = candidate.run(quant, layer, check, bias)
                again = candidate.run(quant, layer, check, bias)
                expected, tolerance = reference(candidate.activations)
                error = float((got.float() - expected).abs().max())
                if not error <= tolerance or not torch.equal(got, again):
                    logger.info(
                        "FP8 GEMM %s disagrees with the reference on %s (max error %.3g%s)",
                        candidate.label,
                        key,
                        error,
                        "" if torch.equal(got, again) else ", and a rerun gave other bits",
                    )
                    row[candidate.label] = "wrong"
                    continue
            except Exception as exc:  # a scaling this torch / cuBLAS lacks, a tile this GPU cannot hold
                logger.info(
                    "FP8 GEMM %s is unavailable for %s: %s", candidate.label, key, str(exc).splitlines()[0]
                )
                row[candidate.label] = "unavailable"
                continue
            passed.append(candidate)
        if not passed:
            raise RuntimeError(
                f"no FP8 GEMM runs {key} on this GPU (tried {', '.join(c.label for c in candidates(shape))})"
            )
        passed = one_rounding(passed)
        seconds = _timed(passed, lambda c: c.run(quant, layer, x, bias), row)
        self.timed_runs += len(seconds) * gemm_timing.TIMED_RUNS
        best = min(seconds, key=lambda label: seconds[label])
        for candidate in passed:
            if candidate.label in seconds:
                row[candidate.label] = round(seconds[candidate.label] * 1e6, 2)  # microseconds
        row["chosen"] = best
        self.timings.append(row)
        logger.debug("FP8 GEMM for %s: %s", key, row)
        return next(c for c in passed if c.label == best)


def one_rounding(passed: list[Candidate]) -> list[Candidate]:
    """Weight-only wherever a weight-only candidate runs (up to 16 rows), else W8A8: every bucket
    of a range then rounds alike. A bucket that chose W8A8 next to one that chose weight-only gave
    a tiny FP8 model's logits 0.46 apart between its piecewise graph (16 tokens) and the eager step
    (bucket 8) on the H200 at 69b276b: the same request would get other tokens by the batch it
    shares a step with."""
    weight_only = [candidate for candidate in passed if candidate.activations == "float"]
    return weight_only or passed


def _timed(
    passed: list[Candidate], call: Callable[[Candidate], object], row: dict[str, Any]
) -> dict[str, float]:
    """Median seconds per candidate label (`gemm_timing.labelled_seconds`: interleaved, else one
    at a time, a candidate that raises marked unavailable in `row`); raises if every one did."""
    runs = {c.label: functools.partial(call, c) for c in passed}
    seconds = gemm_timing.labelled_seconds(runs, row, "FP8 GEMM")
    if not seconds:
        raise RuntimeError(f"every FP8 GEMM candidate failed when timed: {row}")
    return seconds


CHOOSER = GemmChooser()


def run_fp8_gemm(
    quant: Fp8Linear, layer: Fp8Params, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The chosen FP8 GEMM of this layer for `x [M, K]`."""
    return CHOOSER.pick(quant, layer, x, bias).run(quant, layer, x, bias)


def measurements() -> list[dict[str, Any]]:
    """Every measured key: each candidate's microseconds (or why it was dropped) and the choice."""
    return list(CHOOSER.timings)


def summary() -> dict[str, Any]:
    """How much measuring the choices took in this process: keys, timed runs, seconds."""
    return {
        "keys": len(CHOOSER.timings),
        "timed_runs": CHOOSER.timed_runs,
        "seconds": round(CHOOSER.seconds, 2),
    }
