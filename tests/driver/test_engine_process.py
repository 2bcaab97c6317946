"""The engine in a process of its own (`EngineProcess`) over a real tiny model: the same tokens as
the engine in this process, the info and elastic calls across the pipe, aborts that free their
slots, a start-up error raised as itself, and an engine process that dies ending every stream
with an error instead of leaving it hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from snugkv.core.outputs import GenerateInput, GenerateOutput, TokenLogprob
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.engine_process import EngineProcess, EngineProcessError, EngineSpec
from snugkv.driver.engine_thread import EngineThread
from snugkv.driver.wire import compact, expand
from snugkv.engine import Engine, EngineArgs
from snugkv.sizing.resize import KvResizeError
from tests.models.hf_tiny import save_tiny_hf_model

PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16, 17]}


@pytest.fixture(scope="module")
def tiny_args(tmp_path_factory) -> EngineArgs:
    directory = tmp_path_factory.mktemp("tiny-engine-process")
    save_tiny_hf_model("llama", directory)
    return EngineArgs.of(model=str(directory), dtype="float32", host_kv_gib=0.02, max_running_requests=4)


@pytest.fixture(scope="module")
def engine_process(tiny_args):
    process = EngineProcess(EngineSpec(tiny_args))
    yield process
    process.stop()


def request(rid: str, prompt: list[int], max_new_tokens: int) -> GenerateInput:
    return GenerateInput(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


async def run_all(engine, max_new_tokens: int = 12) -> dict[str, list]:
    async def one(rid: str, prompt: list[int]) -> list:
        return [output async for output in engine.generate(request(rid, prompt, max_new_tokens))]

    outputs = await asyncio.gather(*(one(rid, prompt) for rid, prompt in PROMPTS.items()))
    return dict(zip(PROMPTS, outputs))


def slow_steps(engine: Engine) -> None:
    """Every forward takes 20 ms more (run in the engine process: `EngineSpec.after_start`)."""
    forward = engine.runner.forward_batch

    def slow(batch):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return forward(batch)

    engine.runner.forward_batch = slow


def tokens(outputs: list) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


def wait_idle_and_checked(engine) -> dict:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        info = engine.server_info().to_dict()
        if info["stats"]["num_running_requests"] == 0 and info["slot_accounting_when_idle"]["checked"]:
            return info
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


@pytest.mark.parametrize(
    "output",
    [
        GenerateOutput("r", [1, 2], "ab", True, "stop", 3, 2, 1),
        GenerateOutput("r", [1], "a", logprobs=[TokenLogprob(1, "a", -0.5)]),
        GenerateOutput("r", [], "", prompt_logprobs=[None]),
        GenerateOutput("r", [], "", True, "error", error="no", rejected=True),
    ],
    ids=["plain", "logprobs", "prompt-logprobs", "error"],
)
def test_an_output_crosses_the_pipe_unchanged(output: GenerateOutput) -> None:
    assert expand(compact(output)) == output


def test_the_engine_process_gives_the_tokens_the_engine_gives_in_this_process(tiny_args, engine_process):
    in_process = EngineThread(EngineCore.around(Engine(tiny_args)), model_name="tiny")
    try:
        expected = asyncio.run(run_all(in_process))
    finally:
        in_process.stop()
    got = asyncio.run(run_all(engine_process))
    for rid in PROMPTS:
        assert tokens(got[rid]) == tokens(expected[rid]), rid
        assert len(tokens(got[rid])) == 12
        assert got[rid][-1].finished and got[rid][-1].finish_reason == "length"
        assert got[rid][-1].prompt_tokens == len(PROMPTS[rid])


def test_info_metrics_and_elastic_calls_cross_the_pipe(engine_process):
    info = engine_process.server_info().to_dict()
    assert info["engine_process"]["pid"] not in (None, os.getpid())
    assert info["max_total_num_tokens"] > 0 and info["device"] == "cpu"
    assert (
        engine_process.metrics_snapshot().to_dict()["kv_max_total_num_tokens"] == info["kv_capacity_tokens"]
    )
    assert engine_process.check_health() and not engine_process.is_sleeping()
    page = info["page_size"]
    target = (info["max_total_num_tokens"] // 2) // page * page

    async def resize() -> tuple[dict, dict]:
        result = await engine_process.resize_kv(max_total_num_tokens=target)
        return result.to_dict(), (await engine_process.kv_info()).to_dict()

    result, kv = asyncio.run(resize())
    assert result["kv"]["max_total_num_tokens"] == target == kv["max_total_num_tokens"]
    with pytest.raises(KvResizeError) as refused:  # raised here as the engine raised it
        asyncio.run(engine_process.resize_kv(max_total_num_tokens=1))
    assert refused.value.status == 400 and "max_total_num_tokens" in str(refused.value)
    asyncio.run(engine_process.resize_kv(max_total_num_tokens=info["max_total_num_tokens"]))
    asleep = asyncio.run(engine_process.sleep(level=1)).to_dict()
    assert (
        asleep["is_sleeping"]
        and engine_process.is_sleeping()
        and engine_process.sleep_state().to_dict()["is_sleeping"]
    )
    awake = asyncio.run(engine_process.wake_up()).to_dict()
    assert not awake["is_sleeping"] and not engine_process.is_sleeping()


def test_whether_the_engine_sleeps_is_known_without_a_call(engine_process, monkeypatch):
    # every request asks: after the first answer and each sleep or wake, no call crosses the pipe
    engine_process.is_sleeping()
    calls = []
    real_call = engine_process.call_blocking
    monkeypatch.setattr(
        engine_process, "call_blocking", lambda call, **kw: calls.append(call) or real_call(call, **kw)
    )
    assert not engine_process.is_sleeping()
    assert asyncio.run(engine_process.sleep(level=1)).state.is_sleeping and engine_process.is_sleeping()
    assert not asyncio.run(engine_process.wake_up()).state.is_sleeping and not engine_process.is_sleeping()
    assert calls == []


def test_leaving_a_stream_aborts_it_and_a_reused_id_is_refused_while_it_runs(engine_process):
    async def scenario() -> tuple[list, list]:
        stream = engine_process.generate(request("long", [5, 6, 7], 200))
        first = await anext(stream)
        twin = [output async for output in engine_process.generate(request("long", [8, 9], 4))]
        seen = [first]
        async for output in stream:
            seen.append(output)
            if len(seen) == 3:
                break
        await stream.aclose()
        return seen, twin

    seen, twin = asyncio.run(scenario())
    assert not seen[-1].finished
    assert twin[-1].rejected and "already in use" in twin[-1].error
    info = wait_idle_and_checked(engine_process)
    assert info["slot_accounting_when_idle"]["ok"], info["slot_accounting_when_idle"]
    assert "long" in info["aborted_rids"]


def test_a_start_up_error_is_raised_in_the_servers_process_as_itself(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    args = EngineArgs.of(model=str(tmp_path), dtype="float32", host_kv_gib=0.02)
    with pytest.raises(Exception) as in_process:
        Engine(args)
    with pytest.raises(type(in_process.value)) as across:
        EngineProcess(EngineSpec(args))
    assert str(across.value) == str(in_process.value)


def test_an_engine_process_spawned_from_flags_refuses_a_bad_flag_as_invalid_engine_args():
    """`snugkv serve` spawns its engine from the parsed flags before it checks them itself: the
    engine process checks them first thing and its refusal is raised here as itself."""
    from snugkv.cli import build_parser
    from snugkv.commands.engine_spawn import start_from_flags
    from snugkv.engine import InvalidEngineArgs

    flags = build_parser().parse_args(["serve", "--dtype", "foo"])
    started = start_from_flags(flags)
    with pytest.raises(InvalidEngineArgs, match="--dtype must be one of"):
        EngineProcess(started)
    assert not started.process.is_alive()


def test_an_engine_process_the_server_never_took_over_is_ended(tiny_args):
    from snugkv.cli import build_parser
    from snugkv.commands.engine_spawn import start_from_flags

    started = start_from_flags(build_parser().parse_args(["serve", "--model", tiny_args.load.model]))
    started.stop_unless_adopted()
    assert not started.process.is_alive()


def test_when_the_engine_process_dies_every_stream_ends_with_an_error(tiny_args):
    exits: list[str] = []
    process = EngineProcess(EngineSpec(tiny_args, after_start=slow_steps), on_exit=exits.append)
    try:

        async def killed_midway() -> list:
            outputs = []
            async for output in process.generate(request("doomed", [5, 6, 7], 200)):
                outputs.append(output)
                if len(outputs) == 1:
                    os.kill(process.pid, signal.SIGKILL)
            return outputs

        outputs = asyncio.run(killed_midway())
        assert outputs[-1].finished and outputs[-1].finish_reason == "error"
        assert "engine process exited" in outputs[-1].error
        assert not process.check_health()
        deadline = time.monotonic() + 10  # the reader thread ends the streams first, then calls on_exit
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
        assert exits and "code -9" in exits[0]
        later = asyncio.run(run_all(process))
        assert all(o[-1].finish_reason == "error" for o in later.values())
        with pytest.raises(EngineProcessError):
            process.server_info()
    finally:
        process.stop()


@pytest.mark.cuda
def test_on_a_gpu_the_engine_process_gives_the_tokens_of_the_engine_in_this_process(tiny_args):
    """With CUDA graphs and post-capture sizing in the engine process (requests one at a time, so
    both sides run the same batches)."""
    args = EngineArgs.of(
        model=tiny_args.load.model,
        dtype="float32",
        device="cuda",
        max_total_tokens=4096,
        max_running_requests=4,
    )

    async def one_by_one(engine) -> dict[str, list[int]]:
        got = {}
        for rid, prompt in PROMPTS.items():
            got[rid] = tokens([output async for output in engine.generate(request(rid, prompt, 24))])
        return got

    in_process = EngineThread(EngineCore.around(Engine(args)), model_name="tiny")
    try:
        expected = asyncio.run(one_by_one(in_process))
    finally:
        in_process.stop()
    process = EngineProcess(EngineSpec(args))
    try:
        assert process.server_info().to_dict()["device"].startswith("cuda")
        assert asyncio.run(one_by_one(process)) == expected
    finally:
        process.stop()
