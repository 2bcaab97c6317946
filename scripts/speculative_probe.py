"""Tokens/s with and without speculative decoding, and what a verify step costs against a decode step.

    PYTHONPATH=src python scripts/speculative_probe.py [--model M --load-format dummy] [--batch 1 8]

Runs the same greedy requests through `LLM` once plain and once per proposer (ngram, suffix), each
in a fresh engine, on two workloads: `code-edit` (the prompt holds code the answer repeats with
a change, the case prompt lookup is for) and `open` (a short prompt, free continuation); each timed
call runs `--repeats` times and the fastest counts (a shared CPU is noisy). Prints one JSON line per
run: tokens/s, speedup over plain in the same process, acceptance (accepted / drafted tokens), mean accepted length, and the mean device time of
the decode steps and the verify steps (`Scheduler.times` records; a verify step's rows carry
k + 1 tokens). Not a benchmark of the harness (snugkv bench speculative is not built): a probe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from snugkv import LLM, SamplingParams
from snugkv.speculative.suffix import SuffixStore

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
WORKLOADS = {
    "code-edit": "Rename every function below to start with `op_`.\n\n"
    + CODE
    + "\nRenamed:\n\ndef op_add(a, b):",
    "open": "Write a short story about a lighthouse keeper who",
}


def run(args: argparse.Namespace, speculative: str | None, prompts: list, new_tokens: int) -> dict:
    options = dict(max_total_tokens=args.max_total_tokens, chunked_prefill_size=512, dtype=args.dtype)
    if args.model:
        options.update(load_format=args.load_format)
    if args.cuda_graph_max_bs is not None:
        options.update(
            cuda_graph_max_bs=args.cuda_graph_max_bs, prefill_graph_max_tokens=args.prefill_graph_max_tokens
        )
    if speculative:
        options.update(speculative=speculative, num_speculative_tokens=args.k)
    with LLM(args.model, **options) as llm:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
        scheduler = llm._runtime.scheduler
        scheduler.times.reset()
        before = llm.stats()
        elapsed = float("inf")
        for _ in range(args.repeats):
            if scheduler.speculation is not None and scheduler.speculation.store is not None:
                # the repeats (and the warm-up) are the same request: an emptied store keeps the
                # suffix proposer from drafting the previous repeat's output
                scheduler.speculation.store = SuffixStore()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = min(elapsed, time.perf_counter() - started)
        after = llm.stats()
        records = list(scheduler.times.records)
    # counts over all repeats: the same greedy requests each time
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    rows = after["spec_drafted_rows"] - before["spec_drafted_rows"]
    decode = [r.busy_s for r in records if r.decode and r.tokens == r.rows]
    verify = [r.busy_s for r in records if r.decode and r.tokens > r.rows]
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "tokens": [o.token_ids for o in outputs],
        "tok_per_s": tokens / elapsed,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / rows if rows else 0.0,
        "decode_step_ms": statistics.median(decode) * 1e3 if decode else None,
        "verify_step_ms": statistics.median(verify) * 1e3 if verify else None,
        "steps": len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, help="GPU: fewer graphs start faster")
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=1024)
    args = parser.parse_args()
    for workload, prompt in WORKLOADS.items():
        for batch in args.batch:
            prompts = (
                [prompt] * batch if args.model is None else [[10 + (i % 12) * 37 for i in range(60)]] * batch
            )
            plain = run(args, None, prompts, args.new_tokens)
            for speculative in ("ngram", "suffix"):
                result = run(args, speculative, prompts, args.new_tokens)
                row = {
                    "workload": workload if args.model is None else "token-ids",
                    "batch": batch,
                    "k": args.k,
                    "proposer": speculative,
                    "same_tokens": result.pop("tokens") == plain["tokens"],
                    "speedup": result["tok_per_s"] / plain["tok_per_s"],
                    "plain_tok_per_s": plain["tok_per_s"],
                    "plain_decode_step_ms": plain["decode_step_ms"],
                    **result,
                }
                print(json.dumps(row), flush=True)
            if args.model is not None:
                break
        if args.model is not None:
            break


if __name__ == "__main__":
    main()
