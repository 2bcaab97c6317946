"""A ModelRunner over a tiny random Llama (dummy weights) for runner tests."""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

from snugkv.models.loader import load_model
from snugkv.runner.model_runner import ModelRunner
from tests.runner_factory import create_runner

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.2,
    "eos_token_id": 2,
}


@cache
def tiny_config_path() -> Path:
    path = Path(tempfile.mkdtemp(prefix="snugkv-tiny-")) / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def tiny_runner(
    *,
    page_size: int = 1,
    layout: str = "nhd",
    max_total_tokens: int = 512,
    max_requests: int = 8,
    max_context_len: int = 64,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs,
) -> ModelRunner:
    loaded = load_model(tiny_config_path(), load_format="dummy", device=device, dtype=dtype, seed=0)
    return create_runner(
        loaded.model,
        max_total_tokens=max_total_tokens,
        max_requests=max_requests,
        max_context_len=max_context_len,
        page_size=page_size,
        kv_layout=layout,
        **kwargs,
    )
