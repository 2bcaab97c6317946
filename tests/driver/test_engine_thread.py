"""The engine thread over a real (tiny) model: a failing step ends only its own requests, the
engine goes on, cancelling a stream aborts it, and every slot comes back."""

from __future__ import annotations

import asyncio
import time

import pytest

from snugkv.core.outputs import GenerateInput
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.engine_thread import EngineThread
from snugkv.engine import Engine, EngineArgs
from tests.models.hf_tiny import save_tiny_hf_model


@pytest.fixture()
def engine_thread(tmp_path, request):
    save_tiny_hf_model("llama", tmp_path)
    overlap = getattr(request, "param", True)
    engine = Engine(
        EngineArgs.of(
            model=str(tmp_path),
            dtype="float32",
            host_kv_gib=0.02,
            max_running_requests=4,
            disable_overlap_schedule=not overlap,
        )
    )
    engine_thread = EngineThread(EngineCore.around(engine), model_name="tiny")
    yield engine_thread
    engine_thread.stop()


async def collect(engine: EngineThread, rid: str, prompt: list[int], max_new_tokens: int) -> list:
    request = GenerateInput(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return [output async for output in engine.generate(request)]


def wait_idle(engine: EngineThread) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        accounting = engine.server_info().to_dict()["slot_accounting_when_idle"]
        if accounting["checked"] and not engine.scheduler.has_work:
            return accounting
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")


@pytest.mark.parametrize("engine_thread", [True, False], ids=["overlap", "sync"], indirect=True)
def test_a_failing_step_ends_its_requests_with_the_error_and_the_engine_goes_on(engine_thread):
    original_step = engine_thread.scheduler.step
    calls = {"count": 0}

    def step_that_fails_once() -> None:
        calls["count"] += 1
        if calls["count"] == 2:
            raise RuntimeError("injected step failure")
        original_step()

    engine_thread.scheduler.step = step_that_fails_once
    failed = asyncio.run(collect(engine_thread, "a", [5, 6, 7, 8], 16))
    assert failed[-1].finished and failed[-1].finish_reason == "error"
    assert "injected step failure" in failed[-1].error
    later = asyncio.run(collect(engine_thread, "b", [9, 10, 11], 6))
    assert later[-1].finish_reason == "length" and sum(len(o.token_ids) for o in later) == 6
    assert engine_thread.check_health() and engine_thread.step_errors == 1
    accounting = wait_idle(engine_thread)
    assert accounting["ok"], accounting


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_slots(engine_thread):
    async def take_two() -> None:
        stream = engine_thread.generate(
            GenerateInput("leaver", [5, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True))
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()

    asyncio.run(take_two())
    engine_thread.abort("leaver")  # the server aborts a disconnected client's request as well
    assert list(engine_thread.aborted_rids).count("leaver") == 1
    accounting = wait_idle(engine_thread)
    assert (
        accounting["ok"]
        and accounting["free_tokens"] + accounting["cached_tokens"] == accounting["capacity_tokens"]
    )


def test_a_request_the_engine_cannot_run_gets_an_error_output_not_an_exception(engine_thread):
    too_long = list(range(3, 300)) * 2  # longer than the tiny model's 256-token context
    outputs = asyncio.run(collect(engine_thread, "long", too_long, 4))
    assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    assert "context holds" in outputs[0].error and outputs[0].rejected  # the server makes it a 400
    assert outputs[0].error_param == "prompt"  # ... about the prompt


def test_a_request_id_in_use_is_refused_and_the_running_request_keeps_its_stream(engine_thread):
    async def both() -> tuple[list, list]:
        # long enough to be running still when the second arrives (30 tokens took < 50 ms on an idle CPU)
        first = asyncio.ensure_future(collect(engine_thread, "same", [5, 6, 7], 240))
        await asyncio.sleep(0.05)
        second = await collect(engine_thread, "same", [8, 9], 4)
        return await asyncio.wait_for(first, timeout=30), second

    first, second = asyncio.run(both())
    assert second == [second[-1]] and second[-1].rejected and "already in use" in second[-1].error
    assert first[-1].finish_reason == "length" and sum(len(o.token_ids) for o in first) == 240
    assert wait_idle(engine_thread)["ok"]


def test_a_dead_scheduler_loop_fails_open_and_new_requests_instead_of_leaving_them_waiting(engine_thread):
    def metrics_that_break(snapshot) -> None:  # a bug outside any step
        raise RuntimeError("injected loop failure")

    broken = staticmethod(metrics_that_break)
    engine_thread.metrics = type(
        "Metrics", (), {"update_from_stats": broken, "update_from_snapshot": broken}
    )()

    async def run_both() -> tuple[list, list]:
        open_one = await asyncio.wait_for(collect(engine_thread, "open", [5, 6, 7], 50), timeout=20)
        after = await asyncio.wait_for(collect(engine_thread, "after", [8, 9], 4), timeout=20)
        return open_one, after

    open_one, after = asyncio.run(run_both())
    assert open_one[-1].finish_reason == "error" and "injected loop failure" in open_one[-1].error
    assert after == [after[-1]] and after[-1].finish_reason == "error", after
    assert not engine_thread.check_health()


def test_server_info_counts_the_steps_and_the_device_time_they_took(engine_thread):
    before = engine_thread.server_info().to_dict()["step_times"]
    outputs = asyncio.run(collect(engine_thread, "counted", [5, 6, 7], 8))
    assert outputs[-1].finish_reason == "length"
    wait_idle(engine_thread)
    info = engine_thread.server_info().to_dict()
    after = info["step_times"]
    assert info["overlap_schedule"] is True
    assert after["steps"] >= before["steps"] + 8 and after["overlapped_steps"] > before["overlapped_steps"]
    assert after["device_busy_s"] > before["device_busy_s"]


def test_the_idle_slot_check_waits_for_the_engine_to_stay_idle(engine_thread):
    """A burst right after the last one must not wait for the check (~0.1 s on a large pool): it
    runs once the engine has been idle for ACCOUNTING_CHECK_IDLE_S, and again after new work."""
    from snugkv.driver.engine_thread import ACCOUNTING_CHECK_IDLE_S

    checks: list[float] = []
    original = engine_thread.scheduler.check_slot_accounting

    def counted() -> None:
        checks.append(time.monotonic())
        original()

    engine_thread.scheduler.check_slot_accounting = counted
    asyncio.run(collect(engine_thread, "first", [5, 6, 7], 4))
    finished = time.monotonic()
    time.sleep(ACCOUNTING_CHECK_IDLE_S / 3)
    assert checks == []  # idle, but not for long enough
    accounting = wait_idle(engine_thread)
    assert accounting["ok"] and len(checks) == 1
    assert checks[0] - finished >= ACCOUNTING_CHECK_IDLE_S * 0.9
    asyncio.run(collect(engine_thread, "second", [8, 9], 4))
    deadline = time.monotonic() + 10
    while len(checks) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(checks) == 2  # new work, a new idle period, a new check


def test_build_makes_the_core_on_the_thread_that_runs_its_steps(tmp_path):
    """cuBLAS handles and workspaces are per thread: the thread that steps must be the one whose
    start-up (capture, activation peak) made them, before the KV cache was sized."""
    import threading

    save_tiny_hf_model("llama", tmp_path)
    threads: dict[str, threading.Thread] = {}

    def build_core() -> EngineCore:
        threads["build"] = threading.current_thread()
        engine = Engine(EngineArgs.of(model=str(tmp_path), dtype="float32", host_kv_gib=0.02))
        return EngineCore.around(engine)

    engine_thread = EngineThread.build(build_core, model_name=lambda core: "tiny")
    try:
        step = engine_thread.scheduler.step

        def recorded_step() -> None:
            threads["step"] = threading.current_thread()
            step()

        engine_thread.scheduler.step = recorded_step  # type: ignore[method-assign]
        outputs = asyncio.run(collect(engine_thread, "r", [5, 6, 7], 3))
        assert outputs[-1].finished and outputs[-1].error is None
        assert threads["step"] is threads["build"] is not threading.main_thread()
        assert engine_thread.model_name == "tiny"
    finally:
        engine_thread.stop()


def test_a_build_that_fails_raises_in_the_caller():
    def build_core() -> EngineCore:
        raise ValueError("not a model directory")

    with pytest.raises(ValueError, match="not a model directory"):
        EngineThread.build(build_core, model_name="tiny")
