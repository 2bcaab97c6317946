"""Resizing the KV cache of a running engine on CPU (host backend): committed memory follows, live
requests survive a shrink by moving, every allocator stays sound, greedy tokens do not change."""

from __future__ import annotations

import logging

import pytest

from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import GIB
from snugkv.scheduler import elastic
from snugkv.scheduler.scheduler import Scheduler
from snugkv.sizing.resize import KvResizeError
from tests.models.hf_tiny import save_tiny_hf_model

PAGE = 4


@pytest.fixture(scope="module", params=["llama", "gemma3", "deepseek_v2"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_hf_model(request.param, directory)
    return str(directory)


def start(model_dir: str, **overrides) -> Engine:
    args = dict(
        model=model_dir,
        dtype="float32",
        host_kv_gib=0.05,
        max_total_tokens=1024,
        max_running_requests=8,
        chunked_prefill_size=64,
        page_size=PAGE,
        kv_chunk_mib=1 / 256,  # one 4 KiB page: the tiny buffers shrink page by page
    )
    return Engine(EngineArgs.of(**{**args, **overrides}))


def prompts(count: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(6 + 5 * i)] for i in range(count)]


def snug(scheduler: Scheduler) -> int:
    """Just above what the running requests hold, with two pages each to grow into: the finished
    requests' pages (cached, interleaved with the live ones) must go, the live ones above must move."""
    need = -(-(scheduler.held_tokens() + 2 * PAGE * len(scheduler.running)) // PAGE) * PAGE
    tokens = need
    while (
        min(scheduler.runner.kv_pool.tokens_per_group(tokens).values()) < need
    ):  # a window sub-pool is smaller
        tokens += PAGE
    return tokens


def run(engine: Engine, resizes: dict | None = None, count: int = 6, new_tokens: int = 24):
    """Greedy outputs of `count` requests; `resizes[step]` (tokens, or a function of the scheduler)
    resizes before that step, checking the slot accounting and every allocator after each resize.
    Returns (outputs, resize results)."""
    outputs: dict[str, list[int]] = {}
    scheduler = EngineCore.around(
        engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids)
    ).scheduler
    lengths = [new_tokens // 3, new_tokens, new_tokens // 2, new_tokens] * count
    for index, prompt in enumerate(prompts(count)):
        sampling = SamplingParams(max_new_tokens=lengths[index], temperature=0.0, ignore_eos=True)
        scheduler.add_request(str(index), prompt, sampling)
    results, step = [], 0
    while scheduler.has_work:
        if resizes and step in resizes:
            target = resizes[step](scheduler) if callable(resizes[step]) else resizes[step]
            results.append(elastic.resize_kv(scheduler, engine, max_total_num_tokens=target))
            scheduler.check_slot_accounting()
        scheduler.step()
        step += 1
    scheduler.check_slot_accounting()
    scheduler.cache.reset()  # the next run's scheduler starts from an empty cache
    return [outputs[str(index)] for index in range(count)], results


def test_grow_and_shrink_of_an_idle_engine_move_committed_memory_by_the_resized_bytes(model_dir, caplog):
    engine = start(model_dir)
    pool, memory = engine.pool, engine.memory
    assert engine.report.max_total_num_tokens == 1024
    for tokens in (256, 1000, 512, 1024):
        before = memory.committed_bytes
        expected = pool.bytes_for_tokens(tokens // PAGE * PAGE) - pool.committed_bytes
        with caplog.at_level(logging.INFO, logger="snugkv.engine"):
            result = engine.resize_kv(tokens)
        assert memory.committed_bytes - before == expected
        assert pool.committed_bytes == memory.committed_bytes == pool.bytes_for_tokens(tokens // PAGE * PAGE)
        assert engine.report.max_total_num_tokens == result.to_tokens == tokens // PAGE * PAGE
        assert engine.report.ledger.kv_committed_bytes == pool.committed_bytes
        assert f"-> {result.to_tokens}, committed" in caplog.text
        engine.runner.allocator.check_integrity()
    assert [event.to_tokens for event in engine.kv_events] == [256, 1000, 512, 1024]
    engine.close()


def test_shrink_and_grow_under_live_requests_give_the_tokens_of_an_unresized_run(model_dir):
    engine = start(model_dir)
    expected, _ = run(engine)
    outputs, results = run(engine, resizes={6: 1024, 10: snug, 13: 1024, 17: snug, 20: 288})
    assert outputs == expected
    shrinks = [r for r in results if r.to_tokens < r.from_tokens]
    assert sum(r.moved_pages + r.moved_window_pages for r in shrinks) > 0  # live KV really moved
    assert all(r.retracted_requests == 0 for r in results)
    engine.close()


def test_a_shrink_below_what_is_in_use_retracts_the_newest_and_every_request_still_finishes(model_dir):
    engine = start(model_dir)
    outputs, results = run(engine, resizes={8: 120})
    assert results[0].retracted_requests > 0 and results[0].to_tokens == 120
    assert [len(tokens) for tokens in outputs] == [8, 24, 12, 24, 8, 24]
    assert engine.report.max_running_requests == 8  # 120 tokens still hold 30 pages
    engine.close()


def test_bad_resizes_name_the_limit(model_dir):
    engine = start(model_dir)
    scheduler = EngineCore.around(engine).scheduler
    cases = {
        0: "below the smallest KV cache, 8 tokens",
        -5: "below the smallest",
        1_000_000: "above the 1028 tokens whose address space was reserved",
        1028: "above --max-total-tokens 1024",
    }
    for tokens, message in cases.items():
        with pytest.raises(KvResizeError, match=message):
            elastic.resize_kv(scheduler, engine, max_total_num_tokens=tokens)
    with pytest.raises(KvResizeError, match="must be an integer"):
        elastic.resize_kv(scheduler, engine, max_total_num_tokens=12.5)  # type: ignore[arg-type]
    with pytest.raises(KvResizeError, match="free_gib=-1 is negative"):
        elastic.resize_kv(scheduler, engine, free_gib=-1)
    # found by the fuzzer (snugkv bench fuzz): free_gib * GIB overflowed to inf, a 500 over HTTP
    with pytest.raises(KvResizeError, match="more memory than any device has"):
        elastic.resize_kv(scheduler, engine, free_gib=1.7976931348623157e308)
    scheduler.add_request("long", list(range(5, 105)), SamplingParams(max_new_tokens=4))
    with pytest.raises(
        KvResizeError, match=r"request long holds 100 and needs a page more: .* shrink to 104"
    ):
        elastic.resize_kv(scheduler, engine, max_total_num_tokens=64)
    assert engine.pool.committed_tokens == 1024  # nothing changed
    engine.close()


def test_free_gib_leaves_that_much_of_the_backend_free(model_dir):
    engine = start(model_dir, max_total_tokens=None, host_kv_gib=0.02)
    scheduler = EngineCore.around(engine).scheduler
    result = elastic.resize_kv(scheduler, engine, free_gib=0.01)
    free = engine.memory.mem_get_info()[0]
    buffers = len(engine.pool.arena.buffers)
    granule = engine.memory.granularity_bytes
    assert 0.01 * GIB - buffers * granule <= free <= 0.01 * GIB + engine.pool.bytes_for_tokens(PAGE)
    assert result.to_tokens < result.from_tokens
    engine.close()


def test_max_device_memory_caps_start_up_and_every_resize(model_dir):
    engine = start(model_dir, max_total_tokens=None, host_kv_gib=0.05, max_device_memory_gib=0.01)
    assert engine.pool.committed_bytes <= 0.01 * GIB
    cap_tokens = engine.kv.limits().cap_tokens
    assert cap_tokens == engine.report.max_total_num_tokens
    with pytest.raises(KvResizeError, match=r"--max-device-memory 0.01 GiB"):
        engine.resize_kv(cap_tokens + 64)
    engine.resize_kv(cap_tokens // 2 // PAGE * PAGE)
    engine.resize_kv(cap_tokens)
    assert engine.pool.committed_bytes <= 0.01 * GIB
    scheduler = EngineCore.around(engine).scheduler
    elastic.sleep(scheduler, engine)
    woke = elastic.wake_up(scheduler, engine)  # sized from free memory again, and the cap holds again
    assert woke.to_tokens == cap_tokens and engine.pool.committed_bytes <= 0.01 * GIB
    engine.close()


def test_a_cap_too_small_for_any_kv_says_what_to_raise_it_to(model_dir):
    from snugkv.sizing.post_capture import SizingError

    with pytest.raises(SizingError, match="raise it to at least"):
        start(model_dir, max_device_memory_gib=4096 / GIB)  # less than one OS page per buffer


def test_the_request_cap_follows_every_resize_and_a_cores_own_lower_limit_stays(model_dir):
    """One owner of max_running_requests (the KV sizing's recap); the scheduler reads it."""
    engine = start(model_dir)
    scheduler = EngineCore.around(engine).scheduler
    capped = EngineCore.around(engine, max_running_requests=2).scheduler
    elastic.resize_kv(scheduler, engine, max_total_num_tokens=5 * PAGE)  # 5 pages: at most 5 requests
    assert scheduler.max_running_requests == engine.report.max_running_requests == 5
    assert capped.max_running_requests == 2
    elastic.resize_kv(capped, engine, max_total_num_tokens=1024)  # through the capped core's scheduler
    assert scheduler.max_running_requests == engine.report.max_running_requests == 8
    assert capped.max_running_requests == 2  # a resize used to overwrite a core's own limit
    engine.close()
