"""`snugkv bench tp`: tensor parallelism, tp=2 against tp=1 on a Llama-3-8B-shaped model.

Per configuration (tp=1, then tp=2 when two GPUs are visible), in its own child process with a
timeout so one failure cannot lose the other's results:
- post-capture sizing on every rank: each rank's free memory and the token count each committed;
- greedy generation of fixed prompts (32 tokens); tp=2 must be token-identical to tp=1. As
  random-weight logits are nearly flat, tp=2 also reports teacher-forced top-1 agreement on tp=1's
  tokens, which tells a real bug (low agreement) from a bf16 near-tie flipping one token;
- decode throughput with CUDA graphs at batch 1, 16 and 64 (context 1024).
Each child writes its JSON after every stage; the parent prints one table and writes tp.json.

`--device cpu` runs the same comparison over gloo without timing (float32 by default), and
`--layers N` keeps N decoder layers of the full-width shape, so a CPU can check the sharding of a
real layer geometry (heads, KV heads, vocabulary) in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.harness import cuda_missing, emit, time_cuda
from snugkv.bench.model_configs import benchmark_model
from snugkv.memory.vmm import GIB

PROMPT_LENGTHS = (7, 33, 120, 250)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="llama-3-8b")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument(
        "--device", default=None, help="cuda (NCCL, needs 2 GPUs for tp=2) or cpu (gloo; no decode timing)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep only this many decoder layers (the shape of each stays)",
    )
    parser.add_argument(
        "--batches",
        default=None,
        help="decode batch sizes, comma separated (default: 1,16,64 on GPU, none on CPU)",
    )
    parser.add_argument("--context", type=int, default=1024, help="tokens cached per row while timing decode")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=int, default=420, help="per configuration")


def fixed_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(100, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and cuda_missing("bench tp --device cuda", "; pass --device cpu to run over gloo"):
        return 2
    gpu = device == "cuda"
    sizes = [1, 2] if not gpu or torch.cuda.device_count() >= 2 else [1]
    batches = args.batches if args.batches is not None else ("1,16,64" if gpu else "")
    if batches and not gpu:
        print("bench tp: decode timing needs a GPU; on CPU leave --batches out")
        return 2
    spec = {
        "model": args.model,
        "device": device,
        "dtype": args.dtype or ("bfloat16" if gpu else "float32"),
        "layers": args.layers,
        "batches": [int(b) for b in batches.split(",") if b],
        "context": args.context,
        "new_tokens": args.new_tokens,
    }
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.layers is not None:
            spec["model"] = str(_fewer_layers(Path(args.model), args.layers, Path(scratch)))
        for tp_size in sizes:
            reference = results.get(1, {}).get("generation", {}).get("tokens")
            results[tp_size] = _run_child(
                {**spec, "tp_size": tp_size, "reference": reference}, Path(scratch), args.timeout_s
            )
    spec["model"] = args.model
    rows = [_row(tp_size, results[tp_size], results.get(1), spec["batches"]) for tp_size in sizes]
    if 2 not in sizes:
        rows.append({"tp": 2, "note": f"skipped: {torch.cuda.device_count()} GPU visible, tp=2 needs 2"})
    emit("tp", rows, args.out, extra={"spec": spec, "results": {str(k): v for k, v in results.items()}})
    failed = any("error" in result for result in results.values())
    identical = all(row.get("tokens_identical_to_tp1", True) is True for row in rows)
    return 1 if failed or not identical else 0


def _fewer_layers(model: Path, layers: int, scratch: Path) -> Path:
    """A copy of the config directory of `model` with `num_hidden_layers = layers` (random weights)."""
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = layers
    copy = scratch / f"{model.name}-{layers}-layers"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


def _run_child(spec: dict[str, Any], scratch: Path, timeout_s: int) -> dict[str, Any]:
    result_path = scratch / f"tp{spec['tp_size']}.json"
    spec_path = scratch / f"tp{spec['tp_size']}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    command = [sys.executable, "-m", "snugkv.bench.tp", str(spec_path), str(result_path)]
    error = None
    try:
        completed = subprocess.run(command, env=env, timeout=timeout_s, capture_output=True, text=True)
        if completed.returncode != 0:
            error = f"exit {completed.returncode}: {completed.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s} s"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if error:
        result["error"] = error
        print(f"bench tp: tp={spec['tp_size']} failed: {error}", file=sys.stderr)
    return result


def _row(
    tp_size: int, result: dict[str, Any], single: dict[str, Any] | None, batches: list[int]
) -> dict[str, Any]:
    row: dict[str, Any] = {"tp": tp_size}
    sizing = result.get("sizing", {})
    if sizing:
        row["max_total_num_tokens"] = sizing["max_total_num_tokens"]
        row["tokens_per_rank"] = "/".join(str(t) for t in sizing["tokens_per_rank"])
        row["free_gib_per_rank"] = "/".join(f"{b / GIB:.2f}" for b in sizing["per_rank_free_bytes"])
    generation = result.get("generation", {})
    if tp_size > 1 and generation and single and single.get("generation"):
        row["tokens_identical_to_tp1"] = generation["tokens"] == single["generation"]["tokens"]
        row["teacher_forced_top1"] = generation.get("teacher_forced_top1")
    for batch in batches:
        entry = result.get("decode", {}).get(str(batch))
        if entry:
            row[f"bs{batch}_tok_s"] = entry["tokens_per_s"]
            base = (single or {}).get("decode", {}).get(str(batch))
            if tp_size > 1 and base:
                row[f"bs{batch}_speedup"] = entry["tokens_per_s"] / base["tokens_per_s"]
    if "error" in result:
        row["error"] = result["error"][:200]
    return row


# -- child: one configuration, every rank -------------------------------------------------------
def _child_main(spec_path: str, result_path: str) -> None:
    from snugkv.distributed.launch import launch

    spec = json.loads(Path(spec_path).read_text())
    launch(_bench_rank, spec["tp_size"], (spec, result_path), device_type=spec["device"])


def _bench_rank(tp: Any, spec: dict[str, Any], result_path: str) -> None:
    import torch.distributed as dist

    from snugkv.core.sampling import SamplingParams
    from snugkv.driver.commands import Add
    from snugkv.driver.engine_core import EngineCore
    from snugkv.engine import Engine, EngineArgs

    result: dict[str, Any] = {"tp_size": tp.world_size}

    def save() -> None:
        if tp.is_first_rank:
            Path(result_path).write_text(json.dumps(result, indent=2))

    def everyone(value: Any) -> list[Any]:
        if not tp.enabled:
            return [value]
        gathered: list[Any] = [None] * tp.world_size
        dist.all_gather_object(gathered, value, group=tp.cpu_group)
        return gathered

    batches = spec["batches"]
    engine = Engine(
        EngineArgs.of(
            model=spec["model"],
            load_format="dummy",
            device=spec["device"],
            dtype=spec["dtype"],
            tp_size=tp.world_size,
            max_running_requests=max(batches, default=len(PROMPT_LENGTHS)),
            cuda_graph_max_bs=max(batches, default=None),
            context_length=max(2048, spec["context"] + 64),
        ),
        tp=tp,
    )
    report = engine.report
    result["sizing"] = {
        "max_total_num_tokens": report.max_total_num_tokens,
        "tokens_per_rank": everyone(report.max_total_num_tokens),
        "per_rank_free_bytes": list(report.per_rank_free_bytes),
        "ledger_per_rank": everyone(report.ledger.to_dict()),
        "sizing_ms": report.sizing_ms,
    }
    save()
    runner = engine.runner
    prompts = fixed_prompts(engine.config.vocab_size)
    greedy = SamplingParams(max_new_tokens=spec["new_tokens"], ignore_eos=True)
    core = EngineCore.around(engine)  # every rank submits the same requests: they batch alike
    requests = core.submit(Add(str(i), prompt, greedy) for i, prompt in enumerate(prompts))
    core.run()
    tokens = [request.output_ids for request in requests]
    core.scheduler.cache.reset()  # the runner's slots are all free again for the measurements below
    result["generation"] = {"prompt_lengths": list(PROMPT_LENGTHS), "tokens": tokens}
    if spec.get("reference"):
        result["generation"]["teacher_forced_top1"] = _teacher_forced_top1(runner, prompts, spec["reference"])
    save()
    result["decode"] = {}
    for batch in batches:
        result["decode"][str(batch)] = _decode_throughput(runner, batch, spec["context"])
        save()
    engine.close()


def _teacher_forced_top1(runner: Any, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions where this run's top-1 equals the reference's next token, fed the reference."""
    from snugkv.core.forward import BatchRow

    pool = runner.req_to_token_pool
    rows_idx = [pool.alloc() for _ in prompts]
    rows = [BatchRow(idx, 0, prompt) for idx, prompt in zip(rows_idx, prompts)]
    agree = total = 0
    for step in range(len(reference[0])):
        logits = runner.forward(rows, runner.allocate_slots(rows))
        top1 = runner.tp.broadcast_from_first(logits.argmax(dim=-1).tolist())
        agree += sum(int(t == ref[step]) for t, ref in zip(top1, reference))
        total += len(rows)
        rows = [
            BatchRow(idx, len(prompt) + step, [ref[step]])
            for idx, prompt, ref in zip(rows_idx, prompts, reference)
        ]
    for idx, prompt, ref in zip(rows_idx, prompts, reference):
        runner.free_request_slots(idx, len(prompt) + len(ref) - 1)
        pool.free(idx)
    return agree / max(total, 1)


def _decode_throughput(runner: Any, batch: int, context: int) -> dict[str, Any]:
    from snugkv.core.forward import BatchRow

    rows, owned = [], []
    for _ in range(batch):
        idx = runner.req_to_token_pool.alloc()
        runner.allocate_slots([BatchRow(idx, 0, [1] * context)])
        rows.append(BatchRow(idx, context, [1]))
        owned.append(idx)
    slots = runner.allocate_slots(rows)
    forward_batch = runner.build_batch(rows, slots)
    with torch.inference_mode():
        step_s = time_cuda(lambda: runner.forward_batch(forward_batch))
    for idx in owned:
        runner.free_request_slots(idx, context + 1)
        runner.req_to_token_pool.free(idx)
    return {"step_ms": step_s * 1e3, "tokens_per_s": batch / step_s, "context": context}


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
