"""Memory pressure over two gloo ranks, each on a simulated device of its own: memory taken on rank 1
only makes both shrink alike at the same turn (the MIN over ranks), its return makes both grow
back, and the greedy tokens are transformers'."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from snugkv.core.sampling import SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.distributed.launch import launch
from snugkv.driver import engine_core
from snugkv.driver.commands import Add, CheckMemory, Command, Stop
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.follower import follow
from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.vmm import MIB
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model

PAGE = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25]]
NEW_TOKENS = 24
TAKEN_BYTES = 4 * MIB  # on rank 1: its free memory 4 MiB below the headroom
GIVEN_BACK_AT_CHECK = 6


def serve_under_pressure(tp: TensorParallel, model_dir: str, rank1_dir: str) -> list:
    from snugkv.engine import Engine, EngineArgs

    if tp.rank == 1:  # a device of its own (rank 0, pytest's process, has the test's)
        os.environ["SNUGKV_RUNTIME_DIR"] = rank1_dir
    args = EngineArgs.of(
        model=model_dir, device="cpu", tp_size=2, host_kv_gib=0.25, page_size=PAGE, kv_chunk_mib=1
    )
    engine = Engine(args, tp=tp)
    startup_tokens = engine.pool.committed_tokens
    finished: dict[str, list[int]] = {}
    core = EngineCore.around(
        engine,
        on_output=lambda request, output: (
            finished.update({request.rid: list(request.output_ids)}) if output.finished else None
        ),
    )
    if tp.rank == 1:
        device = SharedHostDevice.from_env()
        assert device is not None
        device.take(TAKEN_BYTES)  # another process would; this one's pid serves as well
        checks = {"count": 0}
        apply = core.apply

        def apply_and_give_back(command: Command):
            if isinstance(command, CheckMemory):
                checks["count"] += 1
                if checks["count"] == GIVEN_BACK_AT_CHECK:
                    device.give_back(TAKEN_BYTES)
            return apply(command)

        core.apply = apply_and_give_back  # type: ignore[method-assign]
        follow(core)
    else:
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        turns: list[list[Command]] = [[Add(str(i), p, sampling) for i, p in enumerate(PROMPTS)]]
        count = 0
        while turns or core.has_work or count < 3 * GIVEN_BACK_AT_CHECK:
            commands = turns.pop(0) if turns else []
            for command in core.share(commands):
                core.apply(command)
            if core.has_work:
                assert core.step() is None
            count += 1
        core.share([Stop()])
    core.scheduler.check_slot_accounting()
    state = {
        "startup": startup_tokens,
        "events": [(event.reason, event.from_tokens, event.to_tokens) for event in engine.kv_events],
        "tokens": engine.pool.committed_tokens,
        "finished": finished,
    }
    engine.close()
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, state, group=tp.cpu_group)
    return everyone


def test_memory_taken_on_one_rank_shrinks_both_alike_and_its_return_grows_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNUGKV_RUNTIME_DIR", str(tmp_path / "rank0"))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", str(24 / 1024))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_HEADROOM_MIB", "16")
    monkeypatch.setattr(engine_core, "MEMORY_CHECK_S", 0.0)  # rank 0 decides: a check every turn
    model = save_tiny_hf_model("llama", tmp_path / "model")
    leader, follower = launch(
        serve_under_pressure, 2, (str(tmp_path / "model"), str(tmp_path / "rank1")), device_type="cpu"
    )
    reasons = [reason for reason, _, _ in leader["events"]]
    assert reasons == ["pressure", "pressure-grow"], leader["events"]
    assert leader["events"] == follower["events"]  # the same moves, at the same sizes
    _, from_tokens, to_tokens = leader["events"][0]
    assert from_tokens - to_tokens >= TAKEN_BYTES // 512  # rank 1's deficit, though rank 0 had none
    assert leader["tokens"] == follower["tokens"] == leader["startup"]
    for index, prompt in enumerate(PROMPTS):
        assert leader["finished"][str(index)] == hf_greedy(model, prompt, NEW_TOKENS)
