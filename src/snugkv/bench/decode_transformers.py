"""transformers' decode step time for `bench decode`, run as a child process.

`python -m snugkv.bench.decode_transformers MODEL_DIR '[[batch, context], ...]' [dynamic]` prints one JSON
line: the path used (static cache, else dynamic cache) and the median step time per case.
Random bf16 weights of the config's shape, eager model, greedy step on random token ids.
"""

from __future__ import annotations

import json
import sys

import torch

from snugkv.bench.harness import time_cuda


def build(model: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return config, hf.eval()


def step_ms(hf, config, batch: int, context: int, static: bool) -> float:
    from transformers import DynamicCache, StaticCache

    ids = torch.randint(10, config.vocab_size, (batch, context), device="cuda")
    cache = StaticCache(config=config, max_cache_len=context + 64) if static else DynamicCache()
    with torch.no_grad():
        hf(ids, past_key_values=cache, use_cache=True)
        step_ids = torch.randint(10, config.vocab_size, (batch, 1), device="cuda")
        position = [context]

        def step() -> None:
            hf(
                step_ids,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([min(position[0], context + 63)], device="cuda"),
            )
            position[0] += 1

        return time_cuda(step, iterations=10, warmup=2) * 1e3


def main() -> None:
    model, cases = sys.argv[1], [tuple(case) for case in json.loads(sys.argv[2])]
    config, hf = build(model)
    dynamic = len(sys.argv) > 3 and sys.argv[3] == "dynamic"
    path, timings = ("dynamic cache, eager" if dynamic else "static cache, eager"), []
    for batch, context in cases:
        try:
            timings.append(
                (batch, context, step_ms(hf, config, batch, context, static=path.startswith("static")))
            )
        except torch.OutOfMemoryError:
            timings.append((batch, context, float("nan")))
        except Exception as exc:  # static cache unsupported here: fall back once, say so
            if not path.startswith("static"):
                raise
            print(
                f"static cache failed ({type(exc).__name__}: {exc}); using the dynamic cache", file=sys.stderr
            )
            path = "dynamic cache, eager"
            timings.append((batch, context, step_ms(hf, config, batch, context, static=False)))
        torch.cuda.empty_cache()
    print(json.dumps({"path": path, "timings": timings}))


if __name__ == "__main__":
    main()
