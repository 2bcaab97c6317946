"""Issue 34's sizing targets on a GPU: with speculation on, the KV cache holds what was free after
capture, less the measured needs (the activation peak with the verify step's and the draft's in it),
over the bytes per token of both models; and a load of twice the KV cache's tokens runs to the end.

For each configuration (a separate draft model, random weights of a small Llama of the 8B shape's
vocabulary, whose KV lives beside the model's; the n-gram proposer), one engine of the 8B shape
(random weights) starts, and the script prints:
- `kv_tokens` (`max_total_num_tokens`) against `expected_tokens` = (KV committed + free after sizing
  + the activation workspace torch holds - headroom - guest room) / bytes per token, from the
  ledger's independent counts (free memory as the device reports it), and their ratio (target:
  within 1%);
- then `--requests` greedy requests whose prompts and outputs add up to `--demand` times the KV
  cache's tokens, all at once, `speculative_max_batch_size` = `max_running_requests` so every decode
  step may speculate: whether every request finished with all its tokens, the error if one did
  not (an out-of-memory included), retractions, verify steps' counts, the device's used memory at
  the end and torch's peak reserved memory.
One JSON line per configuration, also written to `--out`. GPU only.

    python3 scripts/spec_sizing_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from snugkv import LLM, SamplingParams
from snugkv.bench.model_configs import benchmark_model

DRAFT_CONFIG = {  # a small Llama with the 8B shape's vocabulary: a separate draft of that shape
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def check(model: str, method: str, draft: str | None, args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "load_format": "dummy",
        "speculative": method,
        "num_speculative_tokens": args.k,
        "max_running_requests": args.max_running,
        "speculative_max_batch_size": args.max_running,
    }
    if draft is not None:
        options["draft_model"] = draft
    result: dict[str, Any] = {"speculative": method, "draft_model": "small llama (random)" if draft else None}
    with LLM(model, **options) as llm:
        memory = llm.memory()
        ledger = memory.ledger
        bytes_per_token = llm.engine.pool.bytes_per_token
        # what was free after capture, less what the sizing keeps: the headroom (the activation peak,
        # verify and draft steps in it; the workspace torch holds counts toward it) and the guest room
        free_after_capture = ledger.kv_committed_bytes + ledger.free_bytes + ledger.workspace_bytes
        kept = ledger.headroom_bytes + ledger.guest_room_bytes
        expected = (free_after_capture - kept) / bytes_per_token
        kv_tokens = memory.sizing.max_total_num_tokens
        result.update(
            kv_tokens=kv_tokens,
            expected_tokens=round(expected),
            kv_over_expected=kv_tokens / expected,
            bytes_per_token=bytes_per_token,
            draft_kv_bytes_per_token=ledger.draft_kv_bytes_per_token,
            free_after_sizing_gib=ledger.free_bytes / 2**30,
            headroom_gib=ledger.headroom_bytes / 2**30,
            verify_peak_gib=ledger.verify_peak_bytes / 2**30,
            draft_peak_gib=ledger.draft_peak_bytes / 2**30,
            ledger=ledger.table(),
        )
        per_request = args.prompt_tokens + args.output_tokens
        count = max(1, round(args.demand * kv_tokens / per_request))
        # prompts repeat with a period of 97 tokens: the n-gram proposer finds a draft at every step
        prompts = [[(7 * i + j % 97) % 5000 + 100 for j in range(args.prompt_tokens)] for i in range(count)]
        params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            short = sum(1 for o in outputs if len(o.outputs[0].token_ids) != args.output_tokens)
            result.update(finished=len(outputs), short_outputs=short, error=None)
        except Exception as exc:  # an out-of-memory is this check's finding, not a crash of the script
            result.update(finished=None, error=f"{type(exc).__name__}: {exc}"[:500])
            traceback.print_exc()
        stats = llm.stats()
        free, total = torch.cuda.mem_get_info()
        result.update(
            requests=count,
            demand_tokens=count * per_request,
            demand_over_kv=count * per_request / kv_tokens,
            seconds=time.perf_counter() - started,
            stats={k: v for k, v in stats.items() if k.startswith(("spec_", "retract", "num_retract"))},
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            device_free_at_end_gib=free / 2**30,
            device_total_gib=total / 2**30,
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=benchmark_model, default="llama-3-8b")
    parser.add_argument("--configs", nargs="+", default=["draft", "ngram"], choices=["draft", "ngram"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-running", type=int, default=128)
    parser.add_argument("--demand", type=float, default=2.0, help="the load's tokens over the KV cache's")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("spec_sizing_check.py measures device memory: it needs a CUDA GPU")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        draft_dir = Path(scratch) / "draft"
        draft_dir.mkdir()
        (draft_dir / "config.json").write_text(json.dumps(DRAFT_CONFIG))
        for config in args.configs:
            draft = str(draft_dir) if config == "draft" else None
            try:
                result = check(args.model, config, draft, args)
            except Exception as exc:  # a start-up failure is reported, and the next configuration runs
                traceback.print_exc()
                result = {"speculative": config, "error": f"start-up: {type(exc).__name__}: {exc}"[:500]}
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "ledger"}), flush=True)
            print(result.get("ledger", ""), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_sizing.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("error") is None for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
