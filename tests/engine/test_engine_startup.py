"""The start-up pipeline on CPU (host VMM backend): sizing line, ledger, modes, fallback."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import MIB
from snugkv.scheduler.scheduler import Scheduler
from snugkv.sizing import modes
from snugkv.sizing.modes import SizingMode, resolve_mode
from tests.models.hf_tiny import save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_hf_model("qwen3", directory)
    return str(directory)


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def start(tiny_dir: str, **overrides) -> Engine:
    args = dict(
        model=tiny_dir,
        dtype="float32",
        host_kv_gib=0.02,
        max_running_requests=4,
        chunked_prefill_size=64,
        page_size=4,
    )
    return Engine(EngineArgs.of(**{**args, **overrides}))


def greedy(engine: Engine) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    scheduler = Scheduler(
        engine.runner,
        max_running_requests=engine.report.max_running_requests,
        chunked_prefill_size=engine.args.scheduler.chunked_prefill_size,
        on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids),
    )
    for index in range(3):
        scheduler.add_request(
            str(index),
            [5 + index, 17, 33, 8, 90 + index] * (index + 2),
            SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True),
        )
    while scheduler.has_work:
        scheduler.step()
    scheduler.check_slot_accounting()
    return [outputs[str(index)] for index in range(3)]


def test_post_capture_start_logs_the_sizing_line_and_a_ledger_that_adds_up(tiny_dir, caplog):
    with caplog.at_level(logging.INFO):
        engine = start(tiny_dir)
    report = engine.report
    assert report.mode is SizingMode.POST_CAPTURE
    assert f"Post-capture KV sizing: max_total_num_tokens={report.max_total_num_tokens}" in caplog.text
    assert "Memory ledger" in caplog.text and "KV Cache VA upper bound." in caplog.text
    assert report.max_total_num_tokens > 0
    ledger = report.ledger
    assert ledger.kv_committed_bytes == engine.pool.committed_bytes
    assert ledger.unaccounted_bytes == 0  # host backend: KV is the only thing in its budget
    assert ledger.free_bytes < 2 * MIB  # the whole 20 MiB budget is backed, less rounding
    assert engine.runner.allocator.capacity_tokens == report.max_total_num_tokens
    assert report.to_dict()["sizing_mode"] == "post-capture"
    engine.close()


def test_every_sizing_mode_generates_the_same_tokens(tiny_dir):
    results = {}
    for mode, extra in (
        ("post-capture", {}),
        ("profiled", {}),
        ("static-fraction", {"mem_fraction_static": 0.5}),
    ):
        engine = start(tiny_dir, kv_sizing=mode, **extra)
        assert engine.report.mode == SizingMode(mode)
        results[mode] = greedy(engine)
        engine.close()
    assert results["post-capture"] == results["profiled"] == results["static-fraction"]


def test_user_cap_limits_the_post_capture_pool(tiny_dir):
    engine = start(tiny_dir, max_total_tokens=100)
    assert engine.report.max_total_num_tokens == 100
    engine.close()


def test_start_up_makes_the_penalties_token_history_before_it_sizes_the_kv_cache(tiny_dir):
    """The history (`[table rows, vocab]`) is allocated by the largest step's sampling, so the
    memory it takes is gone before free memory is measured, not taken later from the KV's room."""
    engine = start(tiny_dir)
    history = engine.runner.token_history
    assert history is not None
    assert history.output_counts.shape[0] == engine.runner.req_to_token_pool.max_requests + 1
    engine.close()


def test_without_vmm_the_gpu_falls_back_to_profiled_with_one_clear_line(monkeypatch, caplog):
    monkeypatch.setattr(modes, "cuda_vmm_status", lambda device: (False, "the CUDA driver is too old"))
    with caplog.at_level(logging.WARNING):
        mode = resolve_mode(None, torch.device("cuda", 0))
    assert mode is SizingMode.PROFILED
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert lines == [
        "Post-capture KV sizing unavailable (the CUDA driver is too old); falling back to --kv-sizing profiled."
    ]
    assert resolve_mode("static-fraction", torch.device("cuda", 0)) is SizingMode.STATIC_FRACTION


def test_static_fraction_that_leaves_no_room_says_what_to_change(tiny_dir):
    from snugkv.sizing.post_capture import SizingError

    with pytest.raises(SizingError, match="mem-fraction-static"):
        start(tiny_dir, kv_sizing="static-fraction")  # the GPU-sized reserve exceeds a 20 MiB budget


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "deepseek_v2"])
@pytest.mark.parametrize("mode", ["post-capture", "profiled"])
def test_close_gives_back_every_committed_byte_for_every_pool_kind(tmp_path, arch, mode):
    """MHA, hybrid sliding-window (qwen2, gemma3: the SWA allocator holds a view of the pool's slot
    map) and MLA pools all return their memory on close."""
    save_tiny_hf_model(arch, tmp_path)
    engine = start(str(tmp_path), kv_sizing=mode)
    memory = engine.memory
    assert memory.committed_bytes > 0
    engine.close()
    assert memory.committed_bytes == 0
    engine.close()  # twice is harmless


def test_a_sliding_window_pool_rounded_down_to_nothing_is_refused_at_start_up(tmp_path):
    from snugkv.sizing.post_capture import SizingError

    save_tiny_hf_model("qwen2", tmp_path)  # the window sub-pool gets 80% of the full one, in pages
    with pytest.raises(SizingError, match=r"usable tokens.*swa-full-tokens-ratio"):
        start(str(tmp_path), page_size=256, max_total_tokens=512)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"page_size": 0}, "--page-size must be at least 1"),
        ({"max_total_tokens": 0}, "--max-total-tokens 0 is below two KV pages"),
        ({"max_total_tokens": -1}, "--max-total-tokens -1"),
        ({"max_total_tokens": 7, "page_size": 4}, "(8 tokens at --page-size 4)"),
        ({"host_kv_gib": 0}, "--host-kv-gib must be positive"),
        ({"max_running_requests": 0}, "--max-running-requests must be at least 1"),
        ({"guest_room_mib": -1}, "--guest-room-mib must be 0 or more, got -1"),
    ],
)
def test_engine_flags_out_of_range_are_refused_naming_the_flag(tiny_dir, overrides, words):
    from snugkv.engine import InvalidEngineArgs

    with pytest.raises(InvalidEngineArgs, match=re.escape(words)):
        start(tiny_dir, **overrides)


def test_a_kv_budget_below_one_page_says_to_raise_host_kv_gib(tiny_dir):
    from snugkv.sizing.post_capture import SizingError

    with pytest.raises(SizingError, match=r"(first page|less than two pages).*--host-kv-gib"):
        start(tiny_dir, host_kv_gib=0.00001)


def test_memory_command_prints_the_plan_the_ledger_and_json(tiny_dir, capsys, tmp_path):
    import json

    from snugkv.cli import main

    plot = tmp_path / "ledger.png"
    assert (
        main(["memory", "--model", tiny_dir, "--max-total-tokens", "256", "--json", "--plot", str(plot)]) == 0
    )
    report = json.loads(capsys.readouterr().out)  # with --json, stdout is the JSON alone
    assert report["max_total_num_tokens"] == 256 and len(report["ledger_per_rank"]) == 1
    assert main(["memory", "--model", tiny_dir, "--max-total-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "kv sizing: post-capture, max_total_num_tokens=256" in out and "Memory ledger" in out
    assert plot.stat().st_size > 0


def test_a_guest_room_that_leaves_no_kv_memory_says_to_lower_it(tiny_dir):
    from snugkv.sizing.post_capture import SizingError

    with pytest.raises(SizingError, match=r"guest room for other processes.*a smaller --guest-room-mib"):
        start(tiny_dir, host_kv_gib=0.01, guest_room_mib=64)  # no headroom on the host: all of it beyond
