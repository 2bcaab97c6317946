"""`snugkv bench serving`: offline throughput and online latency on the small-engine workload.

Offline: 256 requests, input and output lengths uniform in [100, 1024], random prompt ids,
`ignore_eos`, all submitted at once, side by side on one engine: straight to a scheduler of the
benchmark's own with overlapped scheduling and without it, with prefill-only steps (no decode rows
in a prefill step: `--disable-mixed-steps`), and through `LLM.generate` (the Python API, the same
scheduler behind it); then through a real `snugkv serve` and the openai client.
`gpu_idle_fraction` is 1 - (time the GPU spent in steps, from CUDA events around each) / wall time:
the share of the run the GPU waited for the host.
Online: Poisson arrivals at several rates, with mixed steps and prefill-only ones; TTFT and TPOT
percentiles. Then a side-by-side
subset with one fixed output length through snugkv and through transformers' own continuous
batching (`generate_batch`), since that API takes one generation config. The bandwidth floor
reads every weight once per decode step plus every active request's KV.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

import torch

from snugkv.bench.harness import copy_bandwidth_bytes_per_s, cuda_missing, emit, latency_columns
from snugkv.bench.idle import gc_figures, step_figures
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.gc_pauses import GC_PAUSES
from snugkv.core.sampling import SamplingParams


def workload(
    count: int, seed: int, vocab: int, low: int = 100, high: int = 1024, fixed_output: int | None = None
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(10, vocab) for _ in range(rng.randint(low, high))],
            fixed_output or rng.randint(low, high),
        )
        for _ in range(count)
    ]


def floor_tokens_per_s(
    requests: list[tuple[list[int], int]],
    weight_bytes: int,
    kv_bytes_per_token: float,
    bandwidth: float,
    max_batch: int,
) -> float:
    """Output tokens over the time to read weights once per step and each active request's KV."""
    active = sorted(((len(prompt), output) for prompt, output in requests), key=lambda item: item[1])
    seconds, waves = 0.0, [active[i : i + max_batch] for i in range(0, len(active), max_batch)]
    for wave in waves:
        for step in range(max(output for _, output in wave)):
            live = [(prompt, output) for prompt, output in wave if output > step]
            seconds += (
                weight_bytes + sum(prompt + step for prompt, _ in live) * kv_bytes_per_token
            ) / bandwidth
    return sum(output for _, output in requests) / seconds


def offline_bound(
    requests: list[tuple[list[int], int]],
    *,
    params: float,
    weight_bytes: float,
    kv_bytes_per_token: float,
    attention_width: int,
    layers: int,
    bandwidth: float,
    flops: float,
) -> dict[str, float]:
    """The least time any engine can take over `requests` (prompt, output length) all sent at once,
    on a device of `bandwidth` bytes/s and `flops` dense FLOP/s: every prompt prefilled at `flops`
    (2 x params a token, and causal attention's 2 x 2 x `attention_width` x n^2 / 2 a layer), then
    decode steps with every unfinished request in one batch, each the longer of reading the weights
    once and its GEMMs' 2 x params FLOPs a row, plus reading each row's KV. Nothing else counts (norms,
    sampling, the host, launches): an engine reaches it only at both peaks at once."""
    prompts = [len(prompt) for prompt, _ in requests]
    outputs = [output for _, output in requests]
    prefill_s = sum(2 * params * n + 2 * attention_width * layers * n * n for n in prompts) / flops
    decode_s = 0.0
    for step in range(max(outputs, default=0)):
        live = [prompt for prompt, output in zip(prompts, outputs) if output > step]
        gemm_s = max(weight_bytes / bandwidth, 2 * params * len(live) / flops)
        decode_s += gemm_s + sum(prompt + step for prompt in live) * kv_bytes_per_token / bandwidth
    total_s = prefill_s + decode_s
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "output_tok_per_s": sum(outputs) / total_s if total_s else 0.0,
    }


def run_scheduler(
    engine: Any,
    requests: list[tuple[list[int], int]],
    arrivals: list[float] | None = None,
    overlap: bool = True,
    tokenizer: Any = None,
    mixed: bool = True,
) -> dict[str, Any]:
    from snugkv.driver.commands import Add
    from snugkv.driver.engine_core import EngineCore

    finished: dict[str, float] = {}
    core = EngineCore.around(
        engine,
        tokenizer=tokenizer,
        on_output=lambda r, o: finished.__setitem__(o.rid, time.monotonic()) if o.finished else None,
        overlap=overlap,
    )
    scheduler = core.scheduler
    scheduler.mixed = mixed
    tracked = []
    gc_before = GC_PAUSES.as_dict()
    start = time.monotonic()
    scheduler.times.reset()
    pending = list(enumerate(requests))

    def arrive(steps: int) -> bool:
        """Submit the requests whose arrival time passed (all at once offline); with nothing to
        run, wait a millisecond. Says whether any is still to come."""
        now = time.monotonic()
        while pending and (arrivals is None or start + arrivals[pending[0][0]] <= now):
            index, (prompt, output) = pending.pop(0)
            sampling = SamplingParams(max_new_tokens=output, temperature=0.0, ignore_eos=True)
            (request,) = core.submit([Add(f"q{index}", prompt, sampling)])
            if arrivals is not None:
                request.arrival_s = start + arrivals[index]
            tracked.append(request)
        if not core.has_work:
            time.sleep(0.001)
        return bool(pending)

    core.run(intake=arrive)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    times = scheduler.times.as_dict(elapsed)
    output_tokens = sum(len(r.output_ids) for r in tracked)
    first_token = {r.rid: r.first_token_s or finished[r.rid] for r in tracked}
    ttft = [first_token[r.rid] - r.arrival_s for r in tracked]
    tpot = [(finished[r.rid] - first_token[r.rid]) / max(len(r.output_ids) - 1, 1) for r in tracked]
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    return {
        "requests": len(tracked),
        "output_tokens": output_tokens,
        "seconds": elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        **latency_columns(ttft, tpot),
        "retractions": scheduler.num_retractions,
        "overlap": "on" if overlap else "off",
        "mixed_steps": "on" if mixed else "off",
        "gpu_idle_fraction": times["device_idle_fraction"],
        "host_wait_s": times["host_wait_s"],
        "overlapped_steps": f"{times['overlapped_steps']}/{times['steps']}",
        **step_figures(list(scheduler.times.records), start, start + elapsed),
        **gc_figures(gc_before, GC_PAUSES.as_dict()),
    }


def run_llm(llm: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """The offline case through `LLM.generate`: the same figures as `run_scheduler`, from the
    requests' own times."""
    params = [
        SamplingParams(max_new_tokens=output, temperature=0.0, ignore_eos=True) for _, output in requests
    ]
    retractions = llm.stats()["num_retractions"]
    start = time.monotonic()
    outputs = llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    output_tokens = sum(output.completion_tokens for output in outputs)
    ttft = [output.times.time_to_first_token_s for output in outputs]
    tpot = [
        (output.times.finished_s - output.times.first_token_s) / max(output.completion_tokens - 1, 1)
        for output in outputs
    ]
    llm.reset_prefix_cache()  # the next case starts from an empty cache, as run_scheduler's do
    return {
        "requests": len(outputs),
        "output_tokens": output_tokens,
        "seconds": elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        **latency_columns(ttft, tpot),
        "retractions": llm.stats()["num_retractions"] - retractions,
    }


def transformers_generate_batch(model: str, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation import GenerationConfig

    config = AutoConfig.from_pretrained(model)
    errors = []
    for implementation in ("paged|sdpa", "sdpa_paged"):
        try:
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(
                config, dtype=torch.bfloat16, attn_implementation=implementation
            )
            hf = hf.to("cuda").eval()
            generation = GenerationConfig(
                max_new_tokens=requests[0][1], do_sample=False, eos_token_id=-1, pad_token_id=0
            )
            start = time.monotonic()
            outputs = hf.generate_batch(
                inputs=[prompt for prompt, _ in requests], generation_config=generation, progress_bar=False
            )
            torch.cuda.synchronize()
            elapsed = time.monotonic() - start
            tokens = sum(len(output.generated_tokens) for output in outputs.values())
            del hf
            return {
                "attn_implementation": implementation,
                "output_tokens": tokens,
                "seconds": elapsed,
                "output_tok_per_s": tokens / elapsed,
            }
        except Exception as exc:  # report what failed instead of a number
            errors.append(f"{implementation}: {type(exc).__name__}: {str(exc)[:200]}")
            gc.collect()
            torch.cuda.empty_cache()
    return {"error": " | ".join(errors)}


def bench_llm(args: argparse.Namespace) -> Any:
    """The `LLM` the serving benches run on: `--model`'s shape with random weights, graphs up to
    `--max-batch`, prefill chunks of `--chunk`."""
    from snugkv.llm import LLM

    return LLM(
        args.model,
        load_format="dummy",
        max_running_requests=args.max_batch,
        cuda_graph_max_bs=args.max_batch,
        chunked_prefill_size=args.chunk,
    )


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench serving"):
        return 2
    bandwidth = copy_bandwidth_bytes_per_s()
    llm = bench_llm(args)
    engine = llm.engine  # the scheduler-direct cases run on the LLM's engine, one at a time
    vocab = engine.config.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    kv_per_token = engine.pool.bytes_per_token
    run_scheduler(engine, workload(16, seed=1, vocab=vocab, low=64, high=128))  # warm-up: Triton compiles
    rows, extra = (
        [],
        {
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "max_total_num_tokens": engine.report.max_total_num_tokens,
        },
    )
    offline = workload(args.requests, seed=0, vocab=vocab)
    floor = floor_tokens_per_s(offline, weight_bytes, kv_per_token, bandwidth, args.max_batch)
    for name, result in (
        ("snugkv (overlap)", run_scheduler(engine, offline)),
        ("snugkv LLM.generate", run_llm(llm, offline)),
        ("snugkv (no overlap)", run_scheduler(engine, offline, overlap=False)),
        ("snugkv (prefill-only steps)", run_scheduler(engine, offline, mixed=False)),
    ):
        rows.append(
            {
                "engine": name,
                "case": f"offline {args.requests} req, in/out U[100,1024]",
                **result,
                "floor_tok_per_s": floor,
                "fraction_of_floor": result["output_tok_per_s"] / floor,
            }
        )
    overlapped, through_llm, synchronous, prefill_only = (row["output_tok_per_s"] for row in rows[-4:])
    extra["llm_generate_over_scheduler_direct"] = through_llm / overlapped
    extra["overlap_speedup"] = overlapped / synchronous
    extra["mixed_steps_speedup"] = overlapped / prefill_only
    for rate in args.rates:
        online = workload(args.online_requests, seed=int(rate * 10), vocab=vocab)
        rng = random.Random(int(rate))
        arrivals, clock = [], 0.0
        for _ in online:
            clock += rng.expovariate(rate)
            arrivals.append(clock)
        for name, mixed in (("snugkv", True), ("snugkv (prefill-only steps)", False)):
            rows.append(
                {
                    "engine": name,
                    "case": f"online Poisson {rate} req/s, {args.online_requests} req",
                    **run_scheduler(engine, online, arrivals, mixed=mixed),
                }
            )
    fixed = workload(args.compare_requests, seed=2, vocab=vocab, fixed_output=args.compare_output)
    rows.append(
        {
            "engine": "snugkv",
            "case": f"compare: {args.compare_requests} req, out={args.compare_output}",
            **run_scheduler(engine, fixed),
        }
    )
    del engine
    llm.close()  # weights, graphs and the KV arena go before the server or transformers load
    if args.http:
        from snugkv.bench.serving_http import run_http

        flags = ["--max-running-requests", str(args.max_batch), "--cuda-graph-max-bs", str(args.max_batch)]
        flags += ["--chunked-prefill-size", str(args.chunk)]
        try:
            http = run_http(args.model, offline, flags)
        except Exception as exc:  # the in-process rows above still count
            http = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "output_tok_per_s": float("nan")}
        rows.append(
            {
                "engine": "snugkv serve (HTTP, httpx client)",
                "case": f"offline {args.requests} req, in/out U[100,1024]",
                **http,
                "floor_tok_per_s": floor,
                "fraction_of_floor": http["output_tok_per_s"] / floor,
            }
        )
        extra["http_over_in_process"] = http["output_tok_per_s"] / overlapped
    if args.transformers:
        hf = transformers_generate_batch(args.model, fixed)
        rows.append(
            {
                "engine": "transformers generate_batch",
                "case": f"compare: {args.compare_requests} req, out={args.compare_output}",
                **hf,
            }
        )
        if "output_tok_per_s" in hf:
            extra["snugkv_over_transformers"] = rows[-2]["output_tok_per_s"] / hf["output_tok_per_s"]
    emit("serving", rows, args.out, extra=extra)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--online-requests", type=int, default=128)
    parser.add_argument("--rates", type=float, nargs="*", default=[8.0, 32.0])
    parser.add_argument("--compare-requests", type=int, default=64)
    parser.add_argument("--compare-output", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--no-transformers", dest="transformers", action="store_false")
    parser.add_argument(
        "--no-http", dest="http", action="store_false", help="skip the case through a real snugkv serve"
    )
