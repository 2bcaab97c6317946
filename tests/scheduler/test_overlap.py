"""Overlapped scheduling: the host launches step N+1 before it reads step N's tokens, and nothing a
client sees changes: the same tokens, text, stop reasons and log-probabilities as the synchronous
scheduler, the extra token of a request that ended is never read, and every slot comes back."""

from __future__ import annotations

import dataclasses
import random

import pytest

from snugkv.core.forward import FUTURE_TOKEN
from snugkv.core.sampling import SamplingParams
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model
from tests.scheduler.sync_free import decode_steps_without_waiting
from tests.scheduler.test_scheduler import collected, make_scheduler, prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-overlap")
    model = save_tiny_hf_model("llama", directory)
    return directory, model


class Letters:
    """A tokenizer whose text is one letter per token, so stop strings are easy to hit."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def mixed_workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Varied prompts (some sharing a prefix), lengths, greedy and seeded sampling, stop strings,
    stop token ids, EOS, log-probabilities."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(12)]
    requests = []
    for index in range(14):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))]
        if index % 3 == 0:
            prompt = shared + prompt
        sampling = SamplingParams(max_new_tokens=rng.randrange(1, 24), ignore_eos=index % 4 != 0)
        if index % 2:
            sampling = dataclasses.replace(sampling, temperature=0.9, top_p=0.95, top_k=40, seed=100 + index)
        if index % 5 == 1:
            sampling = dataclasses.replace(sampling, stop=("e", "kq", "t"))
        if index % 5 == 2:
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(range(index, 320, 8)))
        if index % 4 == 3:
            sampling = dataclasses.replace(sampling, logprobs=2)
        requests.append((f"m{index}", prompt, sampling))
    return requests


def run_mixed(directory, *, overlap: bool, mixed_steps: bool = True, **engine) -> tuple[dict, int]:
    """The mixed workload, fed in three waves while earlier requests decode, one request aborted
    mid-flight; slot accounting is checked after every step. `mixed_steps`: `Scheduler.mixed`."""
    _, scheduler, outputs = make_scheduler(directory, tokenizer=Letters(), overlap=overlap, **engine)
    scheduler.mixed = mixed_steps
    workload = mixed_workload(seed=3)
    waves = [workload[:6], workload[6:10], workload[10:]]
    steps = 0
    while waves or scheduler.has_work:
        if waves and steps % 3 == 0:
            for rid, prompt, sampling in waves.pop(0):
                scheduler.add_request(rid, prompt, sampling)
        if steps == 4:
            scheduler.abort("m1")
        scheduler.step()
        scheduler.check_slot_accounting()
        steps += 1
        assert steps < 2000
    scheduler.cache.reset()
    allocator = scheduler.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens
    scheduler.runner.close()
    return outputs, scheduler.num_retractions


def client_view(outputs: list) -> list:
    """What a client reads, log-probabilities apart (see `logprob_values`)."""
    return [
        (
            o.token_ids,
            o.text,
            o.finished,
            o.finish_reason,
            o.completion_tokens,
            [(lp.token_id, lp.token, [t for t, _ in lp.top]) for lp in o.logprobs],
            o.error,
        )
        for o in outputs
    ]


def logprob_values(outputs: list) -> list[float]:
    """The log-probabilities, to compare with a tolerance: a batch of another size rounds the
    logits' last bits differently (the overlapped batch may hold a request that just ended)."""
    return [value for o in outputs for lp in o.logprobs for value in (lp.logprob, *(v for _, v in lp.top))]


def assert_same_client_view(overlapped: list, synchronous: list, rid: str) -> None:
    assert client_view(overlapped) == client_view(synchronous), rid
    assert logprob_values(overlapped) == pytest.approx(logprob_values(synchronous), abs=1e-4), rid


@pytest.mark.parametrize(
    "engine",
    [
        {"page_size": 1, "chunk": 64},
        {"page_size": 4, "chunk": 16},
        {"page_size": 4, "chunk": 32, "max_total_tokens": 64},  # small enough to retract
    ],
    ids=["page1", "page4-chunked", "page4-tiny-pool"],
)
def test_overlapped_and_synchronous_scheduling_give_clients_the_same_outputs(tiny, engine):
    directory, _ = tiny
    overlapped, retractions = run_mixed(directory, overlap=True, **engine)
    synchronous, sync_retractions = run_mixed(directory, overlap=False, **engine)
    if "max_total_tokens" in engine:
        assert retractions > 0 and sync_retractions > 0
    assert overlapped.keys() == synchronous.keys()
    for rid in synchronous:
        if rid == "m1":  # aborted after as many step() calls: the overlapped one is a step behind
            assert overlapped[rid][-1].finish_reason == synchronous[rid][-1].finish_reason == "abort"
            continue
        assert_same_client_view(overlapped[rid], synchronous[rid], rid)
        assert overlapped[rid][-1].cached_tokens == synchronous[rid][-1].cached_tokens, rid
    reasons = [o[-1].finish_reason for o in synchronous.values()]
    assert reasons.count("stop") >= 3 and {"length", "abort"} <= set(reasons), reasons
    assert any(o.logprobs for items in synchronous.values() for o in items)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_mixed_and_prefill_only_steps_give_clients_the_same_outputs(tiny, overlap):
    """The waves arrive while earlier requests decode: with mixed steps those decode inside the
    waves' prefill steps (a step earlier), and every client reads what prefill-only steps give."""
    directory, _ = tiny
    engine = {"page_size": 4, "chunk": 32}
    mixed, _ = run_mixed(directory, overlap=overlap, **engine)
    alone, _ = run_mixed(directory, overlap=overlap, mixed_steps=False, **engine)
    assert mixed.keys() == alone.keys()
    for rid in alone:
        if rid != "m1":  # aborted after as many step() calls: how far it got depends on the steps
            assert_same_client_view(mixed[rid], alone[rid], rid)


def test_the_next_decode_step_is_launched_before_the_last_step_is_read(tiny):
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory)
    forwards: list[tuple[list, int]] = []
    real_forward = engine.runner.forward

    def forward(rows, slots):
        forwards.append(([row.token_ids[0] for row in rows], len(outputs.get("r", []))))
        return real_forward(rows, slots)

    engine.runner.forward = forward
    prompt = [5, 6, 7, 8]
    scheduler.add_request("r", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while scheduler.has_work:
        scheduler.step()
    assert collected(outputs)["r"] == hf_greedy(model, prompt, 4)
    # prefill, then decodes that read their input on the device, each launched while the
    # previous token had not been sent yet; the fourth decode is the extra step, never read
    assert [tokens for tokens, _ in forwards[1:]] == [[FUTURE_TOKEN]] * 4
    assert [sent for _, sent in forwards] == [0, 0, 1, 2, 3]
    assert outputs["r"][-1].completion_tokens == 4 and outputs["r"][-1].finish_reason == "length"
    scheduler.check_slot_accounting()
    engine.close()


def test_prefill_chunks_are_launched_while_the_step_before_is_unread(tiny):
    """A long prompt in chunks, and a prompt arriving while another decodes: each prefill chunk is
    launched before the step in flight is read, starting where the in-flight chunk ends."""
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=4, chunk=8)
    launches: list[tuple[list[tuple[int, int]], int]] = []  # (prefix_len, tokens) per row, steps read
    real_forward, real_complete = engine.runner.forward, scheduler._complete
    completed = [0]

    def forward(rows, slots):
        launches.append(([(row.prefix_len, len(row.token_ids)) for row in rows], completed[0]))
        return real_forward(rows, slots)

    def complete(launched):
        completed[0] += 1
        real_complete(launched)

    engine.runner.forward, scheduler._complete = forward, complete
    long_prompt, late_prompt = list(range(40, 60)), [9, 8, 7, 6, 5]
    scheduler.add_request("long", long_prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    scheduler.step()
    scheduler.add_request("late", late_prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    while scheduler.has_work:
        scheduler.step()
    tokens = collected(outputs)
    assert tokens["long"] == hf_greedy(model, long_prompt, 3)
    assert tokens["late"] == hf_greedy(model, late_prompt, 3)
    # chunks of 8: 0-8 launched alone; 8-16 while 0-8 is in flight (nothing read yet); then the
    # last 4 tokens of "long" with the 5 of "late" (budget 8: 4 + 4), and so on
    assert launches[0] == ([(0, 8)], 0)
    assert launches[1] == ([(8, 8)], 0)
    assert launches[2][0][0] == (16, 4) and launches[2][1] == 1
    assert all(read == index - 1 for index, (_, read) in enumerate(launches) if index > 0)
    scheduler.check_slot_accounting()
    engine.close()


def test_a_request_that_ended_gives_back_its_slots_once_the_step_launched_after_it_is_read(tiny):
    """Not before: that step still writes the slot of its extra token, and a free slot may be filled
    by a host-tier load that does not wait for the device's queued work."""
    directory, _ = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=1, prefix_cache=False)
    allocator = engine.runner.allocator
    scheduler.add_request("short", [5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    scheduler.add_request("long", [8, 9, 10], SamplingParams(max_new_tokens=30, ignore_eos=True))
    while "short" not in outputs or not outputs["short"][-1].finished:
        scheduler.step()
        scheduler.check_slot_accounting()
    # "short" ended; the step launched after its last token (its extra slot) is not read yet
    long = scheduler.requests["long"]
    assert long.in_flight == 1
    short = scheduler.slots.held_back
    assert [request.rid for request in short] == ["short"]
    assert capacity_used(allocator) == long.kv_len + long.in_flight + short[0].launched_len
    assert [o.completion_tokens for o in outputs["short"]][-1] == 2
    scheduler.step()  # reads that step: "short" holds nothing now
    scheduler.check_slot_accounting()
    assert scheduler.slots.held_back == []
    assert capacity_used(allocator) == long.kv_len + long.in_flight
    while scheduler.has_work:
        scheduler.step()
    assert sum(len(o.token_ids) for o in outputs["long"]) == 30
    assert allocator.available_tokens == allocator.capacity_tokens
    engine.close()


def capacity_used(allocator) -> int:
    return allocator.capacity_tokens - allocator.available_tokens


def test_an_abort_while_its_step_is_in_flight_frees_the_step_and_skips_its_token(tiny):
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=4)
    prompt_list = prompts(2, seed=21)
    for index, prompt in enumerate(prompt_list):
        scheduler.add_request(f"r{index}", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(3):
        scheduler.step()
    assert scheduler.requests["r0"].in_flight == 1
    sent = len(collected(outputs)["r0"])
    scheduler.abort("r0")
    scheduler.step()
    assert outputs["r0"][-1].finish_reason == "abort" and len(collected(outputs)["r0"]) == sent
    scheduler.check_slot_accounting()
    while scheduler.has_work:
        scheduler.step()
    assert collected(outputs)["r1"] == hf_greedy(model, prompt_list[1], 12)
    scheduler.check_slot_accounting()
    engine.close()


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "prefill-only"])
def test_a_waiting_request_is_prefilled_while_the_step_in_flight_runs_and_joins_as_it_would(tiny, mixed):
    """A request that arrives while others decode is prefilled at the next step, launched before
    the host reads the step in flight (then read), and generates what it would alone. Mixed: the
    running request decodes in that step too, its input the token still on the device."""
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory)
    scheduler.mixed = mixed
    first, second = prompts(2, seed=4)
    scheduler.add_request("first", first, SamplingParams(max_new_tokens=10, ignore_eos=True))
    for _ in range(3):
        scheduler.step()
    sent = len(collected(outputs)["first"])
    scheduler.add_request("second", second, SamplingParams(max_new_tokens=10, ignore_eos=True))
    scheduler.step()  # launches the prefill of "second", then reads the step in flight
    launched = scheduler._in_flight
    assert not launched.batch.decode and launched.overlapped
    assert [r.rid for r in launched.batch.requests] == (["first", "second"] if mixed else ["second"])
    assert launched.batch.decode_rows == int(mixed)
    if mixed:
        assert launched.batch.rows[0].token_ids == [FUTURE_TOKEN]  # "first"'s token is still on the device
    assert len(collected(outputs)["first"]) == sent + 1
    assert not scheduler.waiting and len(scheduler.running) == 2
    while scheduler.has_work:
        scheduler.step()
    got = collected(outputs)
    assert got["first"] == hf_greedy(model, first, 10) and got["second"] == hf_greedy(model, second, 10)
    times = scheduler.times.as_dict()
    assert times["overlapped_steps"] > 0 and times["device_busy_s"] > 0
    assert 0 <= times["device_idle_fraction"] < 1
    records = list(scheduler.times.records)
    assert len(records) == times["steps"]
    assert [r.launched_at for r in records] == sorted(r.launched_at for r in records)
    assert records[0].gap_s is None and all(r.gap_s >= 0 for r in records[1:])
    prefills = [r for r in records if not r.decode]
    assert [r.tokens for r in prefills] == [len(first), len(second) + mixed]
    assert [r.rows for r in prefills] == [1, 1 + mixed]
    assert max(r.rows for r in records if r.decode) == 2  # both decode together after the join
    engine.close()


def test_the_overlap_and_mixed_flags_reach_the_scheduler(tiny):
    import argparse

    from snugkv.commands.engine_args import add_engine_arguments, engine_args_from
    from snugkv.driver.engine_core import EngineCore
    from snugkv.engine import Engine

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    directory, _ = tiny
    for flags, overlap, mixed in (
        ([], True, True),
        (["--disable-overlap-schedule"], False, True),
        (["--disable-mixed-steps"], True, False),
    ):
        args = engine_args_from(
            parser.parse_args(["--model", str(directory), "--host-kv-gib", "0.02", *flags])
        )
        assert args.scheduler.disable_overlap_schedule is not overlap
        engine = Engine(args)
        scheduler = EngineCore.around(engine).scheduler
        assert scheduler.overlap is overlap and scheduler.mixed is mixed
        engine.close()


@pytest.mark.parametrize("where", ["launching step N+1", "reading step N"])
def test_a_failure_with_two_steps_on_their_way_loses_no_request_and_no_slot(tiny, where):
    """Decode step N+1 is launched while step N is unread: a failure in either half ends every
    request once (`fail_all`), frees the slots of both steps, and the engine serves on."""
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, page_size=4)
    prompt_list = prompts(3, seed=13)
    for index, prompt in enumerate(prompt_list):
        scheduler.add_request(f"r{index}", prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(4):
        scheduler.step()
    assert scheduler._in_flight is not None and not scheduler.waiting
    real_forward, real_stop_reason = engine.runner.forward, scheduler._stop_reason
    calls = {"stop_reason": 0}

    def forward(rows, slots):
        raise RuntimeError("injected")

    def stop_reason(request, limits):
        calls["stop_reason"] += 1
        if calls["stop_reason"] == 2:
            assert scheduler._in_flight is not None  # step N+1 is on its way
            raise RuntimeError("injected")
        return real_stop_reason(request, limits)

    if where == "launching step N+1":
        engine.runner.forward = forward
    else:
        scheduler._stop_reason = stop_reason
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.step()
    scheduler.fail_all("injected failure")
    assert not scheduler.has_work and not scheduler.requests
    for rid in ("r0", "r1", "r2"):
        finals = [output for output in outputs[rid] if output.finished]
        assert len(finals) == 1 and finals[0].finish_reason == "error", (rid, finals)
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    allocator = engine.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens
    engine.runner.forward, scheduler._stop_reason = real_forward, real_stop_reason
    scheduler.add_request("after", prompt_list[0], SamplingParams(max_new_tokens=6, ignore_eos=True))
    while scheduler.has_work:
        scheduler.step()
    assert collected(outputs)["after"] == hf_greedy(model, prompt_list[0], 6)
    engine.close()


def gpu_scheduler(directory, *, page_size: int, overlap: bool):
    from snugkv.driver.engine_core import EngineCore
    from snugkv.engine import Engine, EngineArgs

    engine = Engine(
        EngineArgs.of(
            model=str(directory),
            device="cuda",
            dtype="float32",
            page_size=page_size,
            max_total_tokens=4096,
            max_running_requests=8,
            cuda_graph_max_bs=8,
        )
    )
    outputs: dict[str, list] = {}
    scheduler = EngineCore.around(
        engine, tokenizer=Letters(), on_output=lambda r, o: outputs.setdefault(o.rid, []).append(o)
    ).scheduler
    scheduler.overlap = overlap
    return engine, scheduler, outputs


def add_gpu_workload(scheduler) -> None:
    for index, (rid, prompt, sampling) in enumerate(mixed_workload(seed=5)[:8]):
        scheduler.add_request(rid, prompt, dataclasses.replace(sampling, max_new_tokens=12 + 3 * index))


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_on_a_gpu_overlapped_decode_steps_never_wait_for_the_gpu_and_match_synchronous_ones(tiny, page_size):
    """With every request decoding, a step (launch N+1, read N: outputs, stop strings,
    log-probabilities, requests that end and free their slots) makes no call that waits for the
    stream (torch's sync debug mode raises on one); the outputs equal synchronous scheduling's."""
    directory, _ = tiny
    engine, scheduler, overlapped = gpu_scheduler(directory, page_size=page_size, overlap=True)
    add_gpu_workload(scheduler)
    checked = decode_steps_without_waiting(scheduler)
    assert checked > 10 and scheduler.times.overlapped_steps >= checked - 1
    scheduler.check_slot_accounting()
    engine.close()

    engine, scheduler, synchronous = gpu_scheduler(directory, page_size=page_size, overlap=False)
    add_gpu_workload(scheduler)
    while scheduler.has_work:
        scheduler.step()
    engine.close()
    for rid in synchronous:
        assert_same_client_view(overlapped[rid], synchronous[rid], rid)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_on_a_gpu_mixed_steps_give_the_tokens_of_prefill_only_steps(tiny, page_size):
    """Requests that arrive while others decode: the prefill steps that take the decode rows along
    (the decode kernel for those rows, the extend kernel for the chunks, through the piecewise
    graphs) give every request the tokens of prefill-only steps, and every slot comes back."""
    directory, _ = tiny
    views = {}
    for mixed in (True, False):
        engine, scheduler, outputs = gpu_scheduler(directory, page_size=page_size, overlap=True)
        scheduler.mixed = mixed
        workload = mixed_workload(seed=5)[:8]
        for index, (rid, prompt, sampling) in enumerate(workload):
            scheduler.add_request(rid, prompt, dataclasses.replace(sampling, max_new_tokens=12 + 3 * index))
            for _ in range(2):  # the next request arrives while these decode
                scheduler.step()
        while scheduler.has_work:
            scheduler.step()
        scheduler.check_slot_accounting()
        prefill_rows = [r.rows for r in scheduler.times.records if not r.decode]
        assert (max(prefill_rows) > 1) is mixed  # each prompt arrived alone: more rows are decode rows
        engine.close()
        views[mixed] = outputs
    for rid in views[False]:
        assert_same_client_view(views[True][rid], views[False][rid], rid)
