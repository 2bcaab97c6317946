"""Where the GPU sat idle during a serving run, as bench columns: shared by the in-process and HTTP
serving benchmarks."""

from __future__ import annotations

from typing import Any

from snugkv.scheduler.launched import summarize_steps


def gc_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The collector's full collections between two `GcPauses.as_dict()` readings, as bench columns."""
    return {
        "gc_full_collections": after["full_collections"] - before["full_collections"],
        "gc_full_s": after["full_collection_s"] - before["full_collection_s"],
    }


def step_figures(records: list[Any], start: float, end: float) -> dict[str, Any]:
    """A run's steps (`launched.summarize_steps`) as bench columns: where the GPU sat idle."""
    summary = summarize_steps(records, start, end)
    if not summary["steps"]:
        return {}
    return {
        "steps": summary["steps"],
        "prefill_steps": summary["prefill_steps"],
        "mean_decode_rows": round(summary["mean_decode_rows"], 1),
        "device_busy_s": summary["device_busy_s"],
        "prefill_busy_s": summary["prefill_busy_s"],
        "prefill_step_tokens": summary["prefill_tokens"],
        "decode_busy_s": summary["decode_busy_s"],
        "idle_before_first_step_s": summary["first_step_after_s"],
        "idle_between_steps_s": summary["gap_s"],
        "of_which_before_prefill_s": summary["gap_before_prefill_s"],
        "largest_gap_ms": summary["largest_gap_ms"],
    }
