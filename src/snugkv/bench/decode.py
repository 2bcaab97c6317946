"""`snugkv bench decode`: decode step time with CUDA graphs against the bandwidth floor.

A Llama-3-8B-shaped model (bf16, random weights) decodes batches of 1..256 requests at context
1k and 4k. Each step reads every weight once and every cached K/V once, so the floor is
(weight bytes + KV bytes) / copy bandwidth, with the copy bandwidth measured in the same run.
Beside it, a second floor: plain cuBLAS running only this model's weight GEMMs at the batch size,
captured in one graph. The engine runs twice in the same process, with the fused Triton kernels
and with their op-by-op torch references (the layers before fusion), and for each case the
table gives the graph step, the eager step and, for the fused engine, the kernels the eager step
launches by kind and per layer (torch profiler). `--transformers` adds the same shapes through
transformers (static cache, eager). KV is filled with random values first: nothing is timed on
zeros.

A mixture-of-experts model (`--model qwen3-30b-a3b`) runs batches 1, 64 and 256 at context 1k, each
row a different random token, and its floor reads the dense weights (attention, router, shared
experts, norms and the LM head; the embedding only its batch's rows), the experts the batch's
tokens actually pick in each layer (counted from the routing of the timed step) and the KV. Beside
the step, the MoE layers alone (each layer's MLP on the hidden rows the step gave it, all layers
in one CUDA graph) against their part of that floor (router, shared and touched experts). The
op-by-op baseline and the cuBLAS floor are skipped (the expert kernels have no unfused form).

`--quantization fp8` runs the bf16 engine and the FP8 one (the same random weights, rounded:
models/weights.py) in the same process at batch 1, 64 and 256 (context 1k): each one's graph step,
the FP8 step over the bf16 one, the KV tokens each start-up sized, and the FP8 GEMM each layer shape
chose at each batch size with every candidate's time (layers/fp8_gemm_choice.py) and how long the
choosing took. A MoE model runs the same way (its FP8 engine's experts in fp8: layers/fp8_experts.py),
each row with both engines' MoE layers alone and the experts its batch touched; the capacity stress
is left out.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from snugkv.bench.harness import copy_bandwidth_bytes_per_s, cuda_missing, emit, graph_seconds, time_cuda
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.profiles import kind_of
from snugkv.core.sampling import SamplingParams
from snugkv.kernels.moe_direct import direct_max_tokens
from snugkv.layers import dense_gemm_choice
from snugkv.memory.vmm import GIB
from snugkv.models.causal_lm import CausalLM

CASES = ((1, 1024), (16, 1024), (64, 1024), (256, 1024), (1, 4096), (16, 4096), (64, 4096), (256, 4096))
MOE_CASES = FP8_CASES = ((1, 1024), (64, 1024), (256, 1024))  # batch 1 / 64 / 256 at 1k


KERNEL_KINDS = (
    ("moe-routing", ("route_align", "select_experts", "_count_kernel", "_plan_kernel", "_scatter_kernel")),
    ("moe-experts", ("grouped_gemm",)),
    ("moe-direct", ("_direct_gate_up", "_direct_down")),  # experts with routing and combine inside
    ("fp8 quantize", ("_quantize_rows", "_quantize_groups")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "fp8_linear", "_fp8_rows")),
    ("attention", ("decode", "extend", "attn", "attention")),
    ("rope+kv-store", ("rope", "store", "index_put", "scatter")),
    ("norm", ("norm", "rsqrt", "pow", "mean", "reduce")),
    ("activation", ("act_and_mul", "silu", "gelu")),
    ("copy", ("copy", "cat", "memcpy", "memset", "fill")),
)


def kernel_kind(name: str) -> str:
    return kind_of(name, KERNEL_KINDS, "elementwise/other")


def kernel_breakdown(step: Any, num_layers: int, repeats: int = 3) -> dict[str, Any]:
    """Kernels one `step()` launches, grouped by kind: milliseconds and counts per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    ms: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(event.name)
            ms[kind] += event.device_time_total / repeats / 1e3
            count[kind] += 1
    kernels = sum(count.values()) / repeats
    return {
        "kernels_per_step": round(kernels),
        "kernels_per_layer": round(kernels / num_layers, 1),
        "kernel_ms_by_kind": {kind: round(value, 3) for kind, value in ms.most_common()},
        "kernels_by_kind": {kind: round(value / repeats) for kind, value in count.most_common()},
    }


def gemm_floor_s(model: CausalLM, batch: int) -> float:
    """Plain cuBLAS: every 2-D weight of the decoder layers and the LM head, one `F.linear` each at
    this batch size, captured in one CUDA graph (median replay). What the GEMMs alone can reach."""
    weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name]
    if model.config.tie_word_embeddings:
        weights.append(model.model.embed_tokens.weight)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}

    def step() -> None:
        for weight in weights:
            F.linear(inputs[weight.shape[1]], weight)

    return graph_seconds(step)


def moe_layers(model: CausalLM) -> list[Any]:
    from snugkv.layers.moe import SparseMoE

    return [module for module in model.modules() if isinstance(module, SparseMoE)]


def moe_weight_split(model: CausalLM) -> tuple[int, int]:
    """(bytes a decode step reads whatever its routing: every weight but the routed experts and the
    embedding table, which it reads a row per token; bytes of one routed expert of one layer)."""
    layers = moe_layers(model)
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    routed = sum(
        (layer.experts.w13.weight.numel() + layer.experts.w2.weight.numel())
        * layer.experts.w13.weight.element_size()
        for layer in layers
    )
    embedding = model.model.embed_tokens.weight
    embedding_bytes = 0 if model.config.tie_word_embeddings else embedding.numel() * embedding.element_size()
    return total - routed - embedding_bytes, layers[0].expert_bytes()


def moe_measurements(runner: Any, forward_batch: Any, layers: list[Any]) -> dict[str, Any]:
    """Experts the batch's tokens pick in each MoE layer (one eager step, its MoE inputs recorded),
    and the MoE layers alone on those inputs, captured in one CUDA graph."""
    inputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0].clone())) for layer in layers
    ]
    try:
        runner.forward_eager(forward_batch)
    finally:
        for hook in hooks:
            hook.remove()
    touched = [int(torch.unique(layer.route(hidden)[1]).numel()) for layer, hidden in zip(layers, inputs)]

    def moe_only() -> None:
        for layer, hidden in zip(layers, inputs):
            layer(hidden)

    seconds = graph_seconds(moe_only)
    fixed = sum(
        sum(
            p.numel() * p.element_size()
            for name, p in layer.named_parameters()
            if not name.startswith("experts.")
        )
        for layer in layers
    )
    return {"experts_touched": touched, "moe_ms": seconds * 1e3, "moe_fixed_bytes": fixed}


def snugkv_cases(
    model: str,
    cases: tuple[tuple[int, int], ...],
    *,
    fused: bool = True,
    breakdown: bool = False,
    quantization: str | None = None,
    fill_tokens: int | None = None,
    stress: bool = True,
) -> tuple[list[dict[str, Any]], int, int]:
    """`fill_tokens`: random KV in only the lowest that many slots (the allocator hands out the lowest
    free pages first, so the cases read no others), not in the whole pool: seconds, not a minute.
    `stress`: a MoE model's run ends with its start-up report and bench capacity's stress (a last
    row `{"startup": ...}`)."""
    from snugkv.core.forward import BatchRow
    from snugkv.engine import Engine, EngineArgs
    from snugkv.kernels import fused_kernels

    with fused_kernels(fused):
        engine = Engine(
            EngineArgs.of(
                model=model,
                load_format="dummy",
                max_running_requests=256,
                cuda_graph_max_bs=256,
                chunked_prefill_size=8192,
                quantization=quantization,
            )
        )
        runner = engine.runner
        assert runner is not None
        net = engine.loaded.model
        layers = moe_layers(net)
        weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
        dense_bytes, expert_bytes = moe_weight_split(net) if layers else (weight_bytes, 0)
        tokens = torch.Generator().manual_seed(0)
        kv_bytes_per_token = int(engine.pool.bytes_per_token)
        filled_tokens = (
            engine.pool.committed_tokens
            if fill_tokens is None
            else min(fill_tokens, engine.pool.committed_tokens)
        )
        for layer in range(engine.config.num_layers):  # random KV everywhere a case will read
            for buffer in engine.pool.get_kv_buffer(layer):
                filled = (
                    filled_tokens // engine.pool.page_size + 2
                    if buffer.dim() == 4
                    else filled_tokens + engine.pool.page_size
                )
                buffer[:filled].normal_()
        del buffer  # a live view would keep the arena from closing
        results = []
        for batch, context in cases:
            if batch * (context + engine.pool.page_size) > runner.allocator.available_tokens:
                results.append({"batch": batch, "context": context, "note": "does not fit the KV pool"})
                continue
            rows, requests = [], []
            for _ in range(batch):
                row = runner.req_to_token_pool.alloc()
                assert row is not None
                runner.allocate_slots([BatchRow(row, 0, [1] * context)])
                # MoE: a different token per row, so the rows route apart as real requests do
                token = int(torch.randint(3, net.config.vocab_size, (1,), generator=tokens)) if layers else 1
                rows.append(BatchRow(row, context, [token]))
                requests.append(row)
            slots = runner.allocate_slots(rows)
            assert slots is not None
            forward_batch = runner.build_batch(rows, slots)
            with torch.inference_mode():
                graph_s = time_cuda(lambda fb=forward_batch: runner.forward_batch(fb))
                eager_s = time_cuda(lambda fb=forward_batch: runner.forward_eager(fb), iterations=10)
                piecewise_s = float("nan")
                if runner.piecewise_graphs is not None and runner.piecewise_graphs.can_run(forward_batch):
                    piecewise_s = time_cuda(lambda fb=forward_batch: runner.forward_piecewise(fb))
                step_s = time_cuda(
                    lambda r=rows, s=slots, b=batch: runner.sample(runner.forward(r, s), [_GREEDY] * b)
                )
                result: dict[str, Any] = {
                    "batch": batch,
                    "context": context,
                    "graph_ms": graph_s * 1e3,
                    "eager_ms": eager_s * 1e3,
                    "piecewise_ms": piecewise_s * 1e3,
                    "step_ms": step_s * 1e3,
                    "weight_bytes": weight_bytes,
                    "kv_bytes": batch * (context + 1) * kv_bytes_per_token,
                    "kv_tokens": engine.report.max_total_num_tokens,
                }
                if layers:
                    moe = moe_measurements(runner, forward_batch, layers)
                    result.update(moe)
                    result["touched_expert_bytes"] = sum(moe["experts_touched"]) * expert_bytes
                    result["weight_bytes"] = dense_bytes + result["touched_expert_bytes"]
                    result["dense_weight_bytes"] = dense_bytes
                if breakdown:
                    if quantization is None:  # the floor runs cuBLAS on the float weights
                        result["gemm_floor_ms"] = float("nan") if layers else gemm_floor_s(net, batch) * 1e3
                    result.update(
                        kernel_breakdown(
                            lambda fb=forward_batch: runner.forward_eager(fb), engine.config.num_layers
                        )
                    )
            results.append(result)
            for row in requests:
                runner.free_request_slots(row, context + 1)
                runner.req_to_token_pool.free(row)
        if layers and stress:  # what start-up sized and measured for this shape, then the capacity stress
            print(engine.report.ledger.table())
            results.append({"startup": {**engine.report.to_dict(), **pool_stress(engine)}})
        engine.close()
    return results, weight_bytes, kv_bytes_per_token


_GREEDY = SamplingParams(temperature=0.0)


def pool_stress(engine: Any) -> dict[str, Any]:
    """bench capacity's stress on this engine: every slot in use by the largest graph batch, a
    decode step, then the largest prefill chunk; free memory at the peak, or the OOM."""
    from snugkv.bench.capacity import _stress

    torch.cuda.reset_peak_memory_stats()
    try:
        return {**_stress(engine), "oom": False}
    except torch.OutOfMemoryError as exc:
        return {"oom": True, "error": str(exc)[:300]}


def is_moe_model(model: str) -> bool:
    from snugkv.models.loader import read_model_config, resolve_model_source

    hf = read_model_config(resolve_model_source(model, "dummy")).hf
    return any(hf.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def transformers_cases(model: str, cases: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], float]:
    """transformers' decode step times, measured in a child process (a CUDA error there cannot
    take this process's results with it)."""
    import json
    import subprocess
    import sys

    for cache in ("static", "dynamic"):
        command = [sys.executable, "-m", "snugkv.bench.decode_transformers", model, json.dumps(cases), cache]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            break
        print(f"transformers decode with the {cache} cache failed:", done.stderr[-1200:])
    else:
        return {}
    result = json.loads(lines[-1])
    print(f"transformers decode path: {result['path']}")
    return {(batch, context): ms for batch, context, ms in result["timings"]}


def fp8_side_by_side(args: argparse.Namespace, bandwidth: float) -> int:
    """bf16 and FP8 engines on the same random weights, in this process, at FP8_CASES."""
    from snugkv.layers.fp8_gemm_choice import measurements, summary

    started = time.perf_counter()
    cases = tuple(c for c in FP8_CASES if c[0] <= args.max_batch)
    runs, seconds = {}, {}
    for label, quantization in (("bf16", None), ("fp8", args.quantization)):
        begun = time.perf_counter()
        most = max(batch * (context + 32) for batch, context in cases)  # a case's slots, pages rounded up
        runs[label], _, _ = snugkv_cases(
            args.model, cases, breakdown=True, quantization=quantization, fill_tokens=most, stress=False
        )
        gc.collect()
        torch.cuda.empty_cache()
        seconds[label] = time.perf_counter() - begun
    rows = []
    for bf16, fp8 in zip(runs["bf16"], runs["fp8"]):
        if "graph_ms" not in bf16 or "graph_ms" not in fp8:
            rows.append(
                {"batch": bf16["batch"], "context": bf16["context"], "note": "does not fit the KV pool"}
            )
            continue
        rows.append(
            {
                "batch": bf16["batch"],
                "context": bf16["context"],
                "bf16_graph_step_ms": bf16["graph_ms"],
                "fp8_graph_step_ms": fp8["graph_ms"],
                "fp8_over_bf16": fp8["graph_ms"] / bf16["graph_ms"],
                "bf16_piecewise_ms": bf16["piecewise_ms"],
                "fp8_piecewise_ms": fp8["piecewise_ms"],
                "fp8_floor_ms": (fp8["weight_bytes"] + fp8["kv_bytes"]) / bandwidth * 1e3,
                "fp8_graph_over_floor": fp8["graph_ms"]
                / ((fp8["weight_bytes"] + fp8["kv_bytes"]) / bandwidth * 1e3),
                "bf16_kernels_per_layer": bf16["kernels_per_layer"],
                "fp8_kernels_per_layer": fp8["kernels_per_layer"],
                "fp8_tokens_per_s": fp8["batch"] / fp8["step_ms"] * 1e3,
                **_moe_columns(bf16, fp8),
            }
        )
    first = {label: next(r for r in run if "graph_ms" in r) for label, run in runs.items()}
    emit(
        "decode_fp8",
        rows,
        args.out,
        extra={
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "seconds": time.perf_counter() - started,
            "model": args.model,
            "kv_tokens": {label: r["kv_tokens"] for label, r in first.items()},
            "weight_bytes": {label: r["weight_bytes"] for label, r in first.items()},
            "kernel_ms_by_kind": {
                label: {f"b{r['batch']}": r["kernel_ms_by_kind"] for r in run if "graph_ms" in r}
                for label, run in runs.items()
            },
            "fp8_gemm_measurements_us": measurements(),
            "fp8_gemm_choice": summary(),
            "engine_seconds": seconds,
        },
    )
    kv = {label: r["kv_tokens"] for label, r in first.items()}
    print(f"KV tokens at start-up: bf16 {kv['bf16']:,}, fp8 {kv['fp8']:,} ({kv['fp8'] / kv['bf16']:.3f}x)")
    print(
        f"weights: bf16 {first['bf16']['weight_bytes'] / GIB:.2f} GiB, fp8 {first['fp8']['weight_bytes'] / GIB:.2f} GiB"
    )
    for entry in measurements():
        print("fp8 gemm", entry)
    choice = summary()
    print(
        f"FP8 GEMM choice: {choice['keys']} shapes x batch buckets measured, {choice['timed_runs']} timed runs, "
        f"{choice['seconds']:.1f} s (compiles included); engines bf16 {seconds['bf16']:.0f} s, fp8 {seconds['fp8']:.0f} s"
    )
    return 0


def _moe_columns(bf16: dict[str, Any], fp8: dict[str, Any]) -> dict[str, Any]:
    """A MoE row's extra columns: both engines' MoE layers alone, the experts the FP8 batch touched."""
    if "moe_ms" not in fp8:
        return {}
    touched = fp8["experts_touched"]
    return {
        "bf16_moe_ms": bf16["moe_ms"],
        "fp8_moe_ms": fp8["moe_ms"],
        "fp8_moe_over_bf16": fp8["moe_ms"] / bf16["moe_ms"],
        "experts_touched_per_layer": sum(touched) / len(touched),
        "fp8_touched_expert_gb": fp8["touched_expert_bytes"] / 1e9,
    }


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench decode"):
        return 2
    bandwidth = copy_bandwidth_bytes_per_s()
    if args.quantization:
        return fp8_side_by_side(args, bandwidth)
    moe = is_moe_model(args.model)
    cases = tuple(c for c in (MOE_CASES if moe else CASES) if c[0] <= args.max_batch)
    started = time.perf_counter()
    fused, _, _ = snugkv_cases(args.model, cases, fused=True, breakdown=True)
    startup = [r["startup"] for r in fused if "startup" in r]
    fused = [r for r in fused if "startup" not in r]
    gc.collect()
    torch.cuda.empty_cache()
    unfused: list[dict[str, Any]] = []
    if args.unfused and not moe:
        unfused, _, _ = snugkv_cases(args.model, cases, fused=False)
        gc.collect()
        torch.cuda.empty_cache()
    before = {(r["batch"], r["context"]): r for r in unfused if "graph_ms" in r}
    hf_ms = (
        transformers_cases(args.model, tuple((r["batch"], r["context"]) for r in fused if "graph_ms" in r))
        if args.transformers
        else {}
    )
    rows = []
    for result in fused:
        if "graph_ms" not in result:
            rows.append({"batch": result["batch"], "context": result["context"], "note": result["note"]})
            continue
        key = (result["batch"], result["context"])
        floor_ms = (result["weight_bytes"] + result["kv_bytes"]) / bandwidth * 1e3
        row = {
            "batch": result["batch"],
            "context": result["context"],
            "graph_step_ms": result["graph_ms"],
            "engine_step_ms": result["step_ms"],
            "eager_step_ms": result["eager_ms"],
            "floor_ms": floor_ms,
            "graph_over_floor": result["graph_ms"] / floor_ms,
            "eager_over_graph": result["eager_ms"] / result["graph_ms"],
            "piecewise_step_ms": result["piecewise_ms"],
            "piecewise_over_graph": result["piecewise_ms"] / result["graph_ms"],
            "gemm_floor_ms": result["gemm_floor_ms"],
            "kernels_per_layer": result["kernels_per_layer"],
            "tokens_per_s": result["batch"] / result["step_ms"] * 1e3,
        }
        if key in before:
            row["unfused_graph_ms"] = before[key]["graph_ms"]
            row["unfused_eager_ms"] = before[key]["eager_ms"]
            row["unfused_over_fused"] = before[key]["graph_ms"] / result["graph_ms"]
        if "moe_ms" in result:
            moe_floor_ms = (result["moe_fixed_bytes"] + result["touched_expert_bytes"]) / bandwidth * 1e3
            row.update(
                dense_weight_gb=result["dense_weight_bytes"] / 1e9,
                touched_expert_gb=result["touched_expert_bytes"] / 1e9,
                experts_touched_per_layer=sum(result["experts_touched"]) / len(result["experts_touched"]),
                moe_ms=result["moe_ms"],
                moe_floor_ms=moe_floor_ms,
                moe_over_floor=result["moe_ms"] / moe_floor_ms,
                moe_over_step_floor=result["moe_ms"] / floor_ms,
            )
            del row["gemm_floor_ms"]
        if key in hf_ms:
            row["transformers_ms"] = hf_ms[key]
            row["transformers_over_snugkv"] = hf_ms[key] / result["step_ms"]
        rows.append(row)
    emit(
        "decode",
        rows,
        args.out,
        extra={
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "seconds": time.perf_counter() - started,
            "model": args.model,
            "startup": startup,
            "moe_configs": os.environ.get("SNUGKV_MOE_CONFIGS", "defaults"),
            "moe_direct_max_tokens": direct_max_tokens(),
            "dense_gemm_measurements_us": dense_gemm_choice.measurements(),
            "kernel_breakdown": [
                {
                    key: r[key]
                    for key in (
                        "batch",
                        "context",
                        "kernels_per_step",
                        "kernel_ms_by_kind",
                        "kernels_by_kind",
                    )
                }
                for r in fused
                if "graph_ms" in r
            ],
        },
    )
    for r in fused:
        if "graph_ms" in r:
            print(
                f"b{r['batch']} c{r['context']}: {r['kernels_per_step']} kernels, ms by kind {r['kernel_ms_by_kind']}"
            )
    for entry in dense_gemm_choice.measurements():
        print("1-4 row gemm", entry)
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="llama-3-8b")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument(
        "--transformers", action="store_true", help="also time transformers (eager, static cache)"
    )
    parser.add_argument(
        "--no-unfused", dest="unfused", action="store_false", help="skip the op-by-op (unfused) engine"
    )
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="bf16 and FP8 engines side by side at batch 1/64/256 (the step ratio, KV tokens, GEMM choices)",
    )
