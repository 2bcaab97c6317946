"""The model shapes the benchmarks run: Hugging Face config.json files shipped inside the package
(`snugkv/bench/configs/NAME/config.json`), so `snugkv bench` finds them from any directory.

`--model` of a benchmark takes a path that exists, or the name of a shipped config (`llama-3-8b`;
the repository-relative `configs/llama-3-8b` of earlier versions still works).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIGS_DIR = Path(__file__).with_name("configs")


def shipped_configs() -> list[str]:
    return sorted(path.parent.name for path in CONFIGS_DIR.glob("*/config.json"))


def benchmark_model(value: str) -> str:
    """A `--model` value as a path: the path itself if it exists, else the shipped config of that name."""
    path = Path(value).expanduser()
    if path.exists():
        return str(path)
    shipped = CONFIGS_DIR / path.name
    if (shipped / "config.json").is_file():
        return str(shipped)
    raise argparse.ArgumentTypeError(
        f"{value}: no such file or directory, and no shipped config of that name "
        f"(shipped: {', '.join(shipped_configs())})"
    )


def write_tiny_llama_config(directory: Path, context_length: int, vocab_size: int) -> str:
    """A one-layer Llama config.json in `directory` (random weights: `--load-format dummy`), for the
    benchmarks that stub the forward and measure the host."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context_length,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return str(path)
