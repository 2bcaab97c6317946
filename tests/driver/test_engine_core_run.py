"""`EngineCore.run`, the synchronous loop of a caller that holds the core alone (a command, a
benchmark), over a tiny CPU model: it steps submitted requests to the end and counts the steps,
`intake` brings requests in while the scheduler is idle and runs once before each step (never
after the last), `until` ends a window of steps with work left, and a failed step raises."""

from __future__ import annotations

import pytest

from snugkv.core.sampling import SamplingParams
from snugkv.driver.commands import Abort, Add
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_hf_model("llama", directory)
    engine = Engine(
        EngineArgs.of(model=str(directory), dtype="float32", host_kv_gib=0.02, max_running_requests=4)
    )
    yield engine, model
    engine.close()


@pytest.fixture()
def core(tiny):
    core = EngineCore.around(tiny[0])
    yield core
    core.scheduler.check_slot_accounting()
    core.scheduler.cache.reset()


def counting_steps(core: EngineCore) -> list[int]:
    """The scheduler's steps, counted as they run."""
    count = [0]
    real_step = core.scheduler.step

    def step() -> None:
        count[0] += 1
        real_step()

    core.scheduler.step = step  # type: ignore[method-assign]
    return count


def test_run_steps_the_submitted_requests_to_their_end_and_returns_the_steps_it_ran(tiny, core):
    _, model = tiny
    prompts = [[5, 6, 7, 8], [9, 10]]
    count = counting_steps(core)
    requests = core.submit(Add(f"r{i}", prompt, greedy(6)) for i, prompt in enumerate(prompts))
    steps = core.run()
    assert steps == count[0] > 0 and not core.has_work
    assert [r.finish_reason for r in requests] == ["length", "length"]
    assert [r.output_ids for r in requests] == [hf_greedy(model, prompt, 6) for prompt in prompts]


def test_intake_brings_requests_in_while_the_scheduler_is_idle_until_it_expects_none(core):
    requests = []
    asked: list[int] = []

    def intake(steps: int) -> bool:
        asked.append(steps)
        if not requests:
            requests.extend(core.submit([Add("early", [3, 4, 5], greedy(1))]))
        elif len(requests) == 1 and not core.has_work:  # "late" comes once "early" is done
            requests.extend(core.submit([Add("late", [3, 4, 5], greedy(1))]))
        return len(requests) < 2

    steps = core.run(intake=intake)
    assert [(r.rid, r.finish_reason) for r in requests] == [("early", "length"), ("late", "length")]
    assert asked[-1] < steps  # nothing was asked after the last step


def test_intake_runs_once_before_each_step_and_never_after_the_last(core):
    asked: list[int] = []
    core.submit([Add("a", [5, 6, 7], greedy(4))])
    steps = core.run(intake=lambda steps: asked.append(steps) or False)
    assert asked == list(range(steps))


def test_intake_may_abort_what_it_submitted(core):
    (request,) = core.submit([Add("a", [5, 6, 7], greedy(50))])

    def stop_at_three(steps: int) -> bool:
        if steps == 3:
            core.apply(Abort("a"))
        return False

    core.run(intake=stop_at_three)
    assert request.finish_reason == "abort" and len(request.output_ids) < 50


def test_until_ends_a_window_of_steps_with_work_left_and_a_later_run_finishes_it(core):
    count = counting_steps(core)
    (request,) = core.submit([Add("a", [5, 6, 7], greedy(12))])
    assert core.run(until=lambda steps: steps == 3) == 3 == count[0]
    assert core.has_work and request.finish_reason is None
    assert core.run(until=lambda steps: steps == 0) == 0 == count[0] - 3
    core.run()
    assert request.finish_reason == "length" and len(request.output_ids) == 12


def test_a_failed_step_raises_from_run(core):
    core.submit([Add("a", [5, 6, 7], greedy(4))])
    real_step = core.scheduler.step

    def broken() -> None:
        raise RuntimeError("injected")

    core.scheduler.step = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        core.run()
    core.scheduler.step = real_step  # type: ignore[method-assign]
    core.run()  # the request the failed step never touched still finishes


def test_the_engine_s_tokenizer_loads_with_a_short_switch_interval_then_gives_it_back(monkeypatch, tmp_path):
    """While the tokenizer loads beside the start, a torch call that lets the GIL go gets it back
    within half a millisecond, not Python's 5 ms; the interval is the caller's again afterwards."""
    import sys

    from snugkv.driver import engine_core

    seen: list[float] = []

    def load(source, eos_token_ids=(), **kwargs):
        seen.append(sys.getswitchinterval())
        return None, "no tokenizer here"

    monkeypatch.setattr(engine_core, "load_tokenizer_or_none", load)
    before = sys.getswitchinterval()
    save_tiny_hf_model("llama", tmp_path)
    early = engine_core._load_tokenizer_early(EngineArgs.of(model=str(tmp_path)), None, None)
    assert early is not None and early.result(timeout=30) == (None, "no tokenizer here")
    assert seen == [min(before, engine_core.START_SWITCH_INTERVAL_S)]
    assert sys.getswitchinterval() == before
