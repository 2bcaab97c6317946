"""GGUF files: config from the metadata, tensors dequantized and renamed to Hugging Face names.

`GGUFFile` (gguf_file.py) reads the file memory-mapped; the `gguf` package dequantizes every type
it knows (F32, F16, BF16, Q4_0, Q4_1, Q8_0, the K-quants, ...) to float32. llama.cpp's converter stores the q/k
projections of `llama`-architecture models with the rows of each head interleaved for its rotary
kernel; `unpermute_rotary_rows` undoes that so the HF rotate-half convention applies. Qwen2/Qwen3
GGUFs are stored unpermuted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from snugkv.models.gguf_file import GGUF_MAGIC, GGUFFile, GGUFFormatError

logger = logging.getLogger(__name__)

# general.architecture -> (HF architecture, model_type, q/k stored permuted)
GGUF_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that carry no weights of the HF model (handled through the config instead).
_CONFIG_TENSORS = {"rope_freqs.weight"}


class GGUFError(ValueError):
    """A GGUF file that snugkv cannot read or run."""


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, with errors that say what the file is instead."""
    if not is_gguf_file(path):
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return GGUFFile(path)
    except GGUFFormatError as exc:
        raise GGUFError(str(exc)) from exc


def _single(value: Any, what: str) -> Any:
    """One value for a per-layer entry that some GGUFs store as an array."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"GGUF {what} differs per layer ({value}); such models are not supported")
        return value[0]
    return value


def config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    """An HF-style config dict from GGUF metadata (parsed by ModelConfig.from_hf)."""
    path, metadata = gguf.path, gguf.metadata
    arch = metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{path} has no general.architecture entry; it is not a model file")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path} holds a {arch!r} model; GGUF architectures supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    architecture, model_type, _ = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise GGUFError(f"{path} lacks the metadata entry {arch}.{key}")
        return value

    tensor_names = {tensor.name for tensor in gguf.tensors}
    num_heads = int(_single(need("attention.head_count"), "head_count"))
    hidden_size = int(need("embedding_length"))
    vocab_size = meta("vocab_size")
    if vocab_size is None and "tokenizer.ggml.tokens" in metadata:
        vocab_size = len(metadata["tokenizer.ggml.tokens"])
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(_single(need("feed_forward_length"), "feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_single(meta("attention.head_count_kv", num_heads), "head_count_kv")),
        "head_dim": int(meta("attention.key_length", hidden_size // num_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    # Biases are not in the metadata: the tensors present say whether the projections have them.
    hf["attention_bias"] = model_type == "qwen2" or "blk.0.attn_q.bias" in tensor_names
    hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        hf["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(meta("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length", 0)) or None,
        }
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1 GGUFs store the llama3 frequency scaling as per-frequency divisors.
        tensor = next(t for t in gguf.tensors if t.name == "rope_freqs.weight")
        hf["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": gguf.dequantize(tensor).tolist()}
    return hf


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (0, 2, 4, .., 1, 3, ..) -> halves."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors that only carry config."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _CONFIG_TENSORS:
        return None
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise GGUFError(f"GGUF tensor {gguf_name!r} has no counterpart in the supported models")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


def iter_gguf_tensors(gguf: GGUFFile, hf_config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of the file, dequantized one at a time."""
    arch = gguf.metadata["general.architecture"]
    permuted = GGUF_ARCHITECTURES[arch][2]
    num_heads, num_kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    for tensor in gguf.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        try:
            weight = torch.from_numpy(gguf.dequantize(tensor))
        except GGUFFormatError as exc:
            raise GGUFError(str(exc)) from exc
        if permuted and ".self_attn.q_proj." in name:
            weight = unpermute_rotary_rows(weight, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = unpermute_rotary_rows(weight, num_kv_heads)
        yield name, weight
