"""Which GEMM a 16-bit linear layer runs for one to four rows: cuBLAS, or a Triton rows kernel
where that measured faster.

At a decode step of one token a dense projection is a matrix-vector product, and cuBLAS's kernels
for it read the small projections of a MoE model at about half the copy bandwidth
(docs/bench/moe.md: 1.17 ms of dense GEMMs against 0.58 ms of reads at batch 1). So for each
(N, K, dtype, bias, rows bucket 1/2/4, device) the first call outside a graph capture (the
engine's warm-up before each decode graph capture) runs cuBLAS (`F.linear`) and the candidates of
kernels/dense_gemv.py on the layer's own input, drops any that disagree with `F.linear`, times the
rest as the FP8 chooser does (layers/fp8_gemm_choice.py: median of 10, each after L2 was filled
with other lines), and keeps the fastest for every later call of that key, in this process.
cuBLAS is always a candidate, so a shape where no kernel of ours is faster keeps it.

Everything else (CPU, float32, more than four rows, a call during a capture before its key was
measured, SNUGKV_FUSED_KERNELS=0's op-by-op baseline) is `F.linear` (on a CPU, 16-bit rows through
layers/cpu_gemm.py), as is everything when
SNUGKV_DENSE_GEMV=0 (read here and nowhere else). The MoE router stays on `F.linear`: every
tensor-parallel rank must compute the same logits to route alike, and a choice by timing could
differ between ranks.
`measurements()` returns every timing taken, for `snugkv bench decode` to print.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from snugkv.kernels import compile_ahead
from snugkv.kernels.dense_gemv import MAX_ROWS, linear_rows_triton
from snugkv.kernels.device import runs_triton
from snugkv.layers import cpu_gemm, gemm_timing

logger = logging.getLogger(__name__)
_SWITCH_ENV = "SNUGKV_DENSE_GEMV"
_DTYPES = (torch.bfloat16, torch.float16)

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class GemmKey:
    out_features: int
    in_features: int
    dtype: torch.dtype
    has_bias: bool
    rows_bucket: int
    device_index: int


@dataclass(frozen=True, slots=True)
class Candidate:
    label: str
    run: Gemm


def _rows_kernel(block_n: int, block_k: int, num_warps: int) -> Candidate:
    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear_rows_triton(x, weight, bias, block_n=block_n, block_k=block_k, num_warps=num_warps)

    return Candidate(f"triton-rows {block_n}x{block_k}w{num_warps}", run)


CUBLAS = Candidate("cublas", lambda x, weight, bias: F.linear(x, weight, bias))
# 8 or 16 KB of bf16 weights a step in programs of 4 rows (the FP8 rows kernel's measurements on
# the H200, docs/bench/raw/decode_fp8-b638307.json: at one row, 4x2048 and 8x1024 of 8 KB ran ~1.5x
# faster than 16x512 of the same bytes, whose grid had a quarter of the programs). Two, because
# each is a compile per row bucket at start-up.
CANDIDATES = (CUBLAS, _rows_kernel(4, 1024, 4), _rows_kernel(4, 2048, 4))


def rows_bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


def enabled() -> bool:
    return os.environ.get(_SWITCH_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


class GemmChooser:
    """The per-process table of choices and the timings that made them."""

    def __init__(self) -> None:
        self.choices: dict[GemmKey, Candidate] = {}
        self.timings: list[dict[str, Any]] = []

    def pick(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Candidate:
        key = GemmKey(
            int(weight.shape[0]),
            int(weight.shape[1]),
            x.dtype,
            bias is not None,
            rows_bucket(x.shape[0]),
            x.device.index or 0,
        )
        chosen = self.choices.get(key)
        if chosen is not None:
            return chosen
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return CUBLAS  # measuring would synchronize; warm-up measures before every capture
        if compile_ahead.active():  # no kernel runs in that pass: compile the candidates, choose later
            for candidate in CANDIDATES:
                try:
                    candidate.run(x, weight, bias)
                except Exception:  # the warm-up's measuring says why
                    continue
            return CUBLAS
        chosen = self._measure(key, x, weight, bias)
        self.choices[key] = chosen
        return chosen

    def _measure(
        self, key: GemmKey, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Candidate:
        expected = F.linear(x, weight, bias).float()
        tolerance = 0.01 * float(expected.abs().max()) + 1e-3
        row: dict[str, Any] = {"n": key.out_features, "k": key.in_features, "rows": int(x.shape[0])}
        passed: list[Candidate] = []
        for candidate in CANDIDATES:
            try:
                error = float((candidate.run(x, weight, bias).float() - expected).abs().max())
            except Exception as exc:  # a tile this GPU cannot hold, a Triton this kernel does not compile on
                logger.info(
                    "GEMM %s is unavailable for %s: %s", candidate.label, key, str(exc).splitlines()[0]
                )
                row[candidate.label] = "unavailable"
                continue
            if not error <= tolerance:
                logger.info(
                    "GEMM %s disagrees with F.linear on %s (max error %.3g)", candidate.label, key, error
                )
                row[candidate.label] = "wrong"
                continue
            passed.append(candidate)
        # one GPU spin (~10 ms) and clock warm-up (~6 ms) a key, not one a candidate as up to bd2368a
        # (the 8B shape's start times 3 candidates for each of its 15 keys), all at the same clocks
        runs = {c.label: functools.partial(c.run, x, weight, bias) for c in passed}
        seconds = gemm_timing.labelled_seconds(runs, row, "GEMM")
        best: tuple[float, Candidate] | None = None
        for candidate in passed:
            if candidate.label in seconds:
                row[candidate.label] = round(seconds[candidate.label] * 1e6, 2)  # microseconds
                if best is None or seconds[candidate.label] < best[0]:
                    best = (seconds[candidate.label], candidate)
        chosen = best[1] if best is not None else CUBLAS
        row["chosen"] = chosen.label
        self.timings.append(row)
        logger.debug("GEMM for %s: %s", key, row)
        return chosen


CHOOSER = GemmChooser()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the measured choice for 1-4 rows of 16-bit CUDA rows."""
    if (
        runs_triton(x)
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and enabled()
    ):
        return CHOOSER.pick(x, weight, bias).run(x, weight, bias)
    return cpu_gemm.linear(x, weight, bias)


def measurements() -> list[dict[str, Any]]:
    """Every measured key: each candidate's microseconds (or why it was dropped) and the choice."""
    return list(CHOOSER.timings)
