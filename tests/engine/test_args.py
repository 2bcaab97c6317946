"""`EngineArgs.of`: flat flags into frozen groups, each checked once, the device's defaults filled in."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from snugkv.engine.args import SETTINGS, EngineArgs, InvalidEngineArgs
from snugkv.engine.config import CacheConfig


def test_flat_flags_land_in_their_groups() -> None:
    args = EngineArgs.of(
        model="m", device="cpu", page_size=4, max_total_tokens=64, tp_size=1, speculative="ngram"
    )
    assert (args.load.model, args.parallel.device, args.cache.page_size) == ("m", "cpu", 4)
    assert args.memory.max_total_tokens == 64
    assert args.speculative is not None and args.speculative.num_tokens == 4


def test_left_out_flags_take_the_devices_defaults() -> None:
    cpu = EngineArgs.of(device="cpu")
    assert (cpu.cache.page_size, cpu.scheduler.max_running_requests, cpu.runner.attention_backend) == (
        1,
        16,
        "torch",
    )
    assert cpu.runner.decode_graph_max_bs == 0 and cpu.memory.guest_room_mib == 0
    gpu = EngineArgs.of(device="cuda", chunked_prefill_size=1024)
    assert (gpu.cache.page_size, gpu.runner.attention_backend, gpu.runner.prefill_graph_tokens) == (
        16,
        "triton",
        1024,
    )


def test_every_group_is_frozen_and_the_args_cross_a_pipe_as_they_are() -> None:
    args = EngineArgs.of(device="cpu", max_total_tokens=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.cache.page_size = 2  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(args)) == args


def test_a_group_built_directly_checks_its_fields_too() -> None:
    with pytest.raises(InvalidEngineArgs, match="--page-size must be at least 1, got 0"):
        CacheConfig(page_size=0)


def test_with_settings_changes_one_flag_and_checks_again() -> None:
    args = EngineArgs.of(device="cpu")
    assert args.with_settings(max_total_tokens=256).memory.max_total_tokens == 256
    with pytest.raises(InvalidEngineArgs, match="below two KV pages"):
        args.with_settings(page_size=64, max_total_tokens=100)


def test_an_unknown_flag_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="page_sise"):
        EngineArgs.of(page_sise=4)


def test_every_setting_is_a_field_of_its_group() -> None:
    for setting in SETTINGS.values():
        if setting.group != "speculative":
            assert setting.name in {
                f.name for f in dataclasses.fields(getattr(EngineArgs.of(device="cpu"), setting.group))
            }


def test_decode_graphs_hold_a_verify_step_of_every_request_that_may_speculate():
    # a verify step runs k + 1 decode rows a request: 8 requests with k = 4 need graphs of 40 rows
    from types import SimpleNamespace

    from snugkv.engine.blocks import EngineBlocks

    def sizes(**flags):
        args = EngineArgs.of(model="m", device="cuda", max_running_requests=8, **flags)
        return EngineBlocks.graph_batch_sizes(SimpleNamespace(args=args, max_running_requests=8))

    assert sizes() == [1, 2, 4, 8]
    assert max(sizes(speculative="ngram", num_speculative_tokens=4)) == 40
    assert max(sizes(speculative="ngram", num_speculative_tokens=4, cuda_graph_max_bs=32)) == 32
    assert max(sizes(speculative="suffix", num_speculative_tokens=4, speculative_max_batch_size=2)) == 10
    assert sizes(speculative="ngram", disable_cuda_graph=True) == []
