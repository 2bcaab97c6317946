"""The typed reports answer with the JSON the routes always answered with: the same keys (GET /kv,
/is_sleeping, /server_info, the elastic replies), sets as sorted lists, changes as their dicts."""

from __future__ import annotations

from snugkv.core.reports import (
    EngineInfo,
    KvCacheView,
    KvInfo,
    KvResize,
    KvResizeReply,
    LargestRequest,
    MemoryLedger,
    MetricsSnapshot,
    SchedulerStats,
    SleepReply,
    SleepState,
    SlotAccounting,
    StartupReport,
)

CHANGE = KvResize("resize", 1024, 512, 4096, 2048, 8, 1.23456, moved_pages=3)
STATS = SchedulerStats(0.25, 0.5, 2, 1, 0.75, 64, 0, 100)


def cache_view() -> KvCacheView:
    return KvCacheView(
        max_total_num_tokens=512, capacity_tokens=512, available_tokens=384, page_size=16,
        committed_bytes=2048, reserved_bytes=8192, reserved_tokens=2048, bytes_per_token=4.0,
        chunk_bytes=1024, granularity_bytes=512, min_tokens=32, max_tokens=2048, max_tokens_bytes=8192,
        max_total_tokens=None, max_device_memory_gib=None, cap_tokens=None, device_free_bytes=1 << 20,
        headroom_bytes=0, tokens_fitting_free_memory=2048, max_running_requests=8, resizable=True,
        sleeping_tags=frozenset({"weights", "kv_cache"}), events=(CHANGE,),
    )  # fmt: skip


def test_get_kv_answers_the_cache_and_the_requests_in_one_flat_object() -> None:
    info = KvInfo(cache_view(), 96, 160, 32, 16, 48, LargestRequest("r", 40), 2, 1).to_dict()
    assert set(info) == {
        "max_total_num_tokens", "capacity_tokens", "used_tokens", "available_tokens", "usage", "page_size",
        "committed_bytes", "reserved_bytes", "reserved_tokens", "bytes_per_token", "chunk_bytes",
        "granularity_bytes", "min_tokens", "max_tokens", "max_tokens_bytes", "max_total_tokens",
        "max_device_memory_gib", "cap_tokens", "device_free_bytes", "headroom_bytes",
        "guest_room_bytes", "tokens_fitting_free_memory", "max_running_requests", "resizable", "sleeping_tags", "events",
        "held_by_requests_tokens", "demand_tokens", "cached_tokens", "evictable_cached_tokens",
        "min_tokens_without_failing_a_request", "largest_request", "num_running_requests", "num_queued_requests",
    }  # fmt: skip
    assert info["used_tokens"] == 128 and info["usage"] == 0.25
    assert info["sleeping_tags"] == ["kv_cache", "weights"]
    assert info["events"] == [CHANGE.to_dict()] and info["events"][0]["took_ms"] == 1.235
    assert info["largest_request"] == {"rid": "r", "tokens": 40}


def test_the_elastic_replies_are_the_change_with_the_state_after_it() -> None:
    state = SleepState(frozenset({"kv_cache"}), None, False, 0, 4096)
    assert state.to_dict() == {
        "is_sleeping": True, "sleeping_tags": ["kv_cache"], "level": None, "weights_in_host_memory": False,
        "kv_committed_bytes": 0, "weights_committed_bytes": 4096,
    }  # fmt: skip
    assert SleepReply(CHANGE, state).to_dict() == {**CHANGE.to_dict(), **state.to_dict()}
    kv = KvInfo(cache_view(), 0, 0, 0, 0, 32, None, 0, 0)
    assert KvResizeReply(CHANGE, kv).to_dict() == {**CHANGE.to_dict(), "kv": kv.to_dict()}


def test_server_info_flattens_the_startup_report_and_names_the_engine_process() -> None:
    ledger = MemoryLedger("cpu", 100, 40, 0, 10, 0, 50, 200, 0, 0, weights_in_device_memory=False)
    info = EngineInfo(
        model="m", startup=StartupReport("post-capture", 512, 8, ledger, sizing_ms=1.0), page_size=16,
        kv_layout="nhd", kv_dtype="torch.float32", attention_backend="torch", tp_size=1, context_length=256,
        chunked_prefill_size=512, cuda_graph_max_bs=0, prefill_graph_max_tokens=0, overlap_schedule=True,
        device="cpu", kv_capacity_tokens=512, stats=STATS, step_times={"steps": 3}, step_errors=0, gc={},
        is_sleeping=False, kv_events=(CHANGE,), aborted_rids=("a",), slot_accounting_when_idle=SlotAccounting(),
    )  # fmt: skip
    data = info.to_dict()
    assert data["sizing_mode"] == "post-capture" and data["max_total_num_tokens"] == 512
    assert data["memory_ledger"]["unaccounted_bytes"] == ledger.unaccounted_bytes
    assert data["stats"] == STATS.to_dict() and data["kv_events"] == [CHANGE.to_dict()]
    assert data["slot_accounting_when_idle"] == {"checked": False} and "engine_process" not in data
    from dataclasses import replace

    assert replace(info, engine_process_pid=7).to_dict()["engine_process"] == {"pid": 7}


def test_the_metrics_snapshot_is_the_stats_and_the_kv_figures() -> None:
    snapshot = MetricsSnapshot(
        STATS, kv_max_total_num_tokens=512, kv_committed_bytes=2048, kv_resizes=3, sleep_level=0
    )
    assert snapshot.to_dict() == {
        **STATS.to_dict(), "kv_max_total_num_tokens": 512, "kv_committed_bytes": 2048, "kv_resizes": 3, "sleep_level": 0,
        "kv_pressure_shrinks": 0, "kv_pressure_grows": 0, "oom_retries": 0,
    }  # fmt: skip


def test_the_ledger_rows_above_the_total_add_up_to_it_with_the_weights_counted_once() -> None:
    gib = 1 << 30
    on_gpu = MemoryLedger(
        "cuda", 140 * gib, gib, 2 * gib, weights_bytes=16 * gib, graphs_and_buffers_bytes=gib,
        kv_committed_bytes=118 * gib, kv_reserved_va_bytes=140 * gib, activation_peak_bytes=gib,
        headroom_bytes=gib + gib // 4, graph_executables_bytes=gib // 8, workspace_bytes=gib,
    )  # fmt: skip
    on_cpu = MemoryLedger("cpu", 100, 40, 0, 10, 0, 50, 200, 0, 0, weights_in_device_memory=False)
    for ledger in (on_gpu, on_cpu):
        assert sum(value for _, value in ledger.total_rows()) == ledger.total_bytes
        assert [name for name, _ in ledger.rows()].count("= total") == 1
        assert sum("weights" in name for name, _ in ledger.rows()) == 1
    assert on_gpu.unaccounted_bytes == gib - gib // 8  # the workspace is a row of its own
    assert "weights (host RAM, not on the device)" not in dict(on_cpu.total_rows())


def test_a_shrinks_wait_for_the_step_in_flight_is_said_apart_from_the_move() -> None:
    waited = KvResize("pressure", 1024, 512, 4096, 2048, 8, 3.2, waited_ms=412.46)
    assert waited.log_line().endswith("took 3.2 ms after 412.5 ms for the step in flight")
    assert waited.to_dict()["took_ms"] == 3.2 and waited.to_dict()["waited_ms"] == 412.46
    assert CHANGE.log_line().endswith("took 1.2 ms")  # nothing waited for: nothing said
