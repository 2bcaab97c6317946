"""`snugkv bench speculative`: the written workloads, a row's arithmetic and its check against plain
decoding, and (slow) one small run on the embedded SmolLM2 that writes the raw JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from snugkv.bench.speculative import Pass, Setting, _first_difference, _row, measure_pass
from snugkv.bench.speculative_workloads import WORKLOADS, batch_of
from snugkv.scheduler.launched import StepRecord


def passed(token_ids, seconds, drafted=0, accepted=0, drafted_rows=0, verify=(), device_s=0.0):
    return Pass(
        token_ids,
        seconds,
        drafted,
        accepted,
        drafted_rows,
        [0.010, 0.012, 0.014],
        list(verify),
        device_s=device_s,
    )


def test_the_four_workloads_are_there_and_a_batch_cycles_through_each():
    assert list(WORKLOADS) == ["code-edit", "summarize", "chat", "open"]
    assert all(len(c.turns) >= 3 for c in WORKLOADS["chat"])  # history re-sent over several turns
    batch = batch_of("code-edit", 5)
    assert len(batch) == 5 and batch[3] == batch[0] and batch[1] != batch[0]
    assert "```python" in WORKLOADS["code-edit"][0].turns[0]


def test_a_row_reads_acceptance_speedup_and_step_times_against_the_plain_pass():
    plain = passed([[1, 2, 3, 4]], seconds=2.0)
    done = passed([[1, 2, 3, 4]], seconds=1.0, drafted=8, accepted=6, drafted_rows=2, verify=[0.02, 0.03])
    row = _row("code-edit", 1, Setting("ngram", 4), done, plain)
    assert row["acceptance"] == 0.75 and row["mean_accepted_length"] == 4.0
    assert row["speedup"] == 2.0 and row["tok_per_s"] == 4.0
    assert row["decode_step_ms"] == pytest.approx(12.0) and row["verify_step_ms"] == pytest.approx(25.0)
    assert row["verify_over_decode"] == pytest.approx(25.0 / 12.0)
    assert row["same_tokens"] and row["verify_steps"] == 2


def test_plain_twice_runs_the_plain_pass_again_second_and_its_row_is_the_noise_of_the_same_work():
    from snugkv.bench.speculative import PLAIN_AGAIN, settings_of

    assert settings_of(["ngram"], [2, 4], False) == [
        Setting(None, 0),
        Setting("ngram", 2),
        Setting("ngram", 4),
    ]
    settings = settings_of(["ngram"], [2], True)
    assert settings == [Setting(None, 0), PLAIN_AGAIN, Setting("ngram", 2)] and len(set(settings)) == 3
    plain = passed([[1, 2, 3, 4]], seconds=2.0)
    row = _row("open", 64, PLAIN_AGAIN, passed([[1, 2, 3, 4]], seconds=2.5), plain)
    assert row["proposer"] == "plain" and row["k"] == 0 and row["speedup"] == pytest.approx(0.8)
    assert row["verify_steps"] == 0 and row["same_tokens"] and row["device_speedup"] is None
    # device time per output token: plain 1.0 s for 4 tokens, the pass 1.5 s for 6 (same per token)
    row = _row(
        "open",
        64,
        PLAIN_AGAIN,
        passed([[1, 2, 3, 4, 5, 6]], 2.0, device_s=1.5),
        passed([[1, 2, 3, 4]], 2.0, device_s=1.0),
    )
    assert row["device_speedup"] == pytest.approx(1.0)


def test_each_repeat_rotates_the_settings_so_each_runs_first_in_some_round():
    from snugkv.bench.speculative import PLAIN_AGAIN, measure_rounds, rotated, settings_of

    settings = settings_of(["ngram", "suffix"], [2], True)
    orders = [rotated(settings, r) for r in range(len(settings))]
    assert orders[0] == settings and rotated(settings, len(settings)) == settings
    assert [order[0] for order in orders] == settings  # each setting first once
    assert all(sorted(order, key=settings.index) == settings for order in orders)  # none dropped
    assert rotated(settings, 1) == [PLAIN_AGAIN, Setting("ngram", 2), Setting("suffix", 2), Setting(None, 0)]
    assert rotated([], 3) == []

    calls: list[Setting] = []

    def measure(setting):
        calls.append(setting)
        return passed([[1]], seconds=float(len(calls)))

    passes = measure_rounds(settings[:3], 2, measure)
    assert calls == [*settings[:3], *settings[1:3], settings[0]]
    # a setting's passes in round order: index r of every list is round r
    assert [p.seconds for p in passes[settings[0]]] == [1.0, 6.0]
    assert [p.seconds for p in passes[settings[1]]] == [2.0, 4.0]


def test_speedup_median_pairs_each_round_s_pass_with_that_round_s_plain_pass():
    from snugkv.bench.harness import format_table
    from snugkv.bench.speculative import fastest, repeat_columns, speedup_median

    plain = [passed([[1, 2]], seconds) for seconds in (2.0, 1.0, 3.0)]
    done = [passed([[1, 2]], seconds) for seconds in (1.0, 2.0, 2.0)]
    # per round 2.0, 0.5, 1.5: median 1.5; best of each, 1.0 / 1.0, and medians apart, 2.0 / 2.0, read 1.0
    assert speedup_median(done, plain) == pytest.approx(1.5)
    assert fastest(plain).seconds == 1.0 and fastest(done) is done[0]
    assert speedup_median(done[:1], plain[:1]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="rounds must pair"):
        speedup_median(done[:2], plain)
    columns = repeat_columns(done, plain)
    assert columns == {"speedup_median": pytest.approx(1.5), "repeats": 3}
    row = {**_row("open", 64, Setting("ngram", 4), fastest(done), fastest(plain)), **columns}
    assert row["speedup"] == 1.0 and "speedup_median" in format_table([row]).splitlines()[0]


def test_a_pass_counts_the_devices_idle_time_and_the_share_after_verify_steps():
    def step(decode: bool, rows: int, tokens: int, gap_s: float | None) -> StepRecord:
        return StepRecord(0.0, decode, rows, tokens, busy_s=0.01, gap_s=gap_s, waited_s=0.0)

    # prefill, a plain decode step, a verify step (4 rows, 12 tokens), the decode step after it
    records = [
        step(False, 4, 400, None),
        step(True, 4, 4, 0.001),
        step(True, 4, 12, 0.002),
        step(True, 4, 4, 0.005),
    ]
    times = SimpleNamespace(records=records, reset=lambda: None)
    llm = SimpleNamespace(_runtime=SimpleNamespace(scheduler=SimpleNamespace(times=times, speculation=None)))
    llm.reset_prefix_cache = lambda: None
    done = measure_pass(llm, None, lambda: ([[1, 2]], 0.5))
    assert done.idle_s == pytest.approx(0.008) and done.idle_after_verify_s == pytest.approx(0.005)
    assert done.device_s == pytest.approx(0.04) and done.verify_step_s == [0.01]
    plain = passed([[1, 2]], seconds=0.5)
    row = _row("summarize", 4, Setting("ngram", 4), done, plain)
    assert row["idle_ms"] == pytest.approx(8.0) and row["idle_after_verify_ms"] == pytest.approx(5.0)
    assert row["plain_idle_ms"] == 0.0


def test_a_differing_output_is_not_the_same_tokens_and_says_where():
    plain = passed([[1, 2], [5, 6, 7, 8]], seconds=1.0)
    done = passed([[1, 2], [5, 6, 9, 8]], seconds=1.0)
    assert not _row("chat", 2, Setting("suffix", 2), done, plain)["same_tokens"]
    assert _first_difference(plain, done).startswith("output 1 differs at token 2")


@pytest.mark.slow
def test_a_small_run_on_smollm2_writes_rows_with_no_mismatch(tmp_path):
    from snugkv.cli import main

    code = main(
        ["bench", "speculative", "--workloads", "code-edit", "chat", "--batch", "2", "--k", "2",
         "--max-tokens", "12", "--out", str(tmp_path)]
    )  # fmt: skip
    report = json.loads((tmp_path / "speculative.json").read_text())
    assert code == 0 and report["benchmark"] == "speculative" and report["mismatches"] == 0
    assert {"date", "commit", "device"} <= set(report["environment"])
    assert len(report["rows"]) == 2 * 2  # workloads x proposers (batch 2: both chats at once)
    for row in report["rows"]:
        assert row["same_tokens"] and row["output_tokens"] > 0
        assert {"proposer", "workload", "batch", "k", "acceptance", "tok_per_s", "speedup"} <= set(row)
        assert row["repeats"] == 1 and row["speedup_median"] == pytest.approx(row["speedup"])


def test_a_draft_model_proposer_is_taken_and_a_bad_one_refused_in_one_line():
    import argparse

    from snugkv.bench.speculative import proposer, speculative_config

    assert proposer("draft:layers:8") == "draft:layers:8" and proposer("draft:self") == "draft:self"
    config = speculative_config("draft:layers:8", num_tokens=3, max_batch_size=4)
    assert (config.method, config.draft_model, config.num_tokens) == ("draft", "layers:8", 3)
    assert speculative_config("ngram", num_tokens=3, max_batch_size=4).draft_model is None
    refused = (
        ("draft:layers:0", "--draft-model layers:N"),
        ("lookup", "not ngram, suffix"),
        ("draft:/models/draft.gguf", "a separate draft model is not in this bench yet"),
    )
    for bad, message in refused:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            proposer(bad)


def test_step_costs_time_a_decode_and_a_verify_step_per_batch_and_k(tmp_path):
    from snugkv.cli import main
    from tests.models.hf_tiny import save_tiny_hf_model

    save_tiny_hf_model("llama", tmp_path / "model")
    code = main(
        ["bench", "speculative", "--model", str(tmp_path / "model"), "--load-format", "dummy", "--step-costs",
         "--batch", "1", "3", "--k", "2", "--context", "40", "--out", str(tmp_path)]
    )  # fmt: skip
    report = json.loads((tmp_path / "speculative_steps.json").read_text())
    assert code == 0 and report["benchmark"] == "speculative_steps"
    assert [(row["batch"], row["k"], row["context"]) for row in report["rows"]] == [(1, 2, 40), (3, 2, 40)]
    for row in report["rows"]:
        assert row["decode_step_ms"] > 0 and row["verify_step_ms"] > 0
        assert row["verify_over_decode"] == pytest.approx(row["verify_step_ms"] / row["decode_step_ms"])


def test_step_costs_with_an_eagle3_head_time_its_draft_steps_too(tmp_path):
    from snugkv.cli import main
    from tests.models.hf_tiny import tiny_hf_config, tiny_hf_model
    from tests.speculative.test_eagle3 import save_head

    tiny_hf_model("llama", config=tiny_hf_config("llama", num_hidden_layers=4)).save_pretrained(
        tmp_path / "model"
    )
    save_head(tmp_path / "head")
    code = main(
        ["bench", "speculative", "--model", str(tmp_path / "model"), "--load-format", "dummy", "--step-costs",
         "--eagle", str(tmp_path / "head"), "--batch", "2", "--k", "3", "--context", "40", "--out", str(tmp_path)]
    )  # fmt: skip
    report = json.loads((tmp_path / "speculative_steps.json").read_text())
    assert code == 0 and report["eagle"] == str(tmp_path / "head")
    (row,) = report["rows"]
    assert row["draft_steps_ms"] > 0
    assert row["speculating_over_decode"] == pytest.approx(
        (row["draft_steps_ms"] + row["verify_step_ms"]) / row["decode_step_ms"]
    )
    with pytest.raises(SystemExit, match="--eagle goes with --step-costs"):
        main(["bench", "speculative", "--eagle", str(tmp_path / "head"), "--out", str(tmp_path)])


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_repeats_below_one_or_not_a_number_is_refused_before_the_engine_loads(value, capsys):
    from snugkv.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "speculative", "--repeats", value])
    assert exit_info.value.code == 2
    assert f"--repeats: {value!r} rounds: pass a whole number, 1 or more" in capsys.readouterr().err
