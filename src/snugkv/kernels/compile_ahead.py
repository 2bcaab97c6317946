"""Triton kernels compiled side by side before a warm-up asks for them one at a time.

A cold start compiles every Triton kernel the first time a warm-up forward launches it, one after
another: on the H100 at e86cb6c the 8B shape's start compiled 21 specializations that way, most of
its 17 s of graph capture and sizing (docs/bench/startup.md). `run(work, what)` runs `work` (the
same forwards the warm-up will run) once with every Triton launch on this thread turned into a
compile and no launch: each compile goes to a pool of threads through Triton's own asynchronous
compile mode (`triton.runtime._async_compile.AsyncCompileMode`, in Triton 3.6 and 3.9), and `run`
returns when all are compiled, so the warm-up that follows finds them in Triton's cache.

In that pass the tensors a Triton kernel would have written hold whatever was there: the torch ops
between them compute on it and nothing reads it back, and code that chooses between kernels by
timing or comparing outputs must not choose then (`active()`: the dense GEMM chooser compiles its
candidates and keeps no choice; the FP8 one takes its default tiles).

Off unless `SNUGKV_COMPILE_AHEAD=1` (read here and nowhere else) until it is measured on a GPU; any
error in the pass is logged and the warm-up compiles what is left as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

_SWITCH_ENV = "SNUGKV_COMPILE_AHEAD"
MAX_WORKERS = 16
_local = threading.local()


def enabled() -> bool:
    return os.environ.get(_SWITCH_ENV, "0") == "1"


def active() -> bool:
    """Whether this thread is in a compile-only pass (a Triton launch compiles and runs nothing)."""
    return bool(getattr(_local, "active", False))


def run(work: Callable[[], object], what: str, workers: int | None = None) -> int | None:
    """Run `work` as a compile-only pass (see the module's docstring); returns how many compiles it
    started, None when it did not run (switched off, or no Triton with asynchronous compiles)."""
    if not enabled():
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except ImportError:
        logger.debug("this Triton compiles no kernel asynchronously: %s is compiled by its warm-up", what)
        return None
    workers = workers or max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    started = time.perf_counter()
    launch = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return launch(self, *args, grid=grid, warmup=warmup or active(), **kwargs)

    submitted = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="snugkv-compile") as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)  # a failed compile fails again in the warm-up
        JITFunction.run = compile_only
        _local.active = True
        try:
            with mode:
                try:
                    work()
                except Exception as exc:
                    logger.warning(
                        "compiling %s ahead stopped (%s: %s); the warm-up compiles the rest one at a time",
                        what,
                        type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "",
                    )
                submitted = len(mode.raw_futures)
        finally:
            _local.active = False
            JITFunction.run = launch
    logger.info(
        "Compiled %d Triton kernels for %s ahead on %d threads in %.1f s",
        submitted,
        what,
        workers,
        time.perf_counter() - started,
    )
    return submitted
