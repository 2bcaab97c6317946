"""Elastic memory over two gloo ranks, driven the way the server drives them (rank 0 shares each
turn's commands, the other rank follows): a shrink that moves live KV, a grow, a free_gib resize
agreed as the MIN over ranks (rank 1 has less free), and a sleep and wake all happen alike on both
ranks, and the greedy tokens are transformers'."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from snugkv.core.sampling import SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.distributed.launch import launch
from snugkv.driver.commands import Add, ResizeKV, Sleep, Stop, WakeUp
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.follower import follow
from snugkv.memory.vmm import MIB
from snugkv.scheduler.scheduler import Scheduler
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model

PAGE = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [40, 41]]
NEW_TOKENS = 14


def snug(scheduler: Scheduler) -> int:
    return -(-(scheduler.held_tokens() + 2 * PAGE * len(scheduler.running)) // PAGE) * PAGE


def serve_elastic(tp: TensorParallel, model_dir: str) -> list:
    from snugkv.engine import Engine, EngineArgs

    # Rank 1 has less memory: start-up and free_gib must agree on the MIN over ranks.
    budget_gib = 0.012 if tp.rank == 0 else 0.010
    args = EngineArgs.of(
        model=model_dir, device="cpu", tp_size=2, host_kv_gib=budget_gib, page_size=PAGE, kv_chunk_mib=1
    )
    engine = Engine(args, tp=tp)
    free_after: list[int] = []
    apply = EngineCore.apply

    def apply_and_measure(core, command):
        result = apply(core, command)
        if isinstance(command, ResizeKV) and command.free_gib is not None:
            free_after.append(engine.memory.mem_get_info()[0])
        return result

    EngineCore.apply = apply_and_measure  # follow calls it too; put back below (rank 0 is pytest's process)
    try:
        return _serve(tp, engine, free_after)
    finally:
        EngineCore.apply = apply


def _serve(tp: TensorParallel, engine, free_after: list[int]) -> list:
    finished: dict[str, list[int]] = {}

    def on_output(request, output) -> None:
        if output.finished:
            finished[request.rid] = list(request.output_ids)

    core = EngineCore.around(engine, on_output=on_output if tp.is_first_rank else None)
    scheduler = core.scheduler
    if tp.is_first_rank:
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        filler = SamplingParams(max_new_tokens=1, ignore_eos=True)
        turns: dict[int, list] = {
            0: [Add(f"filler{i}", list(range(50, 90)), filler) for i in range(3)],
            2: [Add(str(i), prompt, sampling) for i, prompt in enumerate(PROMPTS)],
            7: [ResizeKV(max_total_num_tokens=-1)],  # placeholder: snug() at that turn
            9: [ResizeKV(max_total_num_tokens=4096)],
            11: [ResizeKV(free_gib=0.004)],
            13: [Sleep(level=1)],
            14: [WakeUp()],
        }
        results = []
        turn = 0
        while turn <= max(turns) or scheduler.has_work:
            commands = turns.get(turn, [])
            if commands and isinstance(commands[0], ResizeKV) and commands[0].max_total_num_tokens == -1:
                commands = [ResizeKV(max_total_num_tokens=snug(scheduler))]
            core.share(commands)
            for command in commands:
                results.append(core.apply(command))
            if scheduler.has_work:
                assert core.step() is None
            turn += 1
        core.share([Stop()])
    else:
        follow(core)
        results = []
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    state = {
        "finished": finished,
        "moved": [r.moved_pages for r in results if r is not None],
        "events": [(e.reason, e.to_tokens) for e in engine.kv_events],
        "capacity": engine.runner.allocator.capacity_tokens,
        "free": engine.runner.allocator.available_tokens,
        "free_after_free_gib": free_after,
    }
    engine.close()
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, state, group=tp.cpu_group)
    return everyone


@pytest.mark.slow  # a two-rank launch through every elastic command
def test_resize_sleep_and_wake_act_alike_on_every_rank(tmp_path):
    model = save_tiny_hf_model("llama", tmp_path)
    leader, follower = launch(serve_elastic, 2, (str(tmp_path),), device_type="cpu")
    assert leader["events"] == follower["events"]  # the same token counts on both ranks
    reasons = [reason for reason, _ in leader["events"]]
    assert reasons == ["resize", "resize", "resize", "sleep", "wake"]
    assert sum(leader["moved"]) > 0  # the shrink moved live KV
    # free_gib=0.004 left 4 MiB free on rank 1, the tighter one, and more on rank 0
    granules = 2 * 2 * 4096  # a page (OS) per buffer: 2 layers of K and V
    assert abs(follower["free_after_free_gib"][0] - 0.004 * 2**30) <= granules
    assert leader["free_after_free_gib"][0] > 0.004 * 2**30 + MIB
    assert (leader["capacity"], leader["free"]) == (follower["capacity"], follower["free"])
    for index, prompt in enumerate(PROMPTS):
        assert leader["finished"][str(index)] == hf_greedy(model, prompt, NEW_TOKENS), index
