"""`summarize_steps`: where a run's device time went, from the steps' records."""

from snugkv.scheduler.launched import StepRecord, summarize_steps


def record(at: float, decode: bool, rows: int, gap: float | None) -> StepRecord:
    return StepRecord(at, decode, rows, rows if decode else 100 * rows, busy_s=0.005, gap_s=gap, waited_s=0.0)


def test_the_summary_counts_only_the_span_and_splits_the_idle_time():
    records = [
        record(9.0, True, 4, None),  # an earlier run: outside the span
        record(10.2, False, 2, 1.0),  # the span's first step: its gap is the idle before the run
        record(10.21, True, 2, 0.001),
        record(10.22, False, 1, 0.004),
        record(10.23, True, 3, 0.0),
        record(12.5, True, 1, 0.002),  # after the span
    ]
    summary = summarize_steps(records, start=10.0, end=12.0)
    assert summary["steps"] == 4 and summary["prefill_steps"] == 2
    assert summary["mean_decode_rows"] == 2.5
    assert abs(summary["first_step_after_s"] - 0.2) < 1e-9
    assert abs(summary["device_busy_s"] - 0.02) < 1e-9
    assert abs(summary["prefill_busy_s"] - 0.01) < 1e-9 and abs(summary["decode_busy_s"] - 0.01) < 1e-9
    assert summary["prefill_tokens"] == 300 and summary["decode_tokens"] == 5
    assert abs(summary["gap_s"] - 0.005) < 1e-9  # not the 1.0 s before the first step
    assert abs(summary["gap_before_prefill_s"] - 0.004) < 1e-9
    assert abs(summary["largest_gap_ms"] - 4.0) < 1e-9


def test_records_read_back_from_json_lists_and_an_empty_span():
    records = [list(record(1.0, True, 1, None)), list(record(1.1, True, 1, 0.01))]
    assert summarize_steps(records, 0.0, 2.0)["steps"] == 2
    assert summarize_steps(records, 5.0, 6.0) == {"steps": 0}
