"""The engine process's wire (`driver/wire.py`): every message survives pickling as itself, the
module docstring lists every one, every call crosses a real engine process on the CPU and comes back
as the type it declares, an engine error keeps its type and fields, and a call the engine process
does not know is refused with a sentence saying so."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import typing
from pathlib import Path
from typing import Any

import pytest

from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.driver import wire
from snugkv.driver.engine_process import EngineProcess, EngineProcessError, EngineSpec
from snugkv.engine import EngineArgs
from snugkv.models.loader import ModelSource
from snugkv.sizing.resize import KvResizeError
from tests.models.hf_tiny import save_tiny_hf_model

SOURCE = ModelSource(Path("/models/tiny"), "hf")

# One of each message; a new message without an example here fails the tests below.
MESSAGES: list[Any] = [
    wire.LeaveTextDownstream(),
    wire.Generate(GenerateInput("r", [1, 2, 3], SamplingParams(max_new_tokens=4))),
    wire.AbortRequest("r"),
    wire.AbortEveryRequest(),
    wire.Ask(3, wire.ResizeKvCache(free_gib=1.5)),
    wire.StopEngine(),
    wire.TokenizerSource(SOURCE),
    wire.Ready(SOURCE, max_context_tokens=2048, eos_token_ids=(2, 7), tokenizer_source=SOURCE),
    wire.StartFailed(KvResizeError("too small", status=409, param="max_total_num_tokens")),
    wire.TurnOutputs.of(
        [GenerateOutput("r", [4], "a"), GenerateOutput("s", [], "", True, "error", error="no")]
    ),
    wire.CallAnswered(3, True),
    wire.CallFailed(3, KvResizeError("too small", status=409, param="max_total_num_tokens")),
    wire.CallFailed(4, InvalidRequest("top_p must be in (0, 1], got 2", param="top_p")),
]


def call_classes() -> set[type[wire.Call[Any]]]:
    return {cls for cls in vars(wire).values() if isinstance(cls, type) and issubclass(cls, wire.Call)} - {
        wire.Call
    }


def declared_reply_type(call: wire.Call[Any]) -> type:
    """The `R` of `class ReadX(Call[R])`, without its parameters (`list[StepRecord]`: list)."""
    bases = type(call).__orig_bases__  # type: ignore[attr-defined]
    (base,) = (base for base in bases if typing.get_origin(base) is wire.Call)
    (reply,) = typing.get_args(base)
    return typing.get_origin(reply) or reply


def message_classes() -> set[type]:
    return {
        cls
        for cls in vars(wire).values()
        if dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls.__module__ == wire.__name__
    }


def same_error(a: BaseException, b: BaseException) -> bool:
    return type(a) is type(b) and a.args == b.args and vars(a) == vars(b)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_every_message_survives_pickling_as_itself(message: Any) -> None:
    again = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    error = getattr(message, "error", None)
    if isinstance(error, BaseException):  # exceptions do not compare equal: their type and fields do
        assert same_error(again.error, error)
    elif isinstance(message, wire.TurnOutputs):
        assert again.expanded() == message.expanded()
    else:
        assert again == message


def test_every_message_is_a_frozen_slotted_dataclass_named_in_the_module_docstring() -> None:
    classes = message_classes() | call_classes()
    assert {type(message) for message in MESSAGES} | call_classes() == classes, "give each message an example"
    for cls in classes:
        assert cls.__dataclass_params__.frozen and "__slots__" in vars(cls), cls  # type: ignore[attr-defined]
        assert cls.__name__ in (wire.__doc__ or ""), f"name {cls.__name__} in wire's docstring"


def test_an_error_that_cannot_be_pickled_crosses_as_an_engine_process_error_saying_what_it_was() -> None:
    class LocalError(Exception):  # a local class does not pickle
        pass

    crossed = wire.crossing(LocalError("the pool is gone"))
    assert isinstance(crossed, EngineProcessError)
    assert str(crossed) == "LocalError: the pool is gone"
    kept = KvResizeError("too small", status=409, param="free_gib")
    assert wire.crossing(kept) is kept


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-wire")
    save_tiny_hf_model("llama", directory)
    args = EngineArgs.of(model=str(directory), dtype="float32", host_kv_gib=0.02, max_running_requests=4)
    process = EngineProcess(EngineSpec(args))
    yield process
    process.stop()


def test_every_call_crosses_the_engine_process_and_answers_its_declared_type(
    engine_process, tmp_path
) -> None:
    kv_tokens = engine_process.server_info().to_dict()["max_total_num_tokens"]
    calls: list[wire.Call[Any]] = [  # in this order: the engine sleeps, then wakes
        wire.ReadHealth(),
        wire.ReadSleeping(),
        wire.ReadServerInfo(),
        wire.ReadMetrics(),
        wire.ReadRecentSteps(),
        wire.ReadSleepState(),
        wire.ReadKvInfo(),
        wire.ResizeKvCache(max_total_num_tokens=kv_tokens),
        wire.SleepEngine(level=1),
        wire.WakeEngine(),
        wire.StartProfile(output_dir=str(tmp_path), num_steps=None),
        wire.StopProfile(),
    ]
    assert {type(call) for call in calls} == call_classes(), "give each call an example"

    async def ask_each() -> list[Any]:
        return [await engine_process.call(call) for call in calls]

    for call, reply in zip(calls, asyncio.run(ask_each())):
        assert isinstance(reply, declared_reply_type(call)), (call, reply)
    blocking = engine_process.call_blocking(wire.ReadSleeping())
    assert blocking is False


def test_an_engine_error_crosses_with_its_type_status_and_param(engine_process) -> None:
    with pytest.raises(KvResizeError) as refused:
        asyncio.run(engine_process.call(wire.ResizeKvCache(max_total_num_tokens=1)))
    assert refused.value.status == 400 and refused.value.param == "max_total_num_tokens"


def test_a_call_the_engine_process_does_not_know_is_refused_by_name(engine_process) -> None:
    with pytest.raises(EngineProcessError, match="the engine process has no call 'server_info'"):
        engine_process.call_blocking("server_info")  # type: ignore[arg-type]
    assert engine_process.check_health()  # it serves on
