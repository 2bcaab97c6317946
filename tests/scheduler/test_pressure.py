"""Memory pressure on CPU: another process takes memory of the simulated shared device below the
activation headroom while greedy requests run; the KV cache shrinks by the deficit (retracting
only what does not fit), grows back when the memory returns, and every request finishes with the
tokens of an undisturbed run. A step that runs out of memory is retried smaller and loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from snugkv.core.outputs import GenerateOutput
from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.driver import engine_core
from snugkv.driver.commands import CheckMemory
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import MIB, CommitError
from snugkv.scheduler import elastic
from snugkv.scheduler.oom_recovery import MAX_OOM_STREAK, OOM_RETRY_AFTER_S
from snugkv.sizing.resize import ResizeLimits
from tests.models.hf_tiny import save_tiny_hf_model

PAGE = 4
DEVICE_MIB = 24  # the simulated device: 16 MiB of headroom leaves the KV cache 8 MiB (16,384 tokens)
HEADROOM_MIB = 16

# Another process on the device: takes the bytes asked for on each line (-N: all that is free but N).
HOG = """
import sys
from snugkv.memory.host_device import SharedHostDevice
device = SharedHostDevice.from_env()
for line in sys.stdin:
    want = int(line)
    want = device.free_bytes() + want if want < 0 else want
    device.take(want)
    print(want, flush=True)
"""


class Hog:
    """A process that holds memory of the shared device until it ends (the device forgets it then)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def take(self, size_bytes: int) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{size_bytes}\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def end(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture()
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNUGKV_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", str(DEVICE_MIB / 1024))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_HEADROOM_MIB", str(HEADROOM_MIB))
    monkeypatch.setattr(engine_core, "MEMORY_CHECK_S", 0.0)  # a check every turn: tests count turns


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model("llama", directory)
    return str(directory)


@pytest.fixture()
def hog() -> Iterator[Hog]:
    other = Hog()
    yield other
    other.end()


def start(model_dir: str, **overrides: object) -> Engine:
    args: dict[str, object] = dict(
        model=model_dir,
        dtype="float32",
        host_kv_gib=0.25,  # the shared device, not the backend's own bound, is what runs short
        max_running_requests=8,
        chunked_prefill_size=64,
        page_size=PAGE,
        kv_chunk_mib=1 / 256,  # one 4 KiB page: the tiny buffers shrink page by page
    )
    return Engine(EngineArgs.of(**{**args, **overrides}))  # type: ignore[arg-type]


def prompts(count: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(20 + 9 * i)] for i in range(count)]


def run(
    core: EngineCore, before_turn: Callable[[int], None] | None = None, count: int = 6
) -> dict[str, list[int]]:
    """Greedy outputs of `count` requests, driven turn by turn as a driver does (`share`, `apply`
    each command, `step`); `before_turn(turn)` disturbs the device."""
    outputs: dict[str, list[int]] = {}
    core.deliver_outputs_to(
        lambda request, output: outputs.setdefault(output.rid, []).extend(output.token_ids)
    )
    errors: list[str] = []
    scheduler = core.scheduler
    for index, prompt in enumerate(prompts(count)):
        sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        scheduler.add_request(str(index), prompt, sampling)
    turn = 0
    while core.has_work or turn < 3:
        if before_turn is not None:
            before_turn(turn)
        for command in core.share([]):
            core.apply(command)
        if core.has_work:
            error = core.step()
            if error is not None:
                errors.append(str(error))
        turn += 1
        assert turn < 5000, "the requests never finished"
    assert not errors
    scheduler.check_slot_accounting()
    scheduler.cache.reset()  # the next run starts from an empty cache
    return outputs


def test_memory_taken_below_the_headroom_shrinks_the_cache_and_its_return_grows_it_back(
    device: None, model_dir: str, hog: Hog
) -> None:
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine)
        pool = engine.pool
        startup_tokens = pool.committed_tokens
        assert engine.kv.headroom_bytes == HEADROOM_MIB * MIB
        undisturbed = run(core)
        assert engine.kv_event_count == 0  # nothing taken: no move, and no grow by a few pages either

        seen: dict[str, int] = {}

        def disturb(turn: int) -> None:
            if turn == 4:  # a quarter of what is free: the headroom runs 4 MiB short
                seen["taken"] = hog.take(engine.memory.mem_get_info()[0] // 4)
            if turn == 6:
                seen["after_mild"] = pool.committed_bytes
            if turn == 8:  # everything: the cache goes to the least the live requests need
                hog.take(-1)
            if turn == 12:
                seen["squeezed"] = pool.committed_tokens
                hog.end()  # the other process ends: its memory comes back

        disturbed = run(core, disturb)
        assert disturbed == undisturbed
        reasons = [event.reason for event in engine.kv_events]
        assert reasons[:2] == ["pressure", "pressure"] and reasons[-1] == "pressure-grow"
        mild = engine.kv_events[0]
        deficit = seen["taken"] - (DEVICE_MIB - HEADROOM_MIB) * MIB + mild.from_committed_bytes
        assert mild.from_committed_bytes - mild.to_committed_bytes >= deficit  # the deficit, and a slack
        assert (
            mild.from_committed_bytes - mild.to_committed_bytes
            <= deficit + engine.kv.pressure_hysteresis_tokens() * 512
        )
        assert mild.free_bytes is not None and mild.free_bytes < HEADROOM_MIB * MIB
        assert seen["squeezed"] < 2048  # the cache held little more than the largest live request
        assert pool.committed_tokens == startup_tokens  # grown back to what start-up sizing gives now
        assert engine.memory.mem_get_info()[0] >= HEADROOM_MIB * MIB
        snapshot = core.metrics_snapshot()
        assert snapshot.kv_pressure_shrinks == reasons.count("pressure") >= 2
        assert snapshot.kv_pressure_grows == reasons.count("pressure-grow") >= 1
    finally:
        engine.close()


def test_a_pressure_grow_never_takes_back_the_room_an_explicit_resize_made(
    device: None, model_dir: str, hog: Hog
) -> None:
    """An operator shrinks the cache to make room for another process (the soak's memory hog on an
    H200 at 55c410f: the room was taken back by a pressure grow before the hog had allocated, and
    the hog ran out of memory). Pressure still shrinks below that size and grows back up to it."""
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine)
        pool = engine.pool
        startup_tokens = pool.committed_tokens
        half = startup_tokens // 2 // PAGE * PAGE
        elastic.resize_kv(core.scheduler, engine, max_total_num_tokens=half)
        assert pool.committed_tokens == half

        def disturb(turn: int) -> None:
            if turn == 6:
                hog.take(-1)  # everything free: the cache must shrink below the operator's size
            if turn == 10:
                hog.end()  # it comes back: the cache grows to the operator's size, not beyond

        run(core, disturb)
        reasons = [event.reason for event in engine.kv_events]
        assert reasons[0] == "resize" and "pressure" in reasons and reasons[-1] == "pressure-grow", reasons
        assert max(event.to_tokens for event in engine.kv_events[1:]) <= half
        assert pool.committed_tokens == half
        run(core)  # memory free, no pressure: the size stays where the operator put it
        assert pool.committed_tokens == half and engine.kv_events[-1].reason == "pressure-grow"
        elastic.resize_kv(core.scheduler, engine, max_total_num_tokens=startup_tokens)
        assert pool.committed_tokens == startup_tokens
    finally:
        engine.close()


def test_the_guest_room_is_left_free_and_another_process_starting_in_it_moves_nothing(
    device: None, model_dir: str, hog: Hog
) -> None:
    """The H200 pressure run at d04a0ce: the KV cache sized to all but the headroom left the
    driver no room for another process's CUDA context. With a guest room, sizing leaves it free; a
    process that takes part of it moves nothing (the headroom is untouched), one that takes all
    shrinks the cache, and its end grows it back to the size that keeps the room."""
    guest = 2 * MIB  # beyond the headroom (on the host backend all of the headroom is free memory)
    engine = start(model_dir, guest_room_mib=HEADROOM_MIB + 2)
    try:
        core = EngineCore.around(engine)
        pool = engine.pool
        startup_tokens = pool.committed_tokens
        assert engine.kv.guest_extra_bytes == guest
        assert engine.report.ledger.guest_room_bytes == (HEADROOM_MIB + 2) * MIB
        free = engine.memory.mem_get_info()[0]
        assert HEADROOM_MIB * MIB + guest <= free < HEADROOM_MIB * MIB + guest + PAGE * pool.bytes_per_token
        undisturbed = run(core)
        seen: dict[str, int] = {}

        def disturb(turn: int) -> None:
            if turn == 4:  # a newcomer's context and first allocation, inside the room
                hog.take(guest * 3 // 4)
            if turn == 8:
                seen["moves_in_room"] = engine.kv_event_count
            if turn == 10:
                hog.take(-1)  # then everything: now the headroom is touched
            if turn == 14:
                hog.end()

        assert run(core, disturb) == undisturbed
        assert seen["moves_in_room"] == 0
        reasons = [event.reason for event in engine.kv_events]
        assert reasons[0] == "pressure" and reasons[-1] == "pressure-grow", reasons
        assert pool.committed_tokens == startup_tokens
        assert engine.memory.mem_get_info()[0] >= HEADROOM_MIB * MIB + guest
    finally:
        engine.close()
    plain = start(model_dir)  # no room asked: sizing takes it too (the CPU default)
    try:
        assert plain.kv.guest_room_bytes == plain.kv.guest_extra_bytes == 0
        assert plain.pool.committed_bytes >= pool.committed_bytes + guest - PAGE * pool.bytes_per_token
    finally:
        plain.close()


def test_a_pressure_move_settles_checks_and_makes_room_once(
    device: None, model_dir: str, hog: Hog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: a move used to go scheduler -> engine -> scheduler -> engine, checking whether the
    cache may move three times, its limits and the smallest size twice (the latter before the step
    in flight was read). One function of the driver's turn now asks each layer once."""
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine)
        scheduler = core.scheduler
        sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        for index, prompt in enumerate(prompts(3)):
            scheduler.add_request(str(index), prompt, sampling)
        for _ in range(4):  # the prompts prefilled, a decode step in flight
            assert core.step() is None
        calls: Counter[str] = Counter()

        def counted(owner: object, name: str) -> None:
            call = getattr(owner, name)

            def counting(*args: object, **kwargs: object) -> object:
                calls[name] += 1
                return call(*args, **kwargs)

            monkeypatch.setattr(owner, name, counting)

        counted(engine, "_resize_refusal")  # watches_pressure and check_resizable
        counted(ResizeLimits, "check")
        counted(scheduler, "finish_in_flight")
        counted(elastic, "smallest_size")
        counted(elastic, "make_room")
        hog.take(-1)  # everything free: the cache shrinks to what the live requests need
        change = core.apply(CheckMemory())
        assert change is not None and change.reason == "pressure"
        assert engine.pool.committed_tokens == change.to_tokens < change.from_tokens
        assert calls == {
            "_resize_refusal": 1,
            "check": 1,
            "finish_in_flight": 1,
            "smallest_size": 1,
            "make_room": 1,
        }, calls
        hog.end()
        turn_until(core, lambda: not core.has_work)
        scheduler.check_slot_accounting()
    finally:
        engine.close()


def test_no_kv_pressure_keeps_the_size(device: None, model_dir: str, hog: Hog) -> None:
    engine = start(model_dir, no_kv_pressure=True)
    try:
        core = EngineCore.around(engine)
        tokens = engine.pool.committed_tokens
        run(core, lambda turn: hog.take(-1) if turn == 2 else None, count=2)
        assert engine.pool.committed_tokens == tokens and engine.kv_event_count == 0
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_out_of_memory_is_retried_smaller_and_loses_no_request(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine, overlap=overlap)
        undisturbed = run(core)
        forward = core.scheduler.runner.forward
        calls = {"count": 0}

        def forward_out_of_memory_once(*args: object, **kwargs: object) -> torch.Tensor:
            calls["count"] += 1
            if calls["count"] in (3, 9):  # a prefill with several requests, then a decode of them
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(core.scheduler.runner, "forward", forward_out_of_memory_once)
        assert run(core) == undisturbed
        assert core.scheduler.oom_retries == 2
        assert core.metrics_snapshot().oom_retries == 2
    finally:
        engine.close()


# How each library says it found no device memory (the texts torch and the libraries raise).
NO_MEMORY_ERRORS = {
    "torch": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cublas": lambda: RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    ),
    "driver": lambda: RuntimeError("Triton Error [CUDA]: CUDA_ERROR_OUT_OF_MEMORY"),
    "runtime": lambda: RuntimeError("cudaErrorMemoryAllocation"),
    "nccl": lambda: RuntimeError("NCCL error: unhandled cuda error, NCCL version 2.27.3: out of memory"),
    "arena": lambda: CommitError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"),
}


@pytest.mark.parametrize("library", sorted(NO_MEMORY_ERRORS))
def test_every_librarys_out_of_memory_is_retried_smaller(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine)
        undisturbed = run(core)
        forward = core.scheduler.runner.forward
        calls = {"count": 0}

        def forward_out_of_memory_once(*args: object, **kwargs: object) -> torch.Tensor:
            calls["count"] += 1
            if calls["count"] == 3:
                raise NO_MEMORY_ERRORS[library]()
            return forward(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(core.scheduler.runner, "forward", forward_out_of_memory_once)
        assert run(core) == undisturbed
        assert core.scheduler.oom_retries == 1
    finally:
        engine.close()


def test_a_batch_that_never_finds_memory_ends_in_a_503_and_the_engine_serves_on(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine)
        outputs: dict[str, GenerateOutput] = {}
        core.deliver_outputs_to(lambda request, output: outputs.__setitem__(output.rid, output))
        forward = core.scheduler.runner.forward
        failing = {"on": True}

        def forward_without_memory(*args: object, **kwargs: object) -> torch.Tensor:
            if failing["on"]:
                raise RuntimeError(
                    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
                )
            return forward(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(core.scheduler.runner, "forward", forward_without_memory)
        sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        core.scheduler.add_request("refused", prompts(1)[0], sampling)
        turn_until(core, lambda: "refused" in outputs and outputs["refused"].finished)
        refused = outputs["refused"]
        assert refused.error is not None and "try again later" in refused.error
        assert refused.retry_after_s == OOM_RETRY_AFTER_S
        assert core.scheduler.oom_retries == MAX_OOM_STREAK
        core.scheduler.check_slot_accounting()
        assert engine.runner.allocator.available_tokens == engine.runner.allocator.capacity_tokens
        failing["on"] = False  # memory came back: the next request is served
        core.scheduler.add_request("served", prompts(1)[0], sampling)
        turn_until(core, lambda: "served" in outputs and outputs["served"].finished)
        assert outputs["served"].error is None
    finally:
        engine.close()


def turn_until(core: EngineCore, done: Callable[[], bool], limit: int = 2000) -> None:
    for _ in range(limit):
        if done():
            return
        for command in core.share([]):
            core.apply(command)
        if core.has_work:
            assert core.step() is None
    raise AssertionError("never happened")


def test_a_prompt_the_shrunken_cache_cannot_hold_waits_for_memory_and_runs_once_it_is_back(
    device: None, model_dir: str, hog: Hog
) -> None:
    engine = start(model_dir)
    try:
        core = EngineCore.around(engine)
        long_prompt = [(5 * j) % 300 + 5 for j in range(120)]
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        finished: dict[str, str | None] = {}

        def on_output(request: object, output: GenerateOutput) -> None:
            outputs.setdefault(output.rid, []).extend(output.token_ids)
            if output.finished:
                finished[output.rid] = output.error

        core.deliver_outputs_to(on_output)
        core.scheduler.add_request("reference", long_prompt, greedy)
        turn_until(core, lambda: "reference" in finished)
        hog.take(-1)  # the device is full: the idle engine gives back all but two pages
        turn_until(core, lambda: engine.pool.committed_tokens == 2 * PAGE)
        core.scheduler.add_request("long", long_prompt, greedy)  # accepted: the reserve holds it
        two = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        core.scheduler.add_request("short", long_prompt[:1], two)  # fits now: it runs past the long one
        turn_until(core, lambda: "short" in finished)
        assert finished["short"] is None and len(outputs["short"]) == 2
        assert "long" not in finished and core.scheduler.waits_for_memory(core.scheduler.requests["long"])
        hog.end()  # memory comes back: the cache grows and the waiting prompt runs
        turn_until(core, lambda: "long" in finished)
        assert finished["long"] is None and outputs["long"] == outputs["reference"]
        assert [event.reason for event in engine.kv_events][-1] == "pressure-grow"
        core.scheduler.check_slot_accounting()
    finally:
        engine.close()


def test_a_wait_for_memory_runs_out_into_a_retry_later_and_a_never_fitting_prompt_is_refused(
    device: None, model_dir: str, hog: Hog
) -> None:
    engine = start(model_dir, queue_timeout_s=0.2, max_total_tokens=128)
    try:
        core = EngineCore.around(engine)
        ended: dict[str, GenerateOutput] = {}
        core.deliver_outputs_to(lambda request, output: ended.setdefault(output.rid, output))
        hog.take(-1)
        turn_until(core, lambda: engine.pool.committed_tokens == 2 * PAGE)
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
        with pytest.raises(InvalidRequest, match="can hold at most 128"):  # over --max-total-tokens: never
            core.scheduler.add_request("never", list(range(5, 205)), greedy)
        core.scheduler.add_request("waits", list(range(5, 105)), greedy)
        turn_until(core, lambda: "waits" in ended)
        output = ended["waits"]
        assert output.finished and output.error is not None and "try again later" in output.error
        assert output.retry_after_s == engine_core.RETRY_AFTER_S
        assert not core.scheduler.requests and not core.has_work
        core.scheduler.check_slot_accounting()
    finally:
        engine.close()
