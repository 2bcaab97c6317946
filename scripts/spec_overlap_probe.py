"""Where a verify step's time goes when it is launched behind a step still in flight (issue 34).

Runs one batch of greedy requests through `LLM` with `--speculative ngram`, every row drafting `k`
copies of its last token at every step it may (the proposer is replaced: the steps' costs are what is
measured, not acceptance, so random weights of any shape do), twice: with rows drafting behind a
step in flight (the default) and without (the scheduler reads the step in flight before a step that
may speculate). For each run it prints the wall time, tokens/s, and per kind of verify step
(launched behind a step in flight or not) the count, the median device span (`StepTimes`: from the
event recorded as the forward is called to the one after the copies, so host time spent inside the
launch while the device waits counts too) and the median host time of the launch. Then it profiles
a few steps of the in-flight run with torch.profiler and prints the host calls by self time (a
blocking copy or synchronize shows there). GPU only.

    python3 scripts/spec_overlap_probe.py --model qwen3-0.6b --batch 8 --k 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from snugkv import LLM, SamplingParams
from snugkv.bench.model_configs import benchmark_model
from snugkv.scheduler.scheduler import Scheduler
from snugkv.scheduler.speculation import Speculation
from snugkv.speculative.drafter import RowDrafter


def always_draft(self: RowDrafter, token_ids: Any, k: int, unread: int = 0) -> list[int]:
    return [int(token_ids[-1])] * k if k > 0 else []


def run(args: argparse.Namespace, in_flight: bool, profile: bool) -> dict[str, Any]:
    Speculation.drafts_in_flight = property(lambda self: in_flight)  # type: ignore[method-assign,assignment]
    schedulers: list[Scheduler] = []
    launches: list[tuple[bool, float]] = []
    original_init, original_launch = Scheduler.__init__, Scheduler._launch

    def init(self: Scheduler, *a: Any, **kw: Any) -> None:
        original_init(self, *a, **kw)
        schedulers.append(self)

    def launch(self: Scheduler, scheduled: Any, previous: Any) -> Any:
        started = time.perf_counter()
        result = original_launch(self, scheduled, previous)
        if scheduled.drafts is not None:
            launches.append((previous is not None, time.perf_counter() - started))
        return result

    Scheduler.__init__, Scheduler._launch = init, launch  # type: ignore[method-assign]
    try:
        with LLM(
            benchmark_model(args.model),
            load_format="dummy",
            speculative="ngram",
            num_speculative_tokens=args.k,
            cuda_graph_max_bs=64,
            max_running_requests=args.batch,
        ) as llm:
            prompts = [[100 + i, 200 + i, 300 + i] * 20 for i in range(args.batch)]
            sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
            llm.generate(prompts, sampling, use_tqdm=False)  # warm-up
            scheduler = schedulers[-1]
            scheduler.times.reset()
            launches.clear()
            started = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            seconds = time.perf_counter() - started
            records = [r for r in scheduler.times.records if r.decode and r.tokens > r.rows]
            plain = [r.busy_s * 1e3 for r in scheduler.times.records if r.decode and r.tokens == r.rows]
            timed_launches = list(launches)
            table = None
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                short = SamplingParams(max_new_tokens=24, ignore_eos=True)
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    llm.generate(prompts, short, use_tqdm=False)
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    finally:
        Scheduler.__init__, Scheduler._launch = original_init, original_launch  # type: ignore[method-assign]
    tokens = sum(len(o.token_ids) for o in outputs)
    kinds: dict[str, Any] = {}
    for behind in (True, False):
        busy = [r.busy_s * 1e3 for r, (b, _) in zip(records, timed_launches) if b == behind]
        host = [h * 1e3 for b, h in timed_launches if b == behind]
        kinds["behind_a_step_in_flight" if behind else "after_a_read"] = {
            "verify_steps": len(busy),
            "median_span_ms": statistics.median(busy) if busy else None,
            "median_launch_host_ms": statistics.median(host) if host else None,
        }
    return {
        "drafts_in_flight": in_flight,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "verify_steps": len(records),
        "plain_steps": len(plain),
        "median_plain_span_ms": statistics.median(plain) if plain else None,
        "records_match_launches": len(records) == len(timed_launches),
        **kinds,
        "profile": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("spec_overlap_probe: needs a CUDA GPU")
    RowDrafter.propose = always_draft  # type: ignore[method-assign]
    results = [run(args, in_flight, profile=in_flight) for in_flight in (False, True)]
    for result in results:
        table = result.pop("profile")
        print(json.dumps(result))
        if table:
            print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_overlap_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
