"""`snugkv bench speculative`: acceptance, mean accepted length and tokens/s of speculative decoding
(the n-gram and suffix proposers; on request a draft model, `--proposers draft:layers:N` or
`draft:self`) on real text, against decoding without speculation in the same run.

One engine (the embedded SmolLM2-135M by default, its real tokenizer) serves every configuration:
for each workload (snugkv.bench.speculative_workloads: code edit, summarization, multi-turn chat,
open generation) and batch, the same greedy requests run once without speculation and once per
proposer and draft length `k`, `--repeats` times in turn, each round in a rotated order (`rotated`:
no configuration always runs first; the fastest pass of each counts: a shared CPU is noisy). Before
each pass the prefix cache is emptied and the scheduler gets a fresh `Speculation` of that
configuration (or none): no pass inherits another's suffix store or cache. The engine starts with
speculation on at the largest `k` (with the first draft model asked for, if any), so its start-up
sizing counts the verify step (and the draft steps) as a speculating server's would.

A row: `acceptance` (accepted / drafted tokens), `mean_accepted_length` (tokens a drafted row emits
per verify step), `tok_per_s` (output tokens over the pass's wall time, prefill included),
`speedup` over the plain pass (`device_speedup`: the same over the device time of the passes' steps,
free of the host's and the clock's noise; `speedup_median`: the median over the `repeats` rounds of
the pass's speedup over the same round's plain pass), the median device time of the plain pass's decode steps and of the
speculating pass's verify steps (`Scheduler.times`) and their ratio (`verify_over_decode`), and `same_tokens`: whether every output equals
the plain pass's token for token (greedy speculation must; each mismatch is printed). A batch above
`--speculative-max-batch-size` does not speculate (the engine's back-off): its rows show 0 verify
steps. Multi-turn chat re-sends each conversation's history with the model's own replies in it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snugkv.bench.model_configs import benchmark_model
from snugkv.bench.speculative_workloads import WORKLOADS, Conversation, batch_of, waves_of

PROPOSERS = ("ngram", "suffix")  # the default; "draft:SPEC" (SPEC: layers:N or self) is taken too
DRAFT_PREFIX = "draft:"


def proposer(value: str) -> str:
    """A `--proposers` value: ngram, suffix or draft:SPEC (`--draft-model SPEC`)."""
    if value not in PROPOSERS and not value.startswith(DRAFT_PREFIX):
        raise argparse.ArgumentTypeError(f"{value!r} is not ngram, suffix or draft:SPEC (layers:N or self)")
    try:
        config = speculative_config(value, num_tokens=1, max_batch_size=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if config.separate_draft:
        raise argparse.ArgumentTypeError(
            f"{value}: a separate draft model is not in this bench yet (it runs beside every step of the "
            "engine that holds it, plain runs included, so the baseline would pay for it); use "
            "draft:layers:N or draft:self"
        )
    return value


def speculative_config(
    proposer: str, *, num_tokens: int, max_batch_size: int, break_even: float | None = None
) -> Any:
    """The `SpeculativeConfig` of a `--proposers` value."""
    from snugkv.speculative.config import SpeculativeConfig

    method, _, draft_model = proposer.partition(":")
    return SpeculativeConfig(
        method,
        num_tokens=num_tokens,
        max_batch_size=max_batch_size,
        draft_model=draft_model or None,
        break_even=break_even,
    )


def _rounds(value: str) -> int:
    """`--repeats`: a whole number of rounds, 1 or more (each configuration's passes)."""
    try:
        rounds = int(value)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"{value!r} rounds: pass a whole number, 1 or more")
    return rounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M (real weights)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (step costs only)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--tokenizer", default=None, help="a directory with tokenizer.json, for a model without a tokenizer"
    )
    parser.add_argument(
        "--proposers",
        nargs="+",
        type=proposer,
        default=list(PROPOSERS),
        help="ngram, suffix, draft:layers:N, draft:self (default: ngram suffix)",
    )
    parser.add_argument(
        "--k", type=int, nargs="+", default=None, help="draft lengths (default: GPU 2 4 8, CPU 4)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="(default: GPU 1 8 64, CPU 1 8)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output tokens per request and turn (default: GPU 256, CPU 96)",
    )
    parser.add_argument(
        "--repeats", type=_rounds, default=None, help="passes of each configuration (default: GPU 3, CPU 1)"
    )
    parser.add_argument(
        "--speculative-max-batch-size", type=int, default=None, help="(default: the engine's)"
    )
    parser.add_argument(
        "--plain-twice",
        action="store_true",
        help="run the plain pass twice in each round: a row with proposer `plain` whose speedup is "
        "the second plain pass over the first, the spread of the same work timed twice (where "
        "speculation backs off, its rows are that same work)",
    )
    parser.add_argument("--max-total-tokens", type=int, default=None, help="(default: CPU 16384, GPU sized)")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, help="GPU: fewer graphs start faster")
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=None)
    parser.add_argument(
        "--step-costs",
        action="store_true",
        help="only the device time of a plain decode step and of a verify step per batch and k, at "
        "--context tokens a row (no proposer, no text: any weights do)",
    )
    parser.add_argument("--context", type=int, default=1024, help="--step-costs: tokens cached per row")
    parser.add_argument(
        "--eagle",
        type=benchmark_model,
        default=None,
        metavar="HEAD",
        help="--step-costs with an EAGLE-3 head (a directory, or llama-3-8b-eagle3: the shipped 8B-shaped "
        "head, random weights under --load-format dummy): its k draft steps timed too, and every step "
        "with the head's pass after the forward",
    )
    parser.add_argument(
        "--force-text",
        action="store_true",
        help="--replay on random weights: every greedy choice is the trace's token (the steps run as "
        "ever); needed in bf16, where a verify and a decode step round random weights' near ties apart",
    )
    parser.add_argument(
        "--host-ms",
        type=float,
        default=0.7,
        help="--bound: the host's work after a verify step, for the engine's back-off replayed over "
        "the text (policy_* columns; 0.65-0.75 ms on a stub device since 07a4cb7)",
    )
    parser.add_argument(
        "--break-even",
        type=float,
        default=None,
        help="fix the accepted tokens a verify step must average to pay (default: measured from the "
        "engine's step times, as in serving; fixed, passes with the same outputs take the same steps)",
    )
    parser.add_argument(
        "--bound",
        action="store_true",
        help="the most the proposers could give on this model's text (every position proposed, no "
        "host time; step costs measured at batch 1) and the outputs as a trace for --replay",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="TRACE",
        help="run a --bound trace's prompts with its text's acceptance mapped onto this model's own "
        "greedy tokens (e.g. the 8B shape's steps with SmolLM2's acceptance)",
    )


@dataclass(frozen=True, slots=True)
class Setting:
    """One configuration of a pass: no speculation (`proposer` None) or a proposer and its `k`;
    `again`: the plain pass a second time (`--plain-twice`), whose row is the run's A/A noise."""

    proposer: str | None
    k: int
    again: bool = False


PLAIN_AGAIN = Setting(None, 0, again=True)


def settings_of(proposers: list[str], ks: list[int], plain_twice: bool) -> list[Setting]:
    """The passes of a workload and batch, in the order they run: plain first (the baseline), the
    plain pass again with `--plain-twice`, then every proposer and k."""
    again = [PLAIN_AGAIN] if plain_twice else []
    return [Setting(None, 0), *again, *(Setting(p, k) for p in proposers for k in ks)]


@dataclass(slots=True)
class Pass:
    """What one pass of a workload produced and took."""

    token_ids: list[list[int]]  # per conversation and turn, in order
    seconds: float
    drafted: int
    accepted: int
    drafted_rows: int
    decode_step_s: list[float]
    verify_step_s: list[float]
    guesses: int = 0  # drafts made behind a step in flight whose guess was read
    guesses_held: int = 0
    reads_first: int = 0  # steps that read the step in flight first (poor guesses)
    device_s: float = 0.0  # the device time of every step of the pass (CUDA events around each)
    idle_s: float = 0.0  # the device's idle time between the pass's steps (the host's share)
    idle_after_verify_s: float = 0.0  # of which before a step that follows a verify step
    draft_host_s: float = 0.0  # the host's time drafting (`Speculation.drafts`), all steps
    ahead_host_s: float = 0.0  # the host's time building drafters behind steps in flight (`build_ahead`)

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


def rotated(settings: Sequence[Setting], repeat: int) -> list[Setting]:
    """The order repeat `repeat` runs `settings` in: turned left by `repeat` places, so that each
    setting runs first in some repeat (the ratios still take `settings[0]`, plain, as the baseline)."""
    if not settings:
        return []
    at = repeat % len(settings)
    return [*settings[at:], *settings[:at]]


def measure_rounds(
    settings: Sequence[Setting], repeats: int, measure: Callable[[Setting], Pass]
) -> dict[Setting, list[Pass]]:
    """Each setting's passes from `repeats` rounds of `measure` over every setting, each round in its
    `rotated` order; a setting's list is in round order, so that index r of two lists is one round."""
    passes: dict[Setting, list[Pass]] = {setting: [] for setting in settings}
    for repeat in range(repeats):
        for setting in rotated(settings, repeat):
            passes[setting].append(measure(setting))
    return passes


def fastest(passes: Sequence[Pass]) -> Pass:
    """The pass that took the fewest seconds (the first of equals)."""
    return min(passes, key=lambda done: done.seconds)


def speedup_median(passes: Sequence[Pass], plain: Sequence[Pass]) -> float:
    """The median over rounds of a pass's tokens/s over the plain pass's of the same round (plain
    seconds over the pass's where both emit as many tokens): paired, so a round that is slow for
    both cancels out."""
    if len(passes) != len(plain) or not passes:
        raise ValueError(f"{len(passes)} passes against {len(plain)} plain passes: rounds must pair")
    return statistics.median(
        (done.output_tokens / done.seconds) / (base.output_tokens / base.seconds)
        for done, base in zip(passes, plain)
    )


def repeat_columns(passes: Sequence[Pass], plain: Sequence[Pass]) -> dict[str, Any]:
    """A row's columns over all of its rounds (the rest of `_row` reads the fastest passes)."""
    return {"speedup_median": speedup_median(passes, plain), "repeats": len(passes)}


def run(args: argparse.Namespace) -> int:
    import torch

    from snugkv.bench.harness import emit
    from snugkv.llm import LLM

    gpu = torch.cuda.is_available()
    ks = args.k or ([2, 4, 8] if gpu else [4])
    batches = args.batch or ([1, 8, 64] if gpu else [1, 8])
    max_tokens = args.max_tokens or (256 if gpu else 96)
    repeats = args.repeats or (3 if gpu else 1)
    first = next((p for p in args.proposers if p.startswith(DRAFT_PREFIX)), args.proposers[0])
    method, _, draft_model = first.partition(":")
    options: dict[str, Any] = {
        "load_format": args.load_format,
        "speculative": method,
        "draft_model": draft_model or None,
        "num_speculative_tokens": max(ks),
        "max_running_requests": max(batches),
    }
    for name in ("dtype", "speculative_max_batch_size", "cuda_graph_max_bs", "prefill_graph_max_tokens"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    max_total_tokens = args.max_total_tokens or (None if gpu else 16384)
    if max_total_tokens is not None:
        options["max_total_tokens"] = max_total_tokens
    settings = settings_of(args.proposers, ks, args.plain_twice)
    rows: list[dict[str, Any]] = []
    mismatches = 0
    if args.eagle is not None and not args.step_costs:
        raise SystemExit("--eagle goes with --step-costs (this bench runs no EAGLE-3 head over text yet)")
    if args.step_costs:
        if args.eagle is not None:
            options.update(speculative="eagle", draft_model=args.eagle)
        with LLM(args.model, **options) as llm:
            rows = [_step_cost(llm, batch, k, args.context) for batch in batches for k in ks]
        extra = {"model": args.model, "load_format": args.load_format, "eagle": args.eagle}
        emit("speculative_steps", rows, args.out, extra)
        return 0
    if args.bound or args.replay is not None:
        from snugkv.bench import speculative_replay

        with LLM(args.model, **options) as llm:
            if args.bound:
                return speculative_replay.run_bound(llm, args, ks, max_tokens)
            return speculative_replay.run_replay(llm, args, ks, batches, repeats)
    with LLM(args.model, **options) as llm:
        encoder = _tokenizer(llm, args.tokenizer)
        speculative = llm.engine.args.speculative
        assert speculative is not None  # the engine starts with speculation on
        max_batch_size = speculative.max_batch_size
        _measure(llm, encoder, [batch_of("open", 1)], None, 4)  # warm: first calls, allocator
        for workload in args.workloads:
            for batch in batches:
                waves = waves_of(workload, batch)

                def measure(setting: Setting, waves: list[list[Conversation]] = waves) -> Pass:
                    return _measure(llm, encoder, waves, setting, max_tokens, max_batch_size, args.break_even)

                passes = measure_rounds(settings, repeats, measure)
                plain = fastest(passes[settings[0]])
                for setting in settings[1:]:
                    done = fastest(passes[setting])
                    row = {
                        **_row(workload, batch, setting, done, plain),
                        **repeat_columns(passes[setting], passes[settings[0]]),
                    }
                    if not row["same_tokens"]:
                        mismatches += 1
                        print(f"MISMATCH: {_where(row)}: {_first_difference(plain, done)}", file=sys.stderr)
                    rows.append(row)
                    print(json.dumps(row), flush=True)  # a run cut short keeps its finished rows
    print(f"greedy outputs differing from plain decoding: {mismatches} of {len(rows)} rows")
    extra = {
        "max_tokens": max_tokens,
        "repeats": repeats,
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "load_format": args.load_format,
        "speculative_max_batch_size": max_batch_size,
        "mismatches": mismatches,
    }
    emit("speculative", rows, args.out, extra)
    return 1 if mismatches else 0


STEP_COST_ITERATIONS = 30


def _step_cost(llm: Any, batch: int, k: int, context: int) -> dict[str, Any]:
    """Median device time of a plain decode step (forward + greedy sampling) and of a verify step
    (forward over the last token and `k` draft tokens a row + verification), `batch` rows of
    `context` cached tokens each, as the scheduler launches them (graphs where they hold the batch)."""
    from snugkv.core.forward import BatchRow
    from snugkv.core.sampling import SamplingParams
    from snugkv.runner.draft_steps import DraftRow

    runner = llm.engine.runner
    table = runner.req_to_token_pool
    greedy = [SamplingParams(temperature=0.0)] * batch
    rows: list[int] = []
    held: dict[int, int] = {}  # slots each row holds, to give back
    try:
        for _ in range(batch):  # one prompt at a time: a step of batch * context tokens may not fit
            row = table.alloc()
            if row is None:
                raise RuntimeError(f"no {batch} free request rows for --step-costs")
            rows.append(row)
            held[row] = 0
            prompt = [BatchRow(row, 0, [(7 * row + j) % 1000 + 10 for j in range(context)])]
            slots = runner.allocate_slots(prompt)
            if slots is None:
                raise RuntimeError("the KV cache has no room for --step-costs' rows")
            held[row] = context
            runner.forward(prompt, slots)
        decode = [BatchRow(row, context, [11]) for row in rows]
        verify = [BatchRow(row, context, [11, *range(12, 12 + k)], draft_len=k) for row in rows]
        verify_slots = runner.allocate_slots(verify)
        if verify_slots is None:
            raise RuntimeError("the KV cache has no room for --step-costs' rows")
        held = dict.fromkeys(rows, context + k + 1)
        decode_slots = verify_slots[:: k + 1]  # each row's first verify position is its decode position

        def plain() -> None:
            logits = runner.forward(decode, decode_slots)
            runner.sample_on_device(logits, greedy, None, rows)

        def verified() -> None:
            logits = runner.forward(verify, verify_slots)
            runner.verify_on_device(logits, [row.token_ids[1:] for row in verify], greedy, None, rows)

        decode_ms, verify_ms = _device_ms(plain), _device_ms(verified)
        draft_ms = None
        if runner.eagle is not None:  # the head's k draft steps into the verify step's slots
            drafts = [DraftRow(row, context, 11, k) for row in rows]
            draft_ms = _device_ms(lambda: runner.draft_on_device(drafts, greedy, None, 1, separate=True))
    finally:
        for row in rows:
            runner.free_request_slots(row, held[row])
            table.free(row)
    return {
        "batch": batch,
        "k": k,
        "context": context,
        "decode_step_ms": decode_ms,
        "verify_step_ms": verify_ms,
        "verify_over_decode": verify_ms / decode_ms,
        "draft_steps_ms": draft_ms,  # EAGLE-3: k draft steps (None without a head)
        "speculating_over_decode": None if draft_ms is None else (draft_ms + verify_ms) / decode_ms,
        "decode_graph": runner.cuda_graphs is not None
        and runner.cuda_graphs.can_run(runner.build_batch(decode, decode_slots)),
        "verify_graph": runner.cuda_graphs is not None
        and runner.cuda_graphs.can_run(runner.build_batch(verify, verify_slots)),
    }


def _device_ms(step: Any) -> float:
    """Median milliseconds of `step()`: CUDA events on a GPU (`harness.time_cuda`), the host clock on a CPU."""
    import torch

    from snugkv.bench.harness import time_cuda

    if torch.cuda.is_available():
        return time_cuda(step, iterations=STEP_COST_ITERATIONS, warmup=3) * 1e3
    for _ in range(3):
        step()
    times = []
    for _ in range(STEP_COST_ITERATIONS):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _tokenizer(llm: Any, directory: str | None) -> Any:
    """The model's tokenizer, or the one in `directory` for a model without one (random weights)."""
    if llm.tokenizer is not None:
        return llm.tokenizer
    if directory is None:
        raise SystemExit(
            "error: this model has no tokenizer; pass --tokenizer DIR (a directory with tokenizer.json)"
        )
    from snugkv.models.loader import ModelSource
    from snugkv.models.tokenizer import load_tokenizer

    return load_tokenizer(ModelSource(Path(directory), "hf"))


def _measure(
    llm: Any,
    encoder: Any,
    waves: list[list[Conversation]],
    setting: Setting | None,
    max_tokens: int,
    max_batch_size: int = 1,
    break_even: float | None = None,
) -> Pass:
    """One pass: each wave of conversations after the one before, every turn of a wave's
    conversations (their turn t in one batch), greedy, from an empty prefix cache and a fresh
    speculation state of `setting` (None or no proposer: plain decoding)."""
    from snugkv.core.sampling import SamplingParams
    from snugkv.scheduler.speculation import Speculation

    speculation = None
    if setting is not None and setting.proposer is not None:
        config = speculative_config(
            setting.proposer, num_tokens=setting.k, max_batch_size=max_batch_size, break_even=break_even
        )
        speculation = Speculation(config)
    params = SamplingParams(max_tokens=max_tokens)

    def turns() -> tuple[list[list[int]], float]:
        token_ids: list[list[int]] = []
        seconds = 0.0
        for conversations in waves:
            histories: list[list[dict[str, str]]] = [[] for _ in conversations]
            for turn in range(max(len(c.turns) for c in conversations)):
                active = [i for i, c in enumerate(conversations) if turn < len(c.turns)]
                for i in active:
                    histories[i].append({"role": "user", "content": conversations[i].turns[turn]})
                prompts = [encoder.encode_chat(histories[i], add_generation_prompt=True) for i in active]
                started = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds += time.perf_counter() - started
                for i, output in zip(active, outputs):
                    ids = list(output.outputs[0].token_ids)
                    token_ids.append(ids)
                    histories[i].append({"role": "assistant", "content": encoder.decode(ids)})
        return token_ids, seconds

    return measure_pass(llm, speculation, turns)


def measure_pass(llm: Any, speculation: Any, generate: Callable[[], tuple[list[list[int]], float]]) -> Pass:
    """One pass of `generate` (which returns the outputs' token ids and the seconds it spent in
    `llm.generate`) from an empty prefix cache, with `speculation` (a fresh `Speculation`, or None:
    plain decoding) swapped into the idle scheduler for it."""
    scheduler = llm._runtime.scheduler  # the bench swaps its speculation between passes, while idle
    llm.reset_prefix_cache()
    scheduler.speculation = speculation
    scheduler.times.reset()
    try:
        token_ids, seconds = generate()
    finally:
        scheduler.speculation = None
    counts = speculation.counts if speculation is not None else None
    records = list(scheduler.times.records)
    return Pass(
        token_ids=token_ids,
        seconds=seconds,
        drafted=counts.draft_tokens if counts else 0,
        accepted=counts.accepted_tokens if counts else 0,
        drafted_rows=counts.drafted_rows if counts else 0,
        decode_step_s=[r.busy_s for r in records if r.decode and r.tokens == r.rows],
        verify_step_s=[r.busy_s for r in records if r.decode and r.tokens > r.rows],
        guesses=counts.guesses if counts else 0,
        guesses_held=counts.guesses_held if counts else 0,
        reads_first=counts.reads_first if counts else 0,
        device_s=sum(r.busy_s for r in records),
        draft_host_s=counts.draft_host_s if counts else 0.0,
        ahead_host_s=counts.ahead_host_s if counts else 0.0,
        idle_s=sum(r.gap_s or 0.0 for r in records),
        idle_after_verify_s=sum(
            after.gap_s or 0.0
            for before, after in itertools.pairwise(records)
            if before.decode and before.tokens > before.rows
        ),
    )


def _device_speedup(done: Pass, plain: Pass) -> float | None:
    """Device seconds per output token of the plain pass over the pass's (None without step times)."""
    if not (done.device_s and plain.device_s and done.output_tokens and plain.output_tokens):
        return None
    return (plain.device_s / plain.output_tokens) / (done.device_s / done.output_tokens)


def _row(workload: str, batch: int, setting: Setting, done: Pass, plain: Pass) -> dict[str, Any]:
    tok_per_s = done.output_tokens / done.seconds
    plain_tok_per_s = plain.output_tokens / plain.seconds
    decode_ms, verify_ms = _median_ms(plain.decode_step_s), _median_ms(done.verify_step_s)
    return {
        "proposer": "plain" if setting.again else setting.proposer,
        "workload": workload,
        "batch": batch,
        "k": setting.k,
        "acceptance": done.accepted / done.drafted if done.drafted else 0.0,
        "mean_accepted_length": 1 + done.accepted / done.drafted_rows if done.drafted_rows else 0.0,
        "tok_per_s": tok_per_s,
        "plain_tok_per_s": plain_tok_per_s,
        "speedup": tok_per_s / plain_tok_per_s,
        # the same over the device time of the passes' steps alone (no host, no wall-clock noise)
        "device_speedup": _device_speedup(done, plain),
        "decode_step_ms": decode_ms,
        "verify_step_ms": verify_ms,
        # issue 34's step target: a verify step of k drafts against a plain decode step, same batch
        "verify_over_decode": verify_ms / decode_ms if verify_ms and decode_ms else None,
        "verify_steps": len(done.verify_step_s),
        "plain_steps": len(done.decode_step_s),
        # drafts made behind a step in flight: how often the guess of its token held
        "guess_rate": done.guesses_held / done.guesses if done.guesses else None,
        "reads_first": done.reads_first,
        # the device's idle time between steps, this pass's and the plain pass's: where a pass that
        # saves device time loses wall time, the host's share shows here
        "idle_ms": done.idle_s * 1e3,
        "plain_idle_ms": plain.idle_s * 1e3,
        "idle_after_verify_ms": done.idle_after_verify_s * 1e3,
        "draft_host_ms": done.draft_host_s * 1e3,
        "ahead_host_ms": done.ahead_host_s * 1e3,
        "output_tokens": done.output_tokens,
        "same_tokens": done.token_ids == plain.token_ids,
    }


def _median_ms(seconds: list[float]) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


def _where(row: dict[str, Any]) -> str:
    return f"{row['workload']} batch {row['batch']} {row['proposer']} k={row['k']}"


def _first_difference(plain: Pass, done: Pass) -> str:
    for index, (want, got) in enumerate(zip(plain.token_ids, done.token_ids)):
        if want != got:
            at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            return f"output {index} differs at token {at} (plain {want[at : at + 4]}, speculative {got[at : at + 4]})"
    return f"{len(plain.token_ids)} outputs plain, {len(done.token_ids)} speculative"
