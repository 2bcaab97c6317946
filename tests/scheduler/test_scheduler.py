"""Continuous batching on a real (tiny, random) model: same tokens as the reference, under
pressure too; every slot comes back."""

from __future__ import annotations

import dataclasses
import random

import pytest

from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.engine import Engine, EngineArgs
from snugkv.scheduler.scheduler import Scheduler
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_hf_model("llama", directory)
    return directory, model


def make_scheduler(
    directory,
    *,
    max_total_tokens=2048,
    page_size=1,
    chunk=64,
    prefix_cache=True,
    layout="nhd",
    tokenizer=None,
    overlap=True,
):
    engine = Engine(
        EngineArgs.of(
            model=str(directory),
            dtype="float32",
            max_total_tokens=max_total_tokens,
            page_size=page_size,
            kv_layout=layout,
            chunked_prefill_size=chunk,
            max_running_requests=8,
            host_kv_gib=0.05,
        )
    )
    outputs: dict[str, list] = {}
    scheduler = Scheduler(
        engine.runner,
        tokenizer=tokenizer,
        max_running_requests=engine.report.max_running_requests,
        chunked_prefill_size=chunk,
        enable_prefix_cache=prefix_cache,
        on_output=lambda request, output: outputs.setdefault(output.rid, []).append(output),
        overlap=overlap,
    )
    return engine, scheduler, outputs


def prompts(count: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def run_all(
    scheduler: Scheduler, prompt_list: list[list[int]], max_new_tokens: int = NEW_TOKENS
) -> dict[str, list[int]]:
    for index, prompt in enumerate(prompt_list):
        scheduler.add_request(
            f"r{index}",
            prompt,
            SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True),
        )
    steps = 0
    tokens: dict[str, list[int]] = {}
    while scheduler.has_work:
        scheduler.step()
        steps += 1
        assert steps < 10_000
    return tokens


def collected(outputs) -> dict[str, list[int]]:
    return {rid: [t for o in items for t in o.token_ids] for rid, items in outputs.items()}


@pytest.mark.parametrize(
    ("page_size", "layout", "chunk", "overlap"),
    [(1, "nhd", 64, True), (4, "hnd", 7, True), (4, "nhd", 7, False)],
)
def test_batched_greedy_tokens_equal_the_transformers_oracle(tiny, page_size, layout, chunk, overlap):
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(
        directory, page_size=page_size, layout=layout, chunk=chunk, overlap=overlap
    )
    prompt_list = prompts(5, seed=page_size, shared_prefix=9)
    run_all(scheduler, prompt_list)
    got = collected(outputs)
    for index, prompt in enumerate(prompt_list):
        assert got[f"r{index}"] == hf_greedy(model, prompt, NEW_TOKENS), index
    assert all(items[-1].finished and items[-1].finish_reason == "length" for items in outputs.values())
    scheduler.check_slot_accounting()
    engine.close()


def test_tiny_pool_retracts_and_still_produces_the_same_tokens(tiny):
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, max_total_tokens=96, page_size=4, chunk=32)
    prompt_list = prompts(6, seed=7)
    run_all(scheduler, prompt_list, max_new_tokens=24)
    assert scheduler.num_retractions > 0
    got = collected(outputs)
    for index, prompt in enumerate(prompt_list):
        assert got[f"r{index}"] == hf_greedy(model, prompt, 24), index
    scheduler.check_slot_accounting()
    assert scheduler.cache.evict(10**9) >= 0
    assert engine.runner.allocator.available_tokens == engine.runner.allocator.capacity_tokens
    engine.close()


def test_shared_prefix_is_served_from_the_cache(tiny):
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=4)
    first, second = prompts(2, seed=11, shared_prefix=40)
    run_all(scheduler, [first])
    scheduler.add_request(
        "again", second, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    while scheduler.has_work:
        scheduler.step()
    final = outputs["again"][-1]
    assert final.cached_tokens >= 36
    assert [t for o in outputs["again"] for t in o.token_ids] == hf_greedy(model, second, NEW_TOKENS)
    assert scheduler.cache.hit_rate > 0
    scheduler.check_slot_accounting()
    engine.close()


def test_an_idle_engine_reports_no_kv_in_use_and_its_prefix_cache_apart(tiny):
    directory, _ = tiny
    engine, scheduler, _ = make_scheduler(directory, page_size=4)
    run_all(scheduler, prompts(3, seed=5))
    stats = scheduler.stats().to_dict()
    assert scheduler.cache.cached_tokens > 0
    assert stats["kv_cache_usage"] == 0.0
    assert (
        stats["kv_cache_cached_usage"]
        == scheduler.cache.cached_tokens / engine.runner.allocator.capacity_tokens
    )
    engine.close()


def test_abort_frees_slots_at_once_and_others_go_on(tiny):
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=1, prefix_cache=False)
    prompt_list = prompts(3, seed=5)
    for index, prompt in enumerate(prompt_list):
        scheduler.add_request(
            f"r{index}", prompt, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        )
    for _ in range(4):
        scheduler.step()
    scheduler.abort("r1")
    scheduler.abort("unknown-id")  # idempotent, harmless
    scheduler.step()
    assert outputs["r1"][-1].finish_reason == "abort"
    scheduler.check_slot_accounting()
    while scheduler.has_work:
        scheduler.step()
    got = collected(outputs)
    assert got["r0"] == hf_greedy(model, prompt_list[0], 30)
    assert engine.runner.allocator.available_tokens == engine.runner.allocator.capacity_tokens
    engine.close()


def test_bad_requests_are_refused_without_touching_the_pool(tiny):
    directory, _ = tiny
    engine, scheduler, _ = make_scheduler(directory)
    free = engine.runner.allocator.available_tokens
    with pytest.raises(InvalidRequest, match="context holds"):
        scheduler.add_request("long", list(range(3, 300)) * 2, SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match="empty"):
        scheduler.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequest, match="top_p"):
        scheduler.add_request("bad", [5, 6], SamplingParams(top_p=0.0))
    assert engine.runner.allocator.available_tokens == free and not scheduler.has_work
    engine.close()


def test_stop_strings_and_seeded_sampling_are_reproducible(tiny):
    directory, _ = tiny
    results = []
    for _ in range(2):
        engine, scheduler, outputs = make_scheduler(directory)
        scheduler.add_request(
            "s",
            [5, 6, 7],
            SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True),
        )
        while scheduler.has_work:
            scheduler.step()
        results.append(collected(outputs)["s"])
        engine.close()
    assert results[0] == results[1] and len(results[0]) == 16


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("where", ["prefill forward", "decode forward", "after sampling"])
def test_a_step_that_fails_midway_loses_no_request_and_no_slot(tiny, page_size, where, overlap):
    """Whatever point of a step raises, `fail_all` ends every request exactly once, with an error,
    and every slot (also those taken for the failed step, and for a step still in flight) is back."""
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=page_size, chunk=16, overlap=overlap)
    prompt_list = prompts(4, seed=9)
    for index, prompt in enumerate(prompt_list[:3]):
        scheduler.add_request(f"r{index}", prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(4):  # some requests are decoding by now
        scheduler.step()
    scheduler.add_request("late", prompt_list[3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    real_forward, real_stop_reason = scheduler.runner.forward, scheduler._stop_reason
    calls = {"stop_reason": 0}

    def forward(rows, slots):
        is_prefill = any(len(row.token_ids) > 1 for row in rows)
        if (where == "prefill forward") == is_prefill and where != "after sampling":
            raise RuntimeError("injected")
        return real_forward(rows, slots)

    def stop_reason(request, limits):
        calls["stop_reason"] += 1
        if where == "after sampling" and calls["stop_reason"] == 2:  # the second row of a batch
            raise RuntimeError("injected")
        return real_stop_reason(request, limits)

    scheduler.runner.forward, scheduler._stop_reason = forward, stop_reason
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(100):
            scheduler.step()
    scheduler.fail_all("injected failure")
    assert not scheduler.has_work and not scheduler.requests
    for rid in ("r0", "r1", "r2", "late"):
        finals = [output for output in outputs.get(rid, []) if output.finished]
        assert len(finals) == 1, (rid, finals)
        assert finals[0].finish_reason in ("error", "length"), finals
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    allocator = engine.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens
    scheduler.runner.forward, scheduler._stop_reason = real_forward, real_stop_reason
    scheduler.add_request("after", prompt_list[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    while scheduler.has_work:
        scheduler.step()
    assert collected(outputs)["after"] == hf_greedy(model, prompt_list[0], 6)
    engine.close()


def run_to_end(scheduler: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not scheduler.has_work:
            return
        scheduler.step()
        scheduler.check_slot_accounting()
    raise AssertionError(f"still working after {limit} steps: {len(scheduler.waiting)} waiting")


def test_a_request_that_outgrows_the_whole_kv_cache_ends_with_kv_capacity_and_blocks_nobody(tiny):
    directory, _ = tiny
    engine, scheduler, outputs = make_scheduler(directory, max_total_tokens=64, page_size=4, chunk=32)
    capacity = engine.runner.allocator.capacity_tokens
    scheduler.add_request("big", list(range(3, 23)), SamplingParams(max_new_tokens=200, ignore_eos=True))
    run_to_end(scheduler)
    final = outputs["big"][-1]
    assert (
        final.finish_reason == "kv_capacity" and final.prompt_tokens + final.completion_tokens + 4 > capacity
    )
    scheduler.add_request("small", [5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    run_to_end(scheduler)
    assert outputs["small"][-1].finish_reason == "length" and outputs["small"][-1].completion_tokens == 2
    engine.close()


@pytest.mark.parametrize("chunk", [9, 8])
def test_the_last_chunk_of_a_prompt_that_nearly_fills_the_cache_is_scheduled(tiny, chunk):
    """The room a chunk needs counts the free part of the request's last page (an unaligned kv_len)."""
    directory, _ = tiny
    engine, scheduler, outputs = make_scheduler(directory, max_total_tokens=64, page_size=4, chunk=chunk)
    prompt = [3 + (i * 7) % 290 for i in range(60)]  # prompt + one page == capacity
    scheduler.add_request("near-full", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    run_to_end(scheduler)
    assert outputs["near-full"][-1].completion_tokens == 1
    engine.close()


def test_a_tokenizer_that_fails_on_the_output_still_ends_the_request_with_an_error(tiny):
    class Fragile:
        def decode(self, ids, skip_special_tokens=True):
            if 266 in ids:
                raise ValueError("cannot decode 266")
            return "".join(chr(65 + i % 26) for i in ids)

    directory, _ = tiny
    engine, scheduler, outputs = make_scheduler(directory, tokenizer=Fragile())
    real_forward = engine.runner.forward

    def forward_that_favours_266(rows, slots):
        logits = real_forward(rows, slots).clone()
        logits[:, 266] += 1000.0
        return logits

    engine.runner.forward = forward_that_favours_266
    scheduler.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="cannot decode"):
        run_to_end(scheduler)
    scheduler.fail_all("internal error: cannot decode")
    final = outputs["r"][-1]
    assert final.finished and final.finish_reason == "error" and "cannot decode" in final.error
    assert not scheduler.requests and not scheduler.has_work
    scheduler.check_slot_accounting()
    engine.close()


def test_with_stop_strings_the_last_token_still_reaches_the_text(tiny):
    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    directory, _ = tiny
    engine, scheduler, outputs = make_scheduler(directory, tokenizer=Letters())
    prompt = [5, 6, 7]
    scheduler.add_request("probe", prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    run_to_end(scheduler)
    third = [token for output in outputs["probe"] for token in output.token_ids][2]
    ends_at_third = SamplingParams(max_new_tokens=5, ignore_eos=True, stop_token_ids=(third,))
    scheduler.add_request("ids", prompt, ends_at_third)
    scheduler.add_request("ids+strings", prompt, dataclasses.replace(ends_at_third, stop=("#",)))
    run_to_end(scheduler)
    texts = {rid: "".join(output.text for output in outputs[rid]) for rid in ("ids", "ids+strings")}
    assert texts["ids"] == texts["ids+strings"] and texts["ids"].endswith(chr(97 + third % 26)), texts
    engine.close()
