"""`snugkv bench elastic`: resizing the KV cache, sleeping and waking, on a GPU.

A Llama-3-8B-shaped engine (bf16, random weights, post-capture, decode graphs up to batch 256)
is measured four ways:
- resize: shrink and grow by 10, 50 and 100 GiB on an idle pool, and a shrink that must move live
  KV (pages held above the new bound, copied below it), against the issue's target of 50 ms plus
  the copy time at the copy bandwidth measured in the same run;
- sleep and wake at levels 1 and 2 with the graphs kept (none is captured again), and at level 1
  with the graphs released too (`cuda_graph` tag: captured again on wake), with the device memory
  left in use while asleep, and a check that greedy tokens after the wake equal those before;
- serving: generated tokens per second of a batch of 256 requests run steadily, and the same batch
  with the KV cache shrunk (moving live KV) and grown back every few steps; every request must
  finish, with the outputs of the steady run.
The arena's chunk size is the engine's own unless swept (`--chunk-mib auto 256 1024`): it trades
driver handles on a grow against how finely a shrink can give memory back (see snugkv.memory.arena).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any, ClassVar

import torch

from snugkv.bench.harness import copy_bandwidth_bytes_per_s, cuda_missing, emit
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.sampling import SamplingParams
from snugkv.memory.vmm import GIB

DELTAS_GIB = (10, 50, 100)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _start(model: str, chunk_mib: float | None) -> Any:
    from snugkv.engine import Engine, EngineArgs

    return Engine(
        EngineArgs.of(
            model=model,
            load_format="dummy",
            max_running_requests=256,
            cuda_graph_max_bs=256,
            kv_chunk_mib=chunk_mib,
        )
    )


class _CallClock:
    """Wall time and count of the VMM backend's and the arena's calls during a resize (bench-only
    wrappers on the instances, removed after), to show where a resize's milliseconds go."""

    VMM_CALLS = ("commit_pieces", "decommit", "decommit_many")
    EXTENSIONS: ClassVar[dict[str, int]] = {
        "commit_pieces": 1,
        "decommit_many": 0,
    }  # which argument lists extensions
    ARENA_CALLS = ("synchronize",)

    def __init__(self, engine: Any) -> None:
        self.targets = [(engine.pool.arena.vmm, self.VMM_CALLS), (engine.pool.arena, self.ARENA_CALLS)]
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.extensions: dict[str, int] = {}

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                key = name.lstrip("_")
                self.ms[key] = self.ms.get(key, 0.0) + (time.perf_counter() - started) * 1e3
                self.calls[key] = self.calls.get(key, 0) + 1
                if name in self.EXTENSIONS:
                    listed = len(args[self.EXTENSIONS[name]])
                    self.extensions[key] = self.extensions.get(key, 0) + listed

        return timed

    def __enter__(self) -> _CallClock:
        for target, names in self.targets:
            for name in names:
                setattr(target, name, self._wrap(name, getattr(target, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for target, names in self.targets:
            for name in names:
                delattr(target, name)  # the class's method again

    def text(self) -> str:
        def one(key: str) -> str:
            extensions = f" ({self.extensions[key]} extensions)" if key in self.extensions else ""
            return f"{key} {self.ms[key]:.1f} ms/{self.calls[key]}{extensions}"

        return " · ".join(one(key) for key in sorted(self.ms))


def _timed_resize(engine: Any, tokens: int) -> tuple[float, Any, str]:
    _sync()
    with _CallClock(engine) as clock:
        started = time.perf_counter()
        result = engine.resize_kv(tokens)
        _sync()
        took_ms = (time.perf_counter() - started) * 1e3
    return took_ms, result, clock.text()


def _hold_top_pages(engine: Any, hold_tokens: int) -> None:
    """Hand out every page, then give back all but the top `hold_tokens`: live KV that a shrink
    must move (no request owns it; `_release_all` gives it back)."""
    allocator = engine.runner.allocator
    slots = allocator.alloc(allocator.available_tokens // allocator.page_size * allocator.page_size)
    allocator.free(slots[: slots.numel() - hold_tokens])


def _release_all(engine: Any) -> None:
    allocator = engine.runner.allocator
    pages = allocator.allocated_pages()
    if pages.numel():
        allocator.free(pages * allocator.page_size)


def resize_rows(
    engine: Any,
    bandwidth: float,
    chunk_mib: float,
    move_gib: float,
    deltas_gib: tuple[float, ...] = DELTAS_GIB,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    full = engine.pool.committed_tokens
    per_gib = GIB / engine.pool.bytes_per_token
    page = engine.pool.page_size
    for delta_gib in deltas_gib:
        delta = int(delta_gib * per_gib) // page * page
        if delta + 2 * page > full:
            rows.append(
                {"case": f"shrink/grow {delta_gib:g} GiB", "chunk_mib": chunk_mib, "note": "pool too small"}
            )
            continue
        shrink_ms, shrunk, shrink_calls = _timed_resize(engine, full - delta)
        grow_ms, grown, grow_calls = _timed_resize(engine, full)
        rows.append(
            {
                "case": f"shrink/grow {delta_gib:g} GiB",
                "chunk_mib": chunk_mib,
                "resized_gib": (shrunk.from_committed_bytes - shrunk.to_committed_bytes) / GIB,
                "shrink_ms": shrink_ms,
                "grow_ms": grow_ms,
                "engine_shrink_ms": shrunk.took_ms,
                "engine_grow_ms": grown.took_ms,
                "target_ms": 50.0,
                "met": shrink_ms <= 50 and grow_ms <= 50,
                "shrink_calls": shrink_calls,
                "grow_calls": grow_calls,
            }
        )
        # the live KV must fit below the new bound (half of it, to leave the moves somewhere to go)
        hold = min(int(move_gib * per_gib), delta, (full - delta) // 2) // page * page
        _hold_top_pages(engine, hold)
        moved_ms, moved, moved_calls = _timed_resize(engine, full - delta)
        _release_all(engine)
        _timed_resize(engine, full)
        copy_ms = 2 * moved.copied_bytes / bandwidth * 1e3  # read and write
        rows.append(
            {
                "case": f"shrink {delta_gib:g} GiB moving {moved.copied_bytes / GIB:.1f} GiB live KV",
                "chunk_mib": chunk_mib,
                "resized_gib": (moved.from_committed_bytes - moved.to_committed_bytes) / GIB,
                "shrink_ms": moved_ms,
                "engine_shrink_ms": moved.took_ms,
                "copy_ms_at_bandwidth": copy_ms,
                "target_ms": 50.0 + copy_ms,
                "met": moved_ms <= 50.0 + copy_ms,
                "shrink_calls": moved_calls,
            }
        )
    return rows


def _greedy_tokens(engine: Any) -> list[list[int]]:
    from snugkv.driver.commands import Add
    from snugkv.driver.engine_core import EngineCore

    outputs: dict[str, list[int]] = {}
    core = EngineCore.around(engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids))
    core.submit(
        Add(str(index), [(index * 31 + j) % 5000 + 100 for j in range(64)], GREEDY) for index in range(4)
    )
    core.run()
    core.scheduler.cache.reset()
    return [outputs[str(index)] for index in range(4)]


def _device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def sleep_rows(engine: Any) -> list[dict[str, Any]]:
    rows = []
    before_tokens = _greedy_tokens(engine)
    for level, tags in ((1, ()), (2, ()), (1, ("weights", "kv_cache", "cuda_graph"))):
        recapture = "cuda_graph" in tags
        wake_target_s = 6.0 if recapture else 2.0
        gc.collect()
        torch.cuda.empty_cache()
        awake_used = _device_used_bytes()
        _sync()
        started = time.perf_counter()
        engine.sleep(level=level, tags=tags)
        _sync()
        sleep_s = time.perf_counter() - started
        asleep_used = _device_used_bytes()
        asleep_reserved = torch.cuda.memory_reserved()
        started = time.perf_counter()
        woke = engine.wake_up()
        _sync()
        wake_s = time.perf_counter() - started
        same = _greedy_tokens(engine) == before_tokens
        rows.append(
            {
                "case": f"sleep level {level}" + (", graphs released" if recapture else ""),
                "sleep_s": sleep_s,
                "wake_s": wake_s,
                "wake_target_s": wake_target_s,
                "met": wake_s <= wake_target_s,
                "recaptured": recapture,
                "awake_device_used_gib": awake_used / GIB,
                "asleep_device_used_gib": asleep_used / GIB,
                "baseline_gib": engine.report.ledger.baseline_bytes / GIB,
                "asleep_beyond_baseline_gib": (asleep_used - engine.report.ledger.baseline_bytes) / GIB,
                "asleep_torch_reserved_gib": asleep_reserved / GIB,
                "asleep_target_gib": 1.0,
                "woke_tokens": woke.to_tokens,
                "same_greedy_tokens": same,
            }
        )
    return rows


def _serve(engine: Any, requests: int, prompt: int, output: int, resize_every: int) -> dict[str, Any]:
    """Generated tokens per second of `requests` greedy requests (half stop at a quarter of
    `output`); with `resize_every`, the KV cache shrinks to just above what the running requests
    hold (evicting the cache, moving live KV) and grows back, each every `resize_every` steps."""
    from snugkv.driver.commands import Add
    from snugkv.driver.engine_core import EngineCore
    from snugkv.scheduler import elastic

    outputs: dict[str, list[int]] = {}
    core = EngineCore.around(engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids))
    scheduler = core.scheduler
    adds = []
    for index in range(requests):  # every other request stops early: holes below the live pages
        new_tokens = output if index % 2 else output // 4
        sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        adds.append(Add(str(index), [(index * 17 + j) % 30000 + 100 for j in range(prompt)], sampling))
    core.submit(adds)
    full, page = engine.pool.committed_tokens, engine.pool.page_size
    pauses: list[float] = []
    moved = 0

    def shrink_or_grow(steps: int) -> bool:
        """Every `resize_every` steps, once every request was admitted: the resize the run times."""
        nonlocal moved
        if resize_every and steps and steps % resize_every == 0 and not scheduler.waiting:
            shrunk = engine.pool.committed_tokens < full
            room = 4 * page * len(scheduler.running)
            target = full if shrunk else -(-(scheduler.held_tokens() + room) // page) * page
            began = time.perf_counter()
            result = elastic.resize_kv(
                scheduler, engine, max_total_num_tokens=min(full, max(target, 2 * page))
            )
            _sync()
            pauses.append((time.perf_counter() - began) * 1e3)
            moved += result.moved_pages
        return False  # every request was submitted before the run

    _sync()
    started = time.perf_counter()
    core.run(intake=shrink_or_grow)
    _sync()
    seconds = time.perf_counter() - started
    if engine.pool.committed_tokens != full:
        engine.resize_kv(full)
    scheduler.cache.reset()
    expected = [output if index % 2 else output // 4 for index in range(requests)]
    return {
        "finished": sum(len(outputs.get(str(i), ())) == n for i, n in enumerate(expected)),
        "tokens_per_s": scheduler.generated_tokens / seconds,
        "resizes": len(pauses),
        "moved_pages": moved,
        "pause_ms_mean": sum(pauses) / len(pauses) if pauses else 0.0,
        "pause_ms_max": max(pauses, default=0.0),
        "retractions": scheduler.num_retractions,
        "outputs": [outputs[str(index)] for index in range(requests)],
    }


def serving_rows(
    engine: Any, requests: int, prompt: int, output: int, resize_every: int
) -> list[dict[str, Any]]:
    steady = _serve(engine, requests, prompt, output, 0)
    resizing = _serve(engine, requests, prompt, output, resize_every)
    same = steady.pop("outputs") == resizing.pop("outputs")
    return [
        {"case": f"serving {requests} x ({prompt} in, {output} out), steady", **steady},
        {
            "case": f"serving, shrink and grow every {resize_every} steps",
            **resizing,
            "vs_steady": resizing["tokens_per_s"] / steady["tokens_per_s"],
            "same_outputs": same,
        },
    ]


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench elastic"):
        return 2
    bandwidth = copy_bandwidth_bytes_per_s()
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"model": args.model, "copy_bandwidth_gb_per_s": bandwidth / 1e9}
    for index, chunk_mib in enumerate(args.chunk_mib):
        engine = _start(args.model, chunk_mib)
        chosen_mib = engine.pool.arena.chunk_bytes / 2**20  # auto: the one the engine chose
        extra.setdefault("max_total_num_tokens", engine.report.max_total_num_tokens)
        extra.setdefault("kv_committed_gib", engine.pool.committed_bytes / GIB)
        extra.setdefault("startup_timings", engine.report.timings)
        rows += resize_rows(engine, bandwidth, chosen_mib, args.move_gib, tuple(args.deltas_gib))
        emit("elastic", rows, args.out, extra=extra)  # each part is kept as soon as it is measured
        if index == 0:  # sleep and serving do not depend on the chunk size
            rows += sleep_rows(engine)
            emit("elastic", rows, args.out, extra=extra)
            rows += serving_rows(engine, args.requests, args.prompt, args.output, args.resize_every)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    emit("elastic", rows, args.out, extra=extra)
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="llama-3-8b")
    parser.add_argument(
        "--chunk-mib",
        type=lambda text: None if text == "auto" else float(text),
        nargs="+",
        default=[None],
        help="arena chunk sizes to sweep, MiB or auto (default: auto, the engine's own choice)",
    )
    parser.add_argument("--deltas-gib", type=float, nargs="+", default=list(DELTAS_GIB), help="resize steps")
    parser.add_argument("--move-gib", type=float, default=4.0, help="live KV a loaded shrink moves")
    parser.add_argument("--requests", type=int, default=256, help="the batch a resize must not lose one of")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--resize-every", type=int, default=32, help="steps between resizes while serving")
