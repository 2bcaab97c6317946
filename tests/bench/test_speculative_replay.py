"""`snugkv bench speculative --bound` and `--replay`: the oracle-judged steps over a text, the bound
from step costs, the mapping of a trace's acceptance onto another model's tokens, and (slow) a
replay of the embedded model's own trace keeping exactly what its real proposers keep."""

from __future__ import annotations

import json

import pytest

from snugkv.bench.speculative_replay import (
    BoundSteps,
    ReplayProposer,
    TraceItem,
    bound_steps,
    policy_steps,
    read_trace,
    write_trace,
)
from snugkv.speculative.config import SpeculativeConfig

COPYABLE = TraceItem("code-edit", (1, 2, 3, 4, 5, 6, 1, 2), (3, 4, 5, 6, 7))  # "1 2" occurred: 3 4 5 6 follow
NOVEL = TraceItem("open", (9, 8), (7, 6))  # nothing to copy


def test_the_bound_takes_one_token_a_plain_step_and_the_kept_ones_plus_one_a_verify_step():
    steps = bound_steps([COPYABLE, NOVEL], "ngram", 4)
    # COPYABLE: one verify step keeps 3 4 5 6 (capped at the 4 tokens before the last) and emits 7;
    # NOVEL: no match, then no room: two plain steps
    assert steps == BoundSteps(plain_steps=2, verify_steps=1, accepted_tokens=4, output_tokens=7)
    assert steps.speedup(decode_ms=1.0, verify_ms=2.0) == pytest.approx(7 / (2 * 1.0 + 1 * 2.0))
    assert bound_steps([NOVEL], "suffix", 4).verify_steps == 0


def test_the_policy_steps_follow_the_engines_overlap_and_back_off():
    # COPYABLE's first token comes from the prefill step and is in flight: the first decode step
    # drafts on the guess 4 of it (after "1 2 3"), room 3 (the last token can't be drafted): 5 6 7
    # kept, then one token left. The same with a poorly guessing row reads it first.
    config = SpeculativeConfig("ngram", num_tokens=4, break_even=0.5)
    steps = policy_steps([COPYABLE], config)
    assert (steps.plain_steps, steps.verify_steps, steps.accepted_tokens, steps.output_tokens) == (0, 1, 3, 5)
    assert (steps.guesses, steps.guesses_held, steps.reads_first) == (1, 1, 0)
    novel = policy_steps([NOVEL], config)
    assert (novel.plain_steps, novel.verify_steps, novel.guesses) == (1, 0, 0)
    assert steps.speedup_with_host(decode_ms=1.0, verify_ms=2.0, host_ms=0.5) == pytest.approx(5 / 2.5)


def test_a_draft_the_trace_keeps_becomes_this_models_tokens_and_the_rest_tokens_it_does_not_emit():
    item = TraceItem("code-edit", COPYABLE.prompt_ids, (3, 4, 9, 6, 7))  # the trace's model wrote 9, not 5
    own = [30, 40, 50, 60, 70]
    proposer = ReplayProposer("ngram", item, own, None)
    assert proposer.num_tokens == len(item.prompt_ids)
    draft = proposer.propose(4)  # the trace's draft is 3 4 5 6: position 2 disagrees with the trace
    assert draft[:2] == [30, 40] and draft[2] != 50 and draft[3] == 60
    proposer.extend([30, 40, 51])
    assert proposer.num_tokens == len(item.prompt_ids) + 3
    assert proposer.propose(4) == []  # the trace's "4 9" occurred nowhere before


def test_a_trace_is_written_and_read_back_and_another_json_is_refused(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(path, [COPYABLE, NOVEL], {"model": "m"})
    items, env = read_trace(path)
    assert items == [COPYABLE, NOVEL] and env == {"model": "m"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "speculative", "rows": []}))
    with pytest.raises(SystemExit, match="not a trace"):
        read_trace(other)


def bench(*flags: str) -> int:
    from snugkv.cli import main

    return main(["--log-level", "WARNING", "bench", "speculative", *flags])


@pytest.mark.slow
def test_replaying_the_models_own_trace_keeps_what_its_real_proposers_keep(tmp_path):
    """The embedded SmolLM2's trace replayed onto itself: every mapped draft token is the real
    proposer's (its own tokens are the trace's), so drafts, kept tokens and verify steps are the
    real bench's, with rows drafting behind a step in flight (batch 1)."""
    # the back-off fixed: measured step times would make the two runs' pauses differ
    common = ["--k", "4", "--batch", "1", "--workloads", "code-edit", "--proposers", "ngram", "suffix"]
    common += ["--break-even", "0.5"]
    assert bench("--bound", "--max-tokens", "16", *common, "--out", str(tmp_path / "trace")) == 0
    bound = json.loads((tmp_path / "trace" / "speculative_bound.json").read_text())["rows"]
    assert {r["proposer"] for r in bound} == {"ngram", "suffix"}
    assert all(r["bound_speedup"] > 0 for r in bound)
    trace = tmp_path / "trace" / "speculative-trace.json"
    assert bench("--replay", str(trace), *common, "--out", str(tmp_path / "replay")) == 0
    assert bench("--max-tokens", "16", *common, "--out", str(tmp_path / "real")) == 0
    replayed = json.loads((tmp_path / "replay" / "speculative_replay.json").read_text())["rows"]
    real = json.loads((tmp_path / "real" / "speculative.json").read_text())["rows"]
    keys = ("proposer", "batch", "k", "acceptance", "mean_accepted_length", "verify_steps", "output_tokens")
    assert [{k: r[k] for k in keys} for r in replayed] == [{k: r[k] for k in keys} for r in real]
    assert all(r["same_tokens"] for r in replayed) and any(r["acceptance"] > 0 for r in replayed)
    # the engine's steps over the trace's texts one after another (batch 1), replayed off the
    # engine, are the real bench's
    texts = [item for item in read_trace(trace)[0] if item.workload == "code-edit"]
    assert len(texts) > 1
    for row in real:
        steps = policy_steps(texts, SpeculativeConfig(row["proposer"], num_tokens=4, break_even=0.5))
        accepted = round((row["mean_accepted_length"] - 1) * row["verify_steps"])
        assert (steps.verify_steps, steps.accepted_tokens) == (row["verify_steps"], accepted)
        assert steps.reads_first == row["reads_first"] and steps.output_tokens == row["output_tokens"]


def test_a_forced_replay_emits_the_traces_text_in_the_steps_the_policy_predicts(tmp_path):
    """`--force-text` on random weights (bf16, where a random model's own greedy text would not hold
    between verify and decode steps): both passes emit the trace's text token for token, and the
    speculating pass takes the verify steps `policy_steps` predicts for it."""
    from snugkv.bench.model_configs import write_tiny_llama_config

    repeat = (5, 6, 7, 8, 9, 10, 11, 12)
    items = [
        TraceItem("code-edit", (1, 2, *repeat, 3), (*repeat, 4, *repeat[:5], 13, 14, *repeat)),
        TraceItem("code-edit", (40, 41, 42, 43), (44, 45, 40, 41, 42, 43, 44, 45, 46)),
    ]
    trace = tmp_path / "trace.json"
    write_trace(trace, items, {"model": "made up"})
    model = write_tiny_llama_config(tmp_path, 512, 64)
    common = ["--model", model, "--load-format", "dummy", "--dtype", "bfloat16", "--replay", str(trace)]
    common += ["--k", "4", "--batch", "1", "--proposers", "ngram", "--workloads", "code-edit"]
    common += ["--force-text", "--break-even", "0.5", "--plain-twice", "--out", str(tmp_path / "out")]
    assert bench(*common) == 0
    again, row = json.loads((tmp_path / "out" / "speculative_replay.json").read_text())["rows"]
    # --plain-twice: the plain pass again, its row the same work timed twice
    assert again["proposer"] == "plain" and again["verify_steps"] == 0 and again["same_tokens"]
    assert again["speedup"] > 0 and again["device_speedup"] > 0 and row["proposer"] == "ngram"
    # one round (the CPU's default): the paired median is that round's, the best-of speedup
    assert again["repeats"] == row["repeats"] == 1
    assert row["speedup_median"] == pytest.approx(row["speedup"])
    # batch 1: the workload's items one after another
    assert row["same_tokens"] and row["output_tokens"] == sum(len(i.output_ids) for i in items)
    steps = policy_steps(items, SpeculativeConfig("ngram", num_tokens=4, break_even=0.5))
    assert steps.verify_steps == row["verify_steps"] > 0
    assert steps.accepted_tokens == round((row["mean_accepted_length"] - 1) * row["verify_steps"]) > 0

    # the text itself is the trace's, not the random model's own
    from snugkv import LLM, SamplingParams
    from snugkv.bench.speculative_replay import force_text

    with LLM(model, load_format="dummy", dtype="bfloat16", device="cpu", max_total_tokens=2048) as llm:
        params = [SamplingParams(max_tokens=len(i.output_ids), ignore_eos=True) for i in items]
        prompts = [list(i.prompt_ids) for i in items]
        own = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        force_text(llm, items)
        forced = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert forced == [list(i.output_ids) for i in items] != own
