"""Two gloo ranks driven the way the server drives them (rank 0 shares each turn's commands, the
other rank follows): a step that fails on one rank only, after the step's collectives (where
rank-local failures happen: output handling, detokenizing), ends the in-flight requests on both,
both ranks are in step again afterwards, and every slot comes back on each."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from snugkv.core.sampling import SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.distributed.launch import launch
from snugkv.driver.commands import Add, Stop
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.follower import follow
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model

FAIL_AT_STEP = 3


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def fail_once_on(tp: TensorParallel, model_dir: str, failing_rank: int) -> list:
    from snugkv.engine import Engine, EngineArgs

    engine = Engine(
        EngineArgs.of(model=model_dir, device="cpu", tp_size=2, max_total_tokens=512, host_kv_gib=0.1), tp=tp
    )
    finished: dict[str, tuple[str, list[int]]] = {}

    def on_output(request, output) -> None:
        if output.finished:
            finished[request.rid] = (output.finish_reason, list(request.output_ids))

    core = EngineCore.around(engine, on_output=on_output if tp.is_first_rank else None)
    scheduler = core.scheduler
    steps = {"count": 0}
    real_step, real_stop_reason = scheduler.step, scheduler._stop_reason

    def step() -> None:
        steps["count"] += 1
        real_step()

    def stop_reason(request, limits):  # runs after the step's last collective (the token broadcast)
        if tp.rank == failing_rank and steps["count"] == FAIL_AT_STEP:
            raise RuntimeError(f"injected on rank {tp.rank}")
        return real_stop_reason(request, limits)

    scheduler.step, scheduler._stop_reason = step, stop_reason
    if tp.is_first_rank:
        turns = [[Add("a", [5, 6, 7, 8], greedy(8)), Add("b", [9, 10], greedy(8))]]
        errors = []
        while turns or scheduler.has_work:
            commands = turns.pop(0) if turns else []
            core.share(commands)
            for command in commands:
                core.apply(command)
            if scheduler.has_work:
                error = core.step()
                if error is not None:
                    errors.append(str(error))
                    turns.append([Add("c", [11, 12, 13], greedy(6))])  # after the failure
        core.share([Stop()])
    else:
        follow(core)
        errors = []
    scheduler.check_slot_accounting()
    state = {
        "finished": finished,
        "errors": errors,
        "steps": steps["count"],
        "free": engine.runner.allocator.available_tokens,
        "cached": scheduler.cache.cached_tokens,
    }
    engine.close()
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, state, group=tp.cpu_group)
    return everyone


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_step_that_fails_on_one_rank_ends_the_batch_on_both_and_they_go_on_in_step(tmp_path, failing_rank):
    model = save_tiny_hf_model("llama", tmp_path)
    leader, follower = launch(fail_once_on, 2, (str(tmp_path), failing_rank), device_type="cpu")
    assert leader["finished"]["a"][0] == "error" and leader["finished"]["b"][0] == "error"
    reason, tokens = leader["finished"]["c"]
    assert reason == "length" and tokens == hf_greedy(model, [11, 12, 13], 6)
    assert len(leader["errors"]) == 1
    assert ("another tensor-parallel rank" in leader["errors"][0]) == (failing_rank == 1)
    assert leader["steps"] == follower["steps"]  # in step again after the failure
    assert (leader["free"], leader["cached"]) == (follower["free"], follower["cached"])
