"""The physical bound of the offline load that `snugkv bench peers` and `bench http` send (256
requests, prompt and output lengths uniform in [100, 1024], seed 0), for a shipped shape in bf16 on
a device of given bandwidth and FLOP/s (`snugkv.bench.serving.offline_bound`: prefill at the FLOP
rate, then decode steps each the longer of one weight read and its GEMMs, plus the rows' KV reads).

    python scripts/offline_bound.py --shape llama-3-8b --bandwidth-tb-s 3.35 --tflops 989 [--measured 7198]

The device figures are the caller's (a datasheet's peaks, or what a copy and a large GEMM reach on
the card); `--measured` tok/s prints each figure's fraction of the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from snugkv.bench.serving import offline_bound, workload

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "snugkv" / "bench" / "configs"
BYTES = 2  # bf16 weights and KV


def shape_figures(shape: str) -> dict[str, float]:
    """Parameters, KV bytes a token and attention width of a shipped dense shape's config.json."""
    config = json.loads((CONFIGS / shape / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter
    # the GEMMs' weights: every layer's and the LM head (the embedding table is read a row a token)
    params = layers * per_layer + vocab * hidden
    return {
        "params": params,
        "weight_bytes": BYTES * params,
        "kv_bytes_per_token": BYTES * 2 * layers * kv_heads * head_dim,
        "attention_width": heads * head_dim,
        "layers": layers,
    }


def dense_shapes() -> list[str]:
    """The shipped shapes this bound's arithmetic covers: dense GEMMs and plain KV heads (no experts, no
    latent attention, no draft heads)."""
    shapes = []
    for path in sorted(CONFIGS.glob("*/config.json")):
        config = json.loads(path.read_text())
        moe = any(k in config for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        if not moe and "kv_lora_rank" not in config and "draft_vocab_size" not in config:
            shapes.append(path.parent.name)
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", default="llama-3-8b", help="a shipped dense shape (src/snugkv/bench/configs)"
    )
    parser.add_argument("--bandwidth-tb-s", type=float, required=True)
    parser.add_argument("--tflops", type=float, required=True, help="dense bf16 TFLOP/s")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--measured", type=float, nargs="*", default=[], help="output tok/s to set beside it")
    args = parser.parse_args(argv)
    dense = dense_shapes()
    if args.shape not in dense:
        parser.error(f"--shape {args.shape!r} is not a shipped dense shape; one of: {', '.join(dense)}")
    requests = workload(args.requests, seed=0, vocab=500)  # the lengths the HTTP client draws
    figures = shape_figures(args.shape)
    bound = offline_bound(requests, **figures, bandwidth=args.bandwidth_tb_s * 1e12, flops=args.tflops * 1e12)
    result = {
        "shape": args.shape,
        "bandwidth_tb_s": args.bandwidth_tb_s,
        "tflops": args.tflops,
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(o for _, o in requests),
        **{k: round(v, 3) for k, v in bound.items()},
        "measured": [
            {"output_tok_per_s": m, "fraction_of_bound": round(m / bound["output_tok_per_s"], 3)}
            for m in args.measured
        ],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
