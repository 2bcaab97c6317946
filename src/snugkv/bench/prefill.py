"""`snugkv bench prefill`: one prefill step against its compute floor, piecewise graphs beside eager.

For the Llama-3-8B and Qwen3-0.6B shapes (bf16, random weights), a batch of N requests with
T prompt tokens in all is prefilled in one step. The floor is the weight GEMMs' work,
2 x parameters x tokens FLOPs at the H200's dense bf16 rate (790 TFLOP/s; attention excluded).
Each case runs through the piecewise CUDA graphs (what the engine uses) and fully eagerly (every
kernel launched from Python), in the same process.

A mixture-of-experts shape (`--model qwen3-30b-a3b`) counts its active parameters: a routed
expert's weights `top_k / E` of the time (models.moe.parameter_counts), the router, attention,
dense layers and the LM head whole; its prompts are random tokens, a different sequence per
request, so tokens spread over the experts as real prompts do.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from snugkv.bench.harness import DENSE_BF16_FLOPS, cuda_missing, emit, time_cuda
from snugkv.bench.model_configs import benchmark_model
from snugkv.layers.moe import SparseMoE
from snugkv.models.moe import parameter_counts

CASES = {
    "llama-3-8b": ((8192, 1), (8192, 8), (2048, 4), (512, 4)),
    "qwen3-0.6b": ((8192, 1), (8192, 16), (2048, 4), (512, 4)),
    "qwen3-30b-a3b": ((8192, 8), (2048, 4)),
}


def _cases(model_name: str, cases: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    from snugkv.core.forward import BatchRow
    from snugkv.engine import Engine, EngineArgs

    engine = Engine(
        EngineArgs.of(
            model=benchmark_model(model_name),
            load_format="dummy",
            max_running_requests=64,
            cuda_graph_max_bs=64,
            chunked_prefill_size=8192,
            # a small KV cache: the fully eager comparison needs the memory its activations take
            # (the engine itself never runs an 8192-token step eagerly once the graphs exist)
            max_total_tokens=65536,
        )
    )
    runner = engine.runner
    assert runner is not None
    net = engine.loaded.model
    embedding = net.model.embed_tokens.weight.numel()
    params = sum(p.numel() for name, p in net.named_parameters() if "embed_tokens" not in name)
    moe = any(isinstance(module, SparseMoE) for module in net.modules())
    if moe:  # the embedding counted as the dense shapes count it: out, unless it is the LM head too
        params = parameter_counts(net)[1] - (0 if net.config.tie_word_embeddings else embedding)
    prompts = torch.Generator().manual_seed(0)
    rows_out = []
    for tokens, requests in cases:
        per_request = tokens // requests
        table_rows = [runner.req_to_token_pool.alloc() for _ in range(requests)]
        rows = [
            BatchRow(
                row,
                0,
                torch.randint(3, net.config.vocab_size, (per_request,), generator=prompts).tolist()
                if moe
                else [1 + i % 1000 for i in range(per_request)],
            )
            for row in table_rows
            if row is not None
        ]
        slots = runner.allocate_slots(rows)
        if slots is None or len(rows) != requests:
            rows_out.append(
                {"model": model_name, "tokens": tokens, "requests": requests, "note": "does not fit"}
            )
            continue
        batch = runner.build_batch(rows, slots)
        with torch.inference_mode():
            piecewise_s = time_cuda(lambda b=batch: runner.forward_batch(b), iterations=10, warmup=2)
            eager_s = time_cuda(lambda b=batch: runner.forward_eager(b), iterations=5, warmup=1)
        floor_s = 2 * params * tokens / DENSE_BF16_FLOPS
        rows_out.append(
            {
                "model": model_name,
                "tokens": tokens,
                "requests": requests,
                "floor_ms": floor_s * 1e3,
                "piecewise_ms": piecewise_s * 1e3,
                "piecewise_over_floor": piecewise_s / floor_s,
                "eager_ms": eager_s * 1e3,
                "eager_over_floor": eager_s / floor_s,
                "tokens_per_s": tokens / piecewise_s,
                "active_params_b": params / 1e9,
            }
        )
        for row in table_rows:
            if row is not None:
                runner.free_request_slots(row, per_request)
                runner.req_to_token_pool.free(row)
    engine.close()
    return rows_out


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench prefill"):
        return 2
    started = time.perf_counter()
    rows = []
    for model_name in args.models.split(","):
        if model_name not in CASES:
            print(
                f"error: bench prefill has no cases for {model_name!r}; it has {', '.join(CASES)}",
                file=sys.stderr,
            )
            return 2
        rows += _cases(model_name, CASES[model_name])
        torch.cuda.empty_cache()
    emit(
        "prefill",
        rows,
        args.out,
        extra={
            "seconds": time.perf_counter() - started,
            "peak_flops": DENSE_BF16_FLOPS,
            "moe_configs": os.environ.get("SNUGKV_MOE_CONFIGS", "defaults"),
        },
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        "--model",
        dest="models",
        default="llama-3-8b,qwen3-0.6b",
        help=f"comma-separated: {', '.join(CASES)}",
    )
