"""`summarize_steps`: where a run's device time went, from the steps' records; whether a launched
step still holds the device."""

import pytest
import torch

from snugkv.scheduler.launched import LaunchedStep, StepRecord, clock, summarize_steps


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


@pytest.mark.cuda
def test_a_launched_step_is_running_until_the_device_reaches_its_end():
    """`LaunchedStep.running` (speculation builds drafters ahead only while it holds): a CUDA event
    recorded behind a long kernel is not reached at once, and is once the stream is done."""
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    for _ in range(20):  # milliseconds of float32 products queued
        a = a @ a / 64
    step = launched(started=clock(device))
    step.finish_launch(device)
    assert step.running()
    torch.cuda.synchronize()
    assert not step.running()


def launched(**fields: object) -> LaunchedStep:
    return LaunchedStep(batch=None, sampled_rows=[], tokens=None, log_probs=None, **fields)  # type: ignore[arg-type]


def test_a_cpu_step_is_never_running_once_launched():
    cpu = torch.device("cpu")
    step = launched(started=clock(cpu))
    step.finish_launch(cpu)
    assert not step.running()
