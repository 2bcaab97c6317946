"""Write a tiny HF model as a GGUF file the way llama.cpp's converter does (test fixture).

Tensor names follow llama.cpp, `llama`-architecture q/k rows are permuted for its rotary kernel,
matrices are quantized with the types given (each row on its own, so quantization commutes with
the row permutation), llama3 rope scaling becomes a `rope_freqs` tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_BLOCK[module]}.{suffix}"


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation: per head, the two rotary halves become interleaved pairs."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def quantize_roundtrip(weight: np.ndarray, qtype) -> np.ndarray:
    from gguf import quants

    return quants.dequantize(quants.quantize(weight, qtype), qtype).astype(np.float32)


def write_gguf(hf_model, path: Path, arch: str, qtypes) -> dict[str, np.ndarray]:
    """Write `hf_model` to `path`; return the HF-order float32 weights the file dequantizes to.

    Matrices cycle through `qtypes`; 1-D tensors are stored as F32.
    """
    import gguf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    expected: dict[str, np.ndarray] = {}
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "llama3":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        base = 1.0 / (
            config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        )
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    state = {
        k: v
        for k, v in hf_model.state_dict().items()
        if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    for i, (name, tensor) in enumerate(state.items()):
        weight = tensor.float().numpy()
        if weight.ndim == 1 and "proj" not in name:
            stored, qtype = weight, gguf.GGMLQuantizationType.F32
        else:
            qtype = qtypes[i % len(qtypes)] if weight.ndim == 2 else gguf.GGMLQuantizationType.F32
            weight = quantize_roundtrip(weight, qtype) if weight.ndim == 2 else weight
            stored = weight
        expected[name] = stored.copy()
        if arch == "llama" and ".q_proj." in name:
            stored = permute_rotary_rows(stored, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = permute_rotary_rows(stored, config.num_key_value_heads)
        if qtype in (gguf.GGMLQuantizationType.F32,):
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored, dtype=np.float16))
        else:
            from gguf import quants

            writer.add_tensor(
                gguf_name(name), quants.quantize(np.ascontiguousarray(stored), qtype), raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
