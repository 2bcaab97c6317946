"""What speculation could give on a model's text, and the same acceptance on another model's steps.

Two parts of `snugkv bench speculative`:

- **The bound** (`--bound`): the model's plain greedy outputs for the single-turn workloads, then,
  off the engine, each proposer asked at every output position (no back-off, no host time): the
  draft's tokens that equal the text's next tokens are the ones verification would keep. With the
  device time of a plain decode step and of a verify step of `k` drafts measured on the same engine
  (batch 1), `bound_speedup = n * decode / (plain_steps * decode + verify_steps * verify)`: the most
  these proposers could give on this model's text if every step's host work hid behind the device.
  Prefill is left out of both sides, so a measured end-to-end ratio can only be lower. The outputs
  are written as a trace (`speculative-trace.json`: prompts and outputs, token ids) for the replay.
  Beside it, the engine's own back-off over the same text (`policy_steps`: the scheduler's overlap
  and `RowDrafter`'s pauses at batch 1, the break-even from the measured steps and `--host-ms`):
  `policy_speedup`, what the engine should reach, so that the bound's gap splits into what the
  back-off leaves and what the host adds. At batch 1 `policy_steps` takes exactly the engine's
  steps (a slow test replays the real bench).

- **The replay** (`--replay TRACE`): any model (the 8B shape with random weights: real step costs
  but no text worth drafting from) runs the trace's prompts (token ids; every id of a smaller
  vocabulary is a valid id of a larger one) once plainly, greedy, to the trace's output lengths,
  which gives the model's own greedy continuation of each prompt. Then each proposer runs in the
  engine as in serving, behind its usual back-off, except that its drafts are mapped: at output
  position `t` the real proposer over the trace's text proposes `d`; each token of `d` that equals
  the trace's token at its position becomes the model's own token there, each other one a token the
  model does not emit there. So a verify step keeps as many tokens as it would have on the trace's
  model at that position, and the wall time is this engine's own: its host work, its
  overlap, this model's steps. What it does not replay: where this model's verify step and decode
  step round a near tie differently, its output leaves the plain pass's, and the mapped drafts are
  then judged against another text (fewer kept; the row's `same_tokens` says so).

Owns neither the engine nor the proposers' rules; never changes what a served request drafts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snugkv.speculative.config import SpeculativeConfig
from snugkv.speculative.ngram import NgramProposer
from snugkv.speculative.suffix import SuffixProposer, SuffixStore

TRACE_WORKLOADS = ("code-edit", "summarize", "open")  # one turn each: a prompt and the model's reply
TRACE_FILE = "speculative-trace.json"


@dataclass(frozen=True, slots=True)
class TraceItem:
    """One request of a trace: its prompt and the trace model's greedy output, token ids."""

    workload: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BoundSteps:
    """The steps an oracle-judged proposer takes over one text: one token a plain step, `accepted + 1`
    a verify step."""

    plain_steps: int
    verify_steps: int
    accepted_tokens: int
    output_tokens: int

    def speedup(self, decode_ms: float, verify_ms: float) -> float:
        """Plain decoding's time over speculation's, steps only (no prefill, no host time)."""
        spent_ms = self.plain_steps * decode_ms + self.verify_steps * verify_ms
        return self.output_tokens * decode_ms / spent_ms if spent_ms else 0.0


def shadow_proposer(method: str, prompt_ids: Sequence[int], store: SuffixStore | None) -> Any:
    if method == "ngram":
        return NgramProposer(token_ids=prompt_ids)
    if method == "suffix":
        return SuffixProposer(prompt_ids, store.config if store else None, store)
    raise ValueError(f"the bound and the replay take the host proposers (ngram, suffix), not {method!r}")


def propose(proposer: Any, k: int) -> list[int]:
    if isinstance(proposer, SuffixProposer):
        return list(proposer.propose(k).token_ids)
    return list(proposer.propose(k))


def kept(draft: Sequence[int], text: Sequence[int], at: int) -> int:
    """How many leading tokens of `draft` equal `text` from position `at` on."""
    count = 0
    while count < len(draft) and at + count < len(text) and draft[count] == text[at + count]:
        count += 1
    return count


def bound_steps(items: Iterable[TraceItem], method: str, k: int) -> BoundSteps:
    """The proposer asked at every output position of every item, in order (a suffix store shared
    and fed each finished output, as the engine's is); each draft capped to the tokens left."""
    store = SuffixStore() if method == "suffix" else None
    plain = verify = accepted = total = 0
    for item in items:
        proposer = shadow_proposer(method, item.prompt_ids, store)
        output = item.output_ids
        at = 0
        while at < len(output):
            draft = propose(proposer, min(k, len(output) - at - 1))
            if draft:
                keep = kept(draft, output, at)
                verify += 1
                accepted += keep
                emitted = keep + 1
            else:
                plain += 1
                emitted = 1
            proposer.extend(output[at : at + emitted])
            at += emitted
        if isinstance(proposer, SuffixProposer):
            proposer.finish()
        total += len(output)
    return BoundSteps(plain, verify, accepted, total)


@dataclass(frozen=True, slots=True)
class PolicySteps(BoundSteps):
    """The steps a row takes over one text under the engine's own back-off at batch 1, overlapped as
    the scheduler runs it: `reads_first` of the verify steps waited for the step before them
    (poor guesses), `guesses` drafts rode on a guess of the token in flight, `guesses_held` held."""

    reads_first: int = 0
    guesses: int = 0
    guesses_held: int = 0

    def speedup_with_host(self, decode_ms: float, verify_ms: float, host_ms: float) -> float:
        """As `speedup`, with `host_ms` of host work showing before every step that follows a verify
        step or reads first (a plain step's hides behind the device)."""
        spent_ms = (
            self.plain_steps * decode_ms
            + self.verify_steps * (verify_ms + host_ms)
            + self.reads_first * host_ms
        )
        return self.output_tokens * decode_ms / spent_ms if spent_ms else 0.0


def policy_steps(items: Iterable[TraceItem], config: SpeculativeConfig) -> PolicySteps:
    """Each item's output as the engine emits it at batch 1 with `config`, drafts judged against the
    text: the prefill step's token is in flight when the first decode step is scheduled; a plain
    step's token stays in flight while the next step drafts (on a guess of it, `RowDrafter.propose`'s
    `unread`, or after reading it where the row guesses poorly: `Speculation.reads_first`); a verify
    step is read at once. The same `RowDrafter` as the engine's, so its pauses and back-off, with
    `config.break_even` (`DEFAULT_BREAK_EVEN` where None: nothing is timed here)."""
    from snugkv.speculative.config import DEFAULT_BREAK_EVEN
    from snugkv.speculative.drafter import RowDrafter

    break_even = DEFAULT_BREAK_EVEN if config.break_even is None else config.break_even

    store = SuffixStore() if config.method == "suffix" else None
    plain = verify = accepted = total = reads = guesses = held = 0
    for item in items:
        text = list(item.prompt_ids) + list(item.output_ids)
        end = len(text)
        known, in_flight = len(item.prompt_ids) + 1, True  # tokens emitted; the last one unread
        drafter: RowDrafter | None = None
        while known < end:
            room = min(config.num_tokens, end - known - 1)
            if drafter is not None and not drafter.may_draft(known):
                room = 0
            draft: list[int] = []
            if room > 0:
                unread = int(in_flight)
                if drafter is None:
                    drafter = RowDrafter(config, item.prompt_ids, store)  # as the engine's
                    drafter.break_even = break_even
                draft = drafter.propose(text[: known - unread], room, unread)
                if draft and unread and not drafter.guesses_well:
                    reads += 1
                    draft = drafter.propose(text[:known], room)
            if draft:
                keep = kept(draft, text, known)
                known += keep + 1
                drafter.record(len(draft), keep, known)  # type: ignore[union-attr]
                verify += 1
                accepted += keep
                in_flight = False
            else:
                known += 1
                plain += 1
                in_flight = True
        if drafter is not None:
            drafter.read_guess(text)
            guesses += drafter.guesses
            held += drafter.guesses_held
            drafter.finish(text)
        total += len(item.output_ids)
    return PolicySteps(plain, verify, accepted, total, reads, guesses, held)


class ReplayProposer:
    """A row's proposer for the replay: the real proposer over the trace's text, its drafts mapped
    onto this model's own greedy output (`own_ids`) by what the trace's text would have kept."""

    def __init__(
        self, method: str, item: TraceItem, own_ids: Sequence[int], store: SuffixStore | None
    ) -> None:
        self.item = item
        self.own_ids = list(own_ids)
        self.shadow = shadow_proposer(method, item.prompt_ids, store)
        self._num_tokens = len(item.prompt_ids)  # the row's tokens (this model's) seen so far
        self._shadow_at = 0  # output tokens of the trace fed to the shadow proposer

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, token_ids: Iterable[int]) -> None:
        self._num_tokens += sum(1 for _ in token_ids)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens to follow the row's tokens: the trace's draft at this output position,
        token by token this model's own token where the trace's text has the draft's token there, and
        a token this model does not emit there where not. Token by token, not as a prefix: a row
        drafting behind a step in flight drops the draft's first token (its guess of the unread one),
        and the tokens after a wrong guess are judged on their own (`RowDrafter.propose`)."""
        at = self._num_tokens - len(self.item.prompt_ids)
        trace, own = self.item.output_ids, self.own_ids
        if at >= min(len(trace), len(own)) or k <= 0:
            return []
        self.shadow.extend(trace[self._shadow_at : at])
        self._shadow_at = max(self._shadow_at, at)
        draft = propose(self.shadow, min(k, len(own) - at))
        mapped = []
        for offset, token in enumerate(draft):
            here = at + offset
            agrees = here < len(trace) and token == trace[here]
            mapped.append(own[here] if agrees else (own[here] - 1 if own[here] else 1))
        return mapped

    def finish(self) -> None:
        if isinstance(self.shadow, SuffixProposer):
            self.shadow.extend(self.item.output_ids[self._shadow_at :])
            self.shadow.finish()


def replay_speculation(
    config: SpeculativeConfig, items: Sequence[TraceItem], own: Sequence[Sequence[int]]
) -> Any:
    """A `Speculation` whose rows draft through `ReplayProposer`s: the row of a request whose prompt
    is `items[i]`'s replays it against `own[i]` (this model's plain greedy output of that prompt)."""
    from snugkv.scheduler.speculation import Speculation
    from snugkv.speculative.drafter import RowDrafter

    by_prompt = {item.prompt_ids: (item, list(ids)) for item, ids in zip(items, own)}
    store = SuffixStore() if config.method == "suffix" else None

    class ReplaySpeculation(Speculation):
        def _drafter(self, request: Any) -> RowDrafter:
            if request.drafter is None:
                item, own_ids = by_prompt[tuple(request.prompt_ids)]
                drafter = RowDrafter(self.config, (), None)
                drafter.proposer = ReplayProposer(config.method, item, own_ids, store)  # type: ignore[assignment]
                request.drafter = drafter
            return request.drafter

        def finish(self, request: Any, reason: str) -> None:
            if request.drafter is not None and isinstance(request.drafter.proposer, ReplayProposer):
                request.drafter.proposer.finish()

    return ReplaySpeculation(config)


def write_trace(path: Path, items: Sequence[TraceItem], environment: dict[str, Any]) -> None:
    path.write_text(
        json.dumps(
            {
                "trace": "speculative",
                "environment": environment,
                "items": [
                    {
                        "workload": i.workload,
                        "prompt_ids": list(i.prompt_ids),
                        "output_ids": list(i.output_ids),
                    }
                    for i in items
                ],
            }
        )
    )


def read_trace(path: Path) -> tuple[list[TraceItem], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    if data.get("trace") != "speculative":
        raise SystemExit(
            f'error: {path} is not a trace of `snugkv bench speculative --bound` (no "trace" key)'
        )
    items = [
        TraceItem(item["workload"], tuple(item["prompt_ids"]), tuple(item["output_ids"]))
        for item in data["items"]
    ]
    return items, data.get("environment", {})


def force_text(llm: Any, items: Sequence[TraceItem]) -> None:
    """Make every greedy choice of `llm`'s engine the trace's token (bench only, random weights):
    after each forward, the logits row that picks the token at position `p` of a request whose
    prompt is a trace item's gets the largest value at that item's token there. The forward, the
    sampling and the verification run as ever, so a step costs what it costs; only the choice is
    the trace's. A random model's own greedy text cannot stand in for it in bf16: a verify step and
    a decode step round its near ties differently (every speculating row of the 8B shape left the
    plain text on an H100 at 593e777, and still did with the token embeddings scaled 256x at
    e0aaee8)."""
    import torch

    from snugkv.core.transfer import to_device

    scheduler = llm._runtime.scheduler  # the bench steers the logits of an engine it loaded at random
    runner = scheduler.runner
    texts = {item.prompt_ids: item.prompt_ids + item.output_ids for item in items}
    forward = runner.forward

    def forced_forward(rows: Sequence[Any], slots: Any) -> Any:
        logits = forward(rows, slots)
        by_row = {r.req_pool_idx: r for r in scheduler.requests.values() if r.req_pool_idx is not None}
        picks: list[int] = []
        tokens: list[int] = []
        offset = 0
        for row in rows:
            count = row.draft_len + 1 if row.need_logits else 0
            request = by_row.get(row.req_pool_idx)
            text = texts.get(tuple(request.prompt_ids)) if request is not None else None
            first = row.prefix_len + len(row.token_ids) - count + 1  # the position the first row picks
            for j in range(count):
                if text is not None and first + j < len(text):
                    picks.append(offset + j)
                    tokens.append(text[first + j])
            offset += count
        if picks:
            with torch.inference_mode():  # the forward's logits are an inference tensor
                index = to_device(picks, torch.int64, logits.device)
                logits[index, to_device(tokens, torch.int64, logits.device)] = torch.finfo(logits.dtype).max
        return logits

    runner.forward = forced_forward


def run_bound(llm: Any, args: Any, ks: Sequence[int], max_tokens: int) -> int:
    """`--bound`: the plain greedy outputs of the single-turn workloads, each proposer's steps over
    them, and the bound from this engine's step costs at batch 1; the outputs go to the trace."""
    from snugkv.bench.harness import emit, environment
    from snugkv.bench.speculative import PROPOSERS, _step_cost, _tokenizer
    from snugkv.bench.speculative_workloads import WORKLOADS
    from snugkv.core.sampling import SamplingParams

    encoder = _tokenizer(llm, args.tokenizer)
    workloads = [w for w in args.workloads if w in TRACE_WORKLOADS]
    items: list[TraceItem] = []
    for workload in workloads:
        prompts = [
            encoder.encode_chat([{"role": "user", "content": c.turns[0]}], add_generation_prompt=True)
            for c in WORKLOADS[workload]
        ]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
        items += [
            TraceItem(workload, tuple(p), tuple(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs)
        ]
    context = round(sum(len(i.prompt_ids) for i in items) / len(items))
    costs = {k: _step_cost(llm, 1, k, context) for k in ks}
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        mine = [i for i in items if i.workload == workload]
        for method in [p for p in args.proposers if p in PROPOSERS]:
            for k in ks:
                steps = bound_steps(mine, method, k)
                decode_ms, verify_ms = costs[k]["decode_step_ms"], costs[k]["verify_step_ms"]
                host_ms = args.host_ms
                break_even = max(0.0, (verify_ms + host_ms - decode_ms) / decode_ms)
                policy = policy_steps(mine, SpeculativeConfig(method, num_tokens=k, break_even=break_even))
                rows.append(
                    {
                        "proposer": method,
                        "workload": workload,
                        "batch": 1,
                        "k": k,
                        "output_tokens": steps.output_tokens,
                        "plain_steps": steps.plain_steps,
                        "verify_steps": steps.verify_steps,
                        "accepted_tokens": steps.accepted_tokens,
                        "mean_accepted_length": 1 + steps.accepted_tokens / steps.verify_steps
                        if steps.verify_steps
                        else 0.0,
                        "decode_step_ms": decode_ms,
                        "verify_step_ms": verify_ms,
                        "bound_speedup": steps.speedup(decode_ms, verify_ms),
                        # the engine's back-off over the same text at this break-even (host_ms of
                        # host work after each verify step)
                        "host_ms": host_ms,
                        "break_even": break_even,
                        "policy_plain_steps": policy.plain_steps,
                        "policy_verify_steps": policy.verify_steps,
                        "policy_speedup": policy.speedup_with_host(decode_ms, verify_ms, host_ms),
                    }
                )
    env = environment()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_trace(
            Path(args.out) / TRACE_FILE, items, {**env, "model": args.model or "SmolLM2-135M-Instruct"}
        )
    emit(
        "speculative_bound",
        rows,
        args.out,
        {"model": args.model, "context": context, "max_tokens": max_tokens},
    )
    return 0


def run_replay(llm: Any, args: Any, ks: Sequence[int], batches: Sequence[int], repeats: int) -> int:
    """`--replay TRACE`: per workload and batch, the trace's prompts plainly (this model's own greedy
    outputs, to the trace's lengths), then `repeats` rounds (`measure_rounds`) of the plain pass and
    each host proposer and `k` with the trace's acceptance mapped onto those outputs; rows as the
    bench's, with `replay_of` naming the trace's model."""
    from snugkv.bench.harness import emit
    from snugkv.bench.speculative import (
        PROPOSERS,
        Pass,
        Setting,
        _row,
        fastest,
        measure_pass,
        measure_rounds,
        repeat_columns,
        settings_of,
        speculative_config,
    )
    from snugkv.bench.speculative_workloads import waves
    from snugkv.core.sampling import SamplingParams

    items, trace_env = read_trace(args.replay)
    if args.force_text:
        force_text(llm, items)
    speculative = llm.engine.args.speculative
    max_batch_size = speculative.max_batch_size if speculative is not None else 32
    methods = [p for p in args.proposers if p in PROPOSERS]
    rows: list[dict[str, Any]] = []
    for workload in [w for w in args.workloads if w in {i.workload for i in items}]:
        mine = [i for i in items if i.workload == workload]
        for batch in batches:
            # Batch 1: every item of the workload, one request after another (as `policy_steps`
            # replays them); a larger batch: that many requests at once, the items in turn.
            item_waves = waves(mine, batch)
            requests = [item for wave in item_waves for item in wave]

            def generate(item_waves: list[list[TraceItem]] = item_waves) -> Any:
                token_ids: list[list[int]] = []
                seconds = 0.0
                for wave in item_waves:
                    prompts = [list(i.prompt_ids) for i in wave]
                    params = [SamplingParams(max_tokens=len(i.output_ids), ignore_eos=True) for i in wave]
                    started = time.perf_counter()
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                    seconds += time.perf_counter() - started
                    token_ids += [list(o.outputs[0].token_ids) for o in outputs]
                return token_ids, seconds

            own = measure_pass(llm, None, generate).token_ids  # this model's greedy continuations
            settings = settings_of(methods, list(ks), args.plain_twice)

            def measure(
                setting: Setting,
                requests: list[TraceItem] = requests,
                own: list[list[int]] = own,
                generate: Any = generate,
            ) -> Pass:
                speculation = None
                if setting.proposer is not None:
                    config = speculative_config(
                        setting.proposer,
                        num_tokens=setting.k,
                        max_batch_size=max_batch_size,
                        break_even=args.break_even,
                    )
                    speculation = replay_speculation(config, requests, own)
                return measure_pass(llm, speculation, generate)

            passes = measure_rounds(settings, repeats, measure)
            plain = fastest(passes[settings[0]])
            for setting in settings[1:]:
                row = {
                    **_row(workload, batch, setting, fastest(passes[setting]), plain),
                    **repeat_columns(passes[setting], passes[settings[0]]),
                    "replay_of": trace_env.get("model"),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    emit(
        "speculative_replay",
        rows,
        args.out,
        {
            "model": args.model,
            "load_format": args.load_format,
            "trace": str(args.replay),
            "trace_environment": trace_env,
        },
    )
    return 0
