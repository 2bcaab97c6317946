"""Speculative decoding inside the scheduler, on the embedded SmolLM2 (CPU, torch attention): with
either proposer greedy tokens equal plain decoding's token for token across a batch of different
prompts, with stop strings, stop tokens and max_tokens cutting inside accepted drafts, with
log-probabilities and penalties, with paged KV and synchronous steps; drafts are accepted on a
repetitive prompt; sampling still runs; back-off turns speculation off; every slot comes back."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest

from snugkv.core.sampling import SamplingParams
from snugkv.engine import Engine, EngineArgs
from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import load_tokenizer
from snugkv.scheduler.scheduler import Scheduler
from snugkv.speculative.config import SpeculativeConfig
from snugkv.speculative.drafter import RowDrafter

NEW_TOKENS = 32
REPETITIVE = "one two three four one two three four one two three four one two"
PROMPTS = {
    "code": "def fibonacci(n):",
    "repeat": REPETITIVE,
    "fox": "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "colours": "Three primary colours are",
}
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    draft_tokens: int | None = None
    accepted_draft_tokens: int = 0


def make_engine(page_size: int) -> Engine:
    return Engine(
        EngineArgs.of(
            model=str(default_model.default_model_path()),
            dtype="float32",
            host_kv_gib=0.05,
            max_running_requests=8,
            page_size=page_size,
        )
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSource(default_model.default_model_path(), "gguf"))


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(page_size=1)
    yield engine
    engine.close()


def run(
    engine: Engine,
    tokenizer,
    requests: dict[str, SamplingParams],
    *,
    speculative: SpeculativeConfig | None = None,
    overlap: bool = True,
    prompts: dict[str, str] = PROMPTS,
) -> tuple[dict[str, Result], Scheduler]:
    """Run `requests` (rid -> sampling; the prompt is `prompts[rid]`, or the rid before a `:`) to
    the end; every slot must come back, none leaked to the prefix cache or kept."""
    results: dict[str, Result] = {}

    def on_output(request, output) -> None:
        result = results.setdefault(output.rid, Result())
        result.tokens.extend(output.token_ids)
        result.logprobs.extend(output.logprobs)
        result.text += output.text
        if output.finished:
            result.finish_reason = output.finish_reason
            result.draft_tokens, result.accepted_draft_tokens = (
                output.draft_tokens,
                output.accepted_draft_tokens,
            )

    scheduler = Scheduler(
        engine.runner,
        tokenizer=tokenizer,
        eos_token_ids=engine.config.eos_token_ids,
        max_running_requests=8,
        chunked_prefill_size=256,
        overlap=overlap,
        on_output=on_output,
        speculative=speculative,
    )
    for rid, sampling in requests.items():
        scheduler.add_request(rid, tokenizer.encode(prompts[rid.split(":")[0]]), sampling)
    steps = 0
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_slot_accounting()
        steps += 1
        assert steps < 1000
    scheduler.cache.reset()
    allocator = engine.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens  # nothing held, nothing leaked
    return results, scheduler


def tokens_of(results: dict[str, Result]) -> dict[str, tuple[list[int], str, str | None]]:
    return {rid: (r.tokens, r.text, r.finish_reason) for rid, r in results.items()}


@pytest.fixture(scope="module")
def plain(engine, tokenizer) -> dict[str, Result]:
    return run(engine, tokenizer, dict.fromkeys(PROMPTS, GREEDY))[0]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_equal_plain_decoding_and_repetition_is_accepted(engine, tokenizer, plain, method):
    results, scheduler = run(
        engine, tokenizer, dict.fromkeys(PROMPTS, GREEDY), speculative=SpeculativeConfig(method)
    )
    assert tokens_of(results) == tokens_of(plain)
    repeat = results["repeat"]
    assert repeat.draft_tokens is not None and repeat.accepted_draft_tokens > repeat.draft_tokens // 2
    stats = scheduler.stats()
    assert stats.spec_accepted_tokens == sum(r.accepted_draft_tokens for r in results.values()) > 0
    assert stats.spec_draft_tokens == sum(r.draft_tokens or 0 for r in results.values())
    assert 1.0 < stats.spec_mean_accepted_length <= 1 + SpeculativeConfig(method).num_tokens
    assert stats.generated_tokens == len(PROMPTS) * NEW_TOKENS


def test_paged_kv_and_synchronous_steps_give_the_same_tokens_and_free_every_page(tokenizer):
    # Page size 4: a rejected draft's slots may share a page with kept ones; only whole pages past
    # the kept positions go back, the page in between is the request's next step's.
    engine = make_engine(page_size=4)
    try:
        requests = dict.fromkeys(PROMPTS, GREEDY)
        expected, _ = run(engine, tokenizer, requests, overlap=False)
        for overlap in (False, True):
            results, scheduler = run(
                engine,
                tokenizer,
                requests,
                speculative=SpeculativeConfig("ngram", num_tokens=5),
                overlap=overlap,
            )
            assert tokens_of(results) == tokens_of(expected)
            assert scheduler.stats().spec_accepted_tokens > 0
    finally:
        engine.close()


def test_rows_draft_behind_a_step_in_flight_and_keep_plain_decodings_tokens(
    engine, tokenizer, plain, monkeypatch
):
    # Overlapped: a verify step is launched while the step before it (which computes the row's last
    # token) is still unread; the draft follows the proposer's guess of that token. The repetitive
    # prompt's guesses hold, so such steps keep drafts; greedy tokens stay plain decoding's.
    launched_behind: list[bool] = []
    launch_verify = Scheduler._launch_verify

    def recording(self, scheduled, logits, started, draft_probs, previous):
        launched_behind.append(previous is not None)
        return launch_verify(self, scheduled, logits, started, draft_probs, previous)

    monkeypatch.setattr(Scheduler, "_launch_verify", recording)
    results, scheduler = run(engine, tokenizer, {"repeat": GREEDY}, speculative=SpeculativeConfig("ngram"))
    assert tokens_of(results) == tokens_of({"repeat": plain["repeat"]})
    assert any(launched_behind) and results["repeat"].accepted_draft_tokens > NEW_TOKENS // 2
    assert scheduler.times.overlapped_steps >= sum(launched_behind)

    # the guess of the unread token is dropped: [1, 2, 3, 1, 2] continues 3, 1, 2, 3, ...
    drafter = RowDrafter(SpeculativeConfig("ngram"), [1, 2, 3, 1, 2], None)
    assert drafter.propose([1, 2, 3, 1, 2], 3, unread=1) == [1, 2, 3]
    assert drafter.propose([1, 2, 3, 1, 2, 3], 3) == [1, 2, 3]


def test_stops_and_max_tokens_cut_the_emitted_tokens_inside_an_accepted_draft(engine, tokenizer):
    four = tokenizer.encode(" four")[-1]
    requests = {
        "repeat:string": replace(GREEDY, stop=("three four one",)),
        "repeat:token": replace(GREEDY, stop_token_ids=(four,)),
        "repeat:min_tokens": replace(GREEDY, stop_token_ids=(four,), min_tokens=6),
        **{f"repeat:max{n}": replace(GREEDY, max_new_tokens=n) for n in (1, 2, 5, 7)},
        "fox:string": replace(GREEDY, stop=("lazy",)),
    }
    expected, _ = run(engine, tokenizer, requests)
    results, scheduler = run(engine, tokenizer, requests, speculative=SpeculativeConfig("ngram"))
    assert tokens_of(results) == tokens_of(expected)
    assert (
        results["repeat:string"].finish_reason == "stop"
        and "three four one" not in results["repeat:string"].text
    )
    assert results["repeat:token"].tokens[-1] == four and results["repeat:token"].finish_reason == "stop"
    assert [len(results[f"repeat:max{n}"].tokens) for n in (1, 2, 5, 7)] == [1, 2, 5, 7]
    assert results["repeat:max7"].accepted_draft_tokens > 0
    assert scheduler.stats().spec_accepted_tokens > 0


def test_logprobs_and_penalties_follow_each_emitted_token(engine, tokenizer):
    requests = {
        "repeat:logprobs": replace(GREEDY, logprobs=2),
        "code:logprobs": replace(GREEDY, logprobs=0),
        "repeat:penalties": replace(GREEDY, repetition_penalty=1.15, frequency_penalty=0.2),
        "fox:presence": replace(GREEDY, presence_penalty=0.5),
    }
    expected, _ = run(engine, tokenizer, requests)
    results, _ = run(engine, tokenizer, requests, speculative=SpeculativeConfig("suffix"))
    assert tokens_of(results) == tokens_of(expected)
    for rid in ("repeat:logprobs", "code:logprobs"):
        got, want = results[rid].logprobs, expected[rid].logprobs
        assert [entry.token_id for entry in got] == results[rid].tokens
        assert [entry.top_ids for entry in got] == [entry.top_ids for entry in want]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want, strict=True)) < 1e-3
    assert results["repeat:logprobs"].accepted_draft_tokens > 0


def test_sampling_with_temperature_runs_reproducibly_and_accepts_drafts(engine, tokenizer):
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.7, top_k=40, seed=3)
    requests = {"repeat": sampled, "code": replace(sampled, seed=4, top_p=0.9)}
    config = SpeculativeConfig("ngram")
    first, scheduler = run(engine, tokenizer, requests, speculative=config)
    again, _ = run(engine, tokenizer, requests, speculative=config)
    assert tokens_of(first) == tokens_of(again)
    assert all(len(result.tokens) == NEW_TOKENS for result in first.values())
    assert scheduler.stats().spec_accepted_tokens > 0


def test_large_batches_do_not_speculate_and_rows_that_keep_failing_pause(
    engine, tokenizer, plain, monkeypatch
):
    from snugkv.scheduler.launched import LaunchedStep

    monkeypatch.setattr(LaunchedStep, "running", lambda self: True)  # as a GPU still busy with the step
    results, scheduler = run(
        engine,
        tokenizer,
        dict.fromkeys(PROMPTS, GREEDY),
        speculative=SpeculativeConfig("ngram", max_batch_size=len(PROMPTS) - 1),
    )
    assert tokens_of(results) == tokens_of(plain)
    assert scheduler.stats().spec_draft_tokens == 0
    assert all(result.draft_tokens == 0 for result in results.values())
    # the batch is over the cap by less than as much again: drafters were built behind steps in flight
    assert scheduler.speculation is not None and scheduler.speculation.counts.ahead_host_s > 0

    # a row pauses once its recent verify steps average fewer accepted tokens than pay for them
    drafter = RowDrafter(SpeculativeConfig("ngram", num_tokens=3, pause_tokens=5), [1, 2, 1, 2], None)
    drafter.break_even = 0.5
    assert drafter.propose([1, 2, 1, 2], 3) == [1, 2, 1]
    drafter.record(3, 0, num_tokens=5)  # recent accepted 3 -> 1.5
    drafter.record(3, 0, num_tokens=6)  # 0.75
    assert drafter.may_draft(6)
    drafter.record(3, 0, num_tokens=7)  # 0.375 < 0.5: paused for 5 tokens
    assert not drafter.may_draft(11) and drafter.propose([1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1], 3) == []
    assert drafter.may_draft(12) and (drafter.proposed_tokens, drafter.accepted_tokens) == (9, 0)
    assert drafter.recent_accepted == 0.5  # from the break-even: one more poor step pauses it again
    drafter.record(3, 1, num_tokens=14)  # 0.75: drafts on
    assert drafter.may_draft(14)
    # a proposer that finds nothing costs only its lookup where verify steps are cheap ...
    cheap = RowDrafter(SpeculativeConfig("ngram", pause_tokens=5), [1, 2, 3], None)
    for length in (3, 4, 5):
        assert cheap.may_draft(length) and cheap.propose([1, 2, 3, *range(10, 10 + length - 3)], 3) == []
    # ... where a verify step costs more than a decode step's token, such a row pauses 2, 4, then 5
    # (pause_tokens) tokens; a draft resets it
    nothing = RowDrafter(SpeculativeConfig("ngram", pause_tokens=5), [1, 2, 3], None)
    nothing.break_even = 1.3
    resumes = []
    for length in (3, 5, 9):
        assert nothing.may_draft(length) and nothing.propose([1, 2, 3, *range(10, 10 + length - 3)], 3) == []
        resumes.append(nothing.resume_at_tokens)
    assert resumes == [5, 9, 14] and not nothing.may_draft(13) and nothing.may_draft(14)
    assert nothing.propose([1, 2, 3, *range(10, 21), 1, 2], 3) == [3, 10, 11]  # found: the count starts again
    assert (
        nothing.propose([1, 2, 3, *range(10, 21), 1, 2, 99], 3) == [] and nothing.resume_at_tokens == 17 + 2
    )


def test_the_break_even_comes_from_the_measured_decode_verify_and_host_times():
    from snugkv.scheduler.launched import StepRecord
    from snugkv.scheduler.speculation import StepCosts
    from snugkv.speculative.config import DEFAULT_BREAK_EVEN

    costs = StepCosts()
    assert costs.break_even(1) == DEFAULT_BREAK_EVEN

    def step(rows: int, tokens: int, busy_ms: float, gap_ms: float = 0.05, decode: bool = True) -> None:
        costs.observe(StepRecord(0.0, decode, rows, tokens, busy_ms / 1e3, gap_ms / 1e3, 0.0))

    step(1, 1, 5.8)  # a plain decode step of one row
    assert costs.break_even(1) == DEFAULT_BREAK_EVEN  # no verify step timed yet
    step(1, 5, 6.7)  # a verify step of 4 drafts
    step(1, 1, 5.8, gap_ms=0.7)  # the host's 0.7 ms after it
    assert costs.break_even(1) == pytest.approx((6.7 + 0.7 - 5.8) / 5.8)
    assert costs.break_even(3) == DEFAULT_BREAK_EVEN  # another batch size: its own steps
    step(1, 300, 40.0, gap_ms=9.0, decode=False)  # a prefill step's gap is not a verify's host work
    assert costs.break_even(1) == pytest.approx((6.7 + 0.7 - 5.8) / 5.8)
    step(1, 5, 6.7)
    step(1, 1, 5.8, gap_ms=500.0)  # a stall (no request for a while) counts as at most a step
    assert costs.break_even(1) == pytest.approx((6.7 + (0.9 * 0.7 + 0.1 * 5.8) - 5.8) / 5.8)

    # what a row's drafter is given: the measured figure, a fixed one, or (ranks: each times its own
    # steps, all must pause alike) the default
    from snugkv.scheduler.speculation import Speculation

    def given(speculation: Speculation) -> float:
        speculation.costs = costs
        request = SimpleNamespace(
            in_flight=0,
            grammar=None,
            drafter=None,
            num_tokens=3,
            prompt_ids=[1, 2, 3],
            all_ids=[1, 2, 3],
            sampling=SamplingParams(max_new_tokens=8),
        )
        speculation.drafts([request], 64)
        return request.drafter.break_even

    assert given(Speculation(SpeculativeConfig("ngram"))) == costs.break_even(1)
    timed = Speculation(SpeculativeConfig("ngram"))
    given(timed)  # the host's time drafting is counted (bench speculative's draft_host_ms)
    assert 0.0 < timed.counts.draft_host_s < 1.0
    assert given(Speculation(SpeculativeConfig("ngram", break_even=2.0))) == 2.0
    assert given(Speculation(SpeculativeConfig("ngram"), measure_costs=False)) == DEFAULT_BREAK_EVEN


def test_drafters_are_built_a_few_a_step_ahead_while_the_batch_nears_the_cap():
    from snugkv.scheduler.speculation import AHEAD_PER_STEP, Speculation

    def requests(n: int, grammar: object = None) -> list[SimpleNamespace]:
        return [SimpleNamespace(drafter=None, grammar=grammar, prompt_ids=[1, 2, 3, 1, 2]) for _ in range(n)]

    speculation = Speculation(SpeculativeConfig("suffix", max_batch_size=AHEAD_PER_STEP))
    at_cap, far_over = requests(AHEAD_PER_STEP), requests(2 * AHEAD_PER_STEP + 1)
    speculation.build_ahead(at_cap)  # at the cap: built at the first step that speculates
    speculation.build_ahead(far_over)  # far over it: the batch may never come down
    assert all(r.drafter is None for r in at_cap + far_over)
    near = requests(2 * AHEAD_PER_STEP - 1) + requests(1, grammar=object())
    speculation.build_ahead(near)
    assert [r.drafter is not None for r in near] == [True] * AHEAD_PER_STEP + [False] * AHEAD_PER_STEP
    first = near[0].drafter
    speculation.build_ahead(near)  # the next step: the rest, never a grammar's row, none twice
    assert [r.drafter is not None for r in near] == [True] * (2 * AHEAD_PER_STEP - 1) + [False]
    assert near[0].drafter is first and first.proposer.store is speculation.store
    assert speculation.counts.ahead_host_s > 0 and speculation.counts.draft_host_s == 0
    model = Speculation(SpeculativeConfig("draft", max_batch_size=AHEAD_PER_STEP, draft_model="layers:1"))
    model.build_ahead(near := requests(AHEAD_PER_STEP + 1))
    assert all(r.drafter is None for r in near)  # a draft model's rows have no proposer to build


@pytest.mark.parametrize("built_after", [0, 3, 6])
def test_a_finished_request_s_whole_output_joins_the_store_whenever_its_drafter_was_built(built_after):
    """The suffix store gets a request's output from its prompt's end to its last token, whether its
    drafter was built at admission, ahead of the cap (`build_ahead`) or at a late first proposal,
    and whether it proposed after its last tokens or not: what ranks under --tp store never depends
    on when each built it."""
    from snugkv.scheduler.speculation import Speculation

    prompt, output = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]
    speculation = Speculation(SpeculativeConfig("suffix", max_batch_size=1))
    request = SimpleNamespace(
        drafter=None, grammar=None, prompt_ids=prompt, all_ids=prompt + output[:built_after], in_flight=0
    )
    speculation.build_ahead([request, SimpleNamespace(drafter=None, grammar=None, prompt_ids=[1])])
    assert request.drafter is not None and request.drafter.proposer.num_tokens == len(prompt)
    request.drafter.propose(request.all_ids, 2)  # catches up on the output so far
    request.all_ids = prompt + output
    speculation.finish(request, "length")
    store = speculation.store
    assert store is not None and (store.num_sequences, store.num_tokens) == (1, len(output))
    stored = store.occurrences((8, 9), 4)  # the last gram with a token after it
    assert [sequence[start:] for sequence, start in stored] == [[8, 9, 10]]
    speculation.finish(request, "length")  # once only
    assert store.num_sequences == 1


def test_a_constrained_row_runs_beside_speculating_rows(engine, tokenizer):
    pytest.importorskip("xgrammar")
    from snugkv.core.structured_output import StructuredOutput

    requests = {
        "colours:choice": SamplingParams(
            max_new_tokens=8, structured=StructuredOutput("choice", '[" red", " blue"]')
        ),
        "repeat": GREEDY,
    }
    expected, _ = run(engine, tokenizer, requests)
    results, _ = run(engine, tokenizer, requests, speculative=SpeculativeConfig("ngram"))
    assert tokens_of(results) == tokens_of(expected)
    assert results["colours:choice"].text in (" red", " blue") and results["colours:choice"].draft_tokens == 0
    assert results["repeat"].accepted_draft_tokens > 0


def test_a_row_whose_guesses_fail_reads_the_step_in_flight_first_and_keeps_plain_tokens(
    engine, tokenizer, plain, monkeypatch
):
    # Every guess of a token in flight is made wrong (the draft itself stays the proposer's): after
    # the first one is read, the row's drafts wait for the step in flight instead of riding on a
    # guess; they are then made from the token itself, so the repetitive prompt still accepts most.
    launched_behind: list[bool] = []
    launch_verify, propose = Scheduler._launch_verify, RowDrafter.propose

    def recording(self, scheduled, logits, started, draft_probs, previous):
        launched_behind.append(previous is not None)
        return launch_verify(self, scheduled, logits, started, draft_probs, previous)

    def guessing_wrong(self, token_ids, k, unread=0):
        draft = propose(self, token_ids, k, unread)
        if self._guess is not None:
            self._guess = (self._guess[0], -1)  # no token is -1
        return draft

    monkeypatch.setattr(Scheduler, "_launch_verify", recording)
    monkeypatch.setattr(RowDrafter, "propose", guessing_wrong)
    results, scheduler = run(engine, tokenizer, {"repeat": GREEDY}, speculative=SpeculativeConfig("ngram"))
    assert tokens_of(results) == tokens_of({"repeat": plain["repeat"]})
    counts = scheduler.speculation.counts
    assert counts.guesses >= 2 and counts.guesses_held == 0 and counts.reads_first >= 1
    # one verify step rode on a guess before the first was read wrong; after it, none or one more
    assert 1 <= sum(launched_behind) <= 2 < len(launched_behind)
    assert results["repeat"].accepted_draft_tokens > NEW_TOKENS // 2


def test_a_guess_is_counted_once_its_token_is_read():
    drafter = RowDrafter(SpeculativeConfig("ngram"), [1, 2, 3, 1, 2], None)
    assert drafter.propose([1, 2, 3, 1, 2], 3, unread=1) == [1, 2, 3]  # guessed 3 at position 5
    assert drafter.read_guess([1, 2, 3, 1, 2]) is None  # not read yet
    assert drafter.read_guess([1, 2, 3, 1, 2, 3]) is True
    assert drafter.read_guess([1, 2, 3, 1, 2, 3]) is None  # counted once
    assert (drafter.guesses, drafter.guesses_held, drafter.guesses_well) == (1, 1, True)
    drafter.propose([1, 2, 3, 1, 2, 3], 2, unread=1)  # guesses 1 at position 6
    drafter.propose([1, 2, 3, 1, 2, 3, 9], 2)  # the token was 9: read by the next proposal
    assert (drafter.guesses, drafter.guesses_held, drafter.guesses_well) == (2, 1, False)
    assert drafter.recent_guess_rate == 0.5
    # a proposal read from the token itself guesses nothing
    drafter.propose([1, 2, 3, 1, 2, 3, 9, 1], 2)
    assert drafter.read_guess([1, 2, 3, 1, 2, 3, 9, 1, 2]) is None


def test_a_step_reads_first_when_half_or_more_of_its_guessing_rows_guess_poorly():
    from snugkv.scheduler.speculation import Speculation

    speculation = Speculation(SpeculativeConfig("ngram"))

    def row(in_flight: int, rate: float) -> SimpleNamespace:
        drafter = RowDrafter(SpeculativeConfig("ngram"), [1], None)
        drafter.recent_guess_rate = rate
        return SimpleNamespace(in_flight=in_flight, drafter=drafter)

    good, poor, read = row(1, 1.0), row(1, 0.25), row(0, 0.25)
    assert not speculation.reads_first([good, good], [[5], [5]])
    assert speculation.reads_first([good, poor], [[5], [5]])  # half
    assert not speculation.reads_first([good, good, poor], [[5], [5], [5]])
    assert not speculation.reads_first([good, poor], [[5], []])  # the poor row drafts nothing
    assert not speculation.reads_first([good, read], [[5], [5]])  # its token is read: no guess
    assert speculation.counts.reads_first == 1
