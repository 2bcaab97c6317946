"""Triton kernels compiled side by side, in processes of their own, before a warm-up asks for them.

A cold start compiles every Triton kernel the first time a warm-up forward launches it, one after
another: on the H100 at 85c78bd the 8B shape's start compiled 21 specializations that way, ~11 s of
its 23.5 s to healthy (docs/bench/startup.md). `hand_over(work, what)` runs `work` (the forwards the
warm-up will run) once with every Triton launch on this thread turned into a request to compile
and no launch: Triton's `jit_cache_hook` hands over each specialization it would compile
(serialized by Triton, as for its `preload`), and a pool of worker processes
(`compile_worker`, started by `kernels.compile_workers` as the engine process starts, their imports
done beside the engine's) compiles them into Triton's file cache side by side, first come first
served. `Handed.wait` returns when that pass's kernels are compiled, so the warm-up that follows
loads each from the cache; `run` is both. Processes, not threads: Triton's front end runs in
Python and holds the GIL (on 16 threads, 18 kernels took 5.9 s at 85c78bd).

In that pass the tensors a Triton kernel would have written hold whatever was there: the torch ops
between them compute on it and nothing reads it back, and code that chooses between kernels by
timing or comparing outputs must not choose then (`active()`: the dense GEMM chooser compiles its
candidates and keeps no choice; the FP8 one takes its default tiles).

On unless `SNUGKV_COMPILE_AHEAD=0` where a start will compile its kernels (`compile_workers.enabled`:
a GPU machine whose Triton cache is empty); a specialization a worker could not compile, or any
error in the pass, is compiled by the warm-up as before. On the H100 at 8d210d0 the 8B shape's
cold start took 12.2 s with it against 21.6 s without, in one call (docs/bench/startup.md: 18
kernels for the decode graphs compiled 3.5 s after their pass began, while the piecewise and
prefix-hit passes ran). At 3a4ac76, with the workers started late, it had gained nothing: Triton
3.6 also builds a C launcher per kernel signature at its first launch, which the workers build too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from snugkv.kernels import compile_workers

logger = logging.getLogger(__name__)

WAIT_S = 60.0  # for the workers after a pass; what is left then, the warm-up compiles
_local = threading.local()


def enabled() -> bool:
    return compile_workers.enabled()


def active() -> bool:
    """Whether this thread is in a compile-only pass (a Triton launch compiles and runs nothing)."""
    return bool(getattr(_local, "active", False))


@dataclass
class Handed:
    """The specializations one pass handed to the workers (`ids`: their jobs; a kernel an earlier
    pass handed keeps that pass's job), and when the pass began."""

    what: str
    ids: list[int]
    started: float

    def wait(self) -> None:
        """Until the workers answered every job of this pass (at most `WAIT_S`), then a log line."""
        workers = compile_workers.running()
        finished = workers is None or workers.wait(WAIT_S, self.ids)  # None: nothing was handed
        ids = set(self.ids)
        answers = [] if workers is None else [answer for answer in workers.answers if answer["id"] in ids]
        failed = [answer for answer in answers if not answer.get("ok")]
        slowest = sorted((a for a in answers if a.get("ok")), key=lambda a: -float(a.get("seconds", 0.0)))[:3]
        logger.info(
            "Compiled %d Triton kernels for %s ahead in %d processes in %.1f s%s%s",
            len(answers) - len(failed),
            self.what,
            0 if workers is None else len(workers.processes),
            time.perf_counter() - self.started,
            "" if finished else f" ({len(ids) - len(answers)} not done after {WAIT_S:.0f} s)",
            ""
            if not slowest
            else " (slowest: " + ", ".join(f"{a['kernel']} {a['seconds']:.1f} s" for a in slowest) + ")",
        )
        for answer in failed[:3]:
            logger.info(
                "  %s was not compiled ahead (%s); its warm-up compiles it",
                answer["kernel"],
                answer.get("error"),
            )


def hand_over(work: Callable[[], object], what: str, target: Any = None) -> Handed | None:
    """Run `work` as a compile-only pass (see the module's docstring) and hand what it would
    compile to the workers, without waiting for them (`Handed.wait`); None when it did not run
    (switched off, no GPU target, or a Triton without the hook this needs). The workers start with
    the first kernel if nothing started them before."""
    if not enabled():
        return None
    try:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError:
        logger.debug("this Triton has no compile hook: %s is compiled by its warm-up", what)
        return None
    try:
        target = driver.active.get_current_target() if target is None else target
    except Exception as exc:  # no GPU driver (a CPU machine)
        logger.debug("no GPU target (%s): %s is compiled by its warm-up", exc, what)
        return None
    handed = Handed(what, [], time.perf_counter())
    launch, previous_hook = JITFunction.run, knobs.runtime.jit_cache_hook

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return launch(self, *args, grid=grid, warmup=warmup or active(), **kwargs)

    def hand(*, fn: Any, compile: dict[str, Any], **kwargs: Any) -> bool | None:
        if not active():
            return previous_hook(fn=fn, compile=compile, **kwargs) if previous_hook else None
        workers = compile_workers.start()
        assert workers is not None
        module = fn.module if isinstance(fn.module, str) else fn.module.__name__
        job_id = workers.submit(
            {
                "module": module,
                "name": fn.name,
                "spec": compile["specialization_data"],
                "target": [target.backend, target.arch, target.warp_size],
            }
        )
        if job_id not in handed.ids:
            handed.ids.append(job_id)
        return True  # not compiled here: Triton's launch returns without a kernel

    JITFunction.run = compile_only
    knobs.runtime.jit_cache_hook = hand
    _local.active = True
    try:
        work()
    except Exception as exc:
        logger.warning(
            "compiling %s ahead stopped (%s: %s); the warm-up compiles the rest one at a time",
            what,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
    finally:
        _local.active = False
        JITFunction.run, knobs.runtime.jit_cache_hook = launch, previous_hook
    return handed


def run(work: Callable[[], object], what: str, target: Any = None, wait: bool = True) -> int | None:
    """`hand_over`, then (`wait`) `Handed.wait`; how many specializations the pass handed over,
    None when it did not run. `wait=False` returns once they are handed over, with a log line: a
    later pass's wait, or the warm-up, covers them."""
    handed = hand_over(work, what, target)
    if handed is None:
        return None
    if wait:
        handed.wait()
    else:
        logger.info("Handed %d Triton kernels for %s to the compile workers", len(handed.ids), what)
    return len(handed.ids)
