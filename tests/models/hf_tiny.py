"""Tiny random Hugging Face models of each supported architecture, saved as real checkpoints.

Weights are redrawn larger than HF's default init (so greedy margins are far above float32
noise) and biases and norm scales are randomised too, so every parameter matters.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "deepseek_v2",
    "deepseek_v2_q_lora",
    "qwen3_moe",
    "mixtral",
    "deepseek_v2_moe",
    "deepseek_v2_moe_grouped",
)
VOCAB_SIZE = 320


def tiny_hf_config(arch: str, **overrides):
    config = _tiny_hf_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _tiny_hf_config(arch: str):
    from transformers import (
        DeepseekV2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":  # llama3 rope scaling; o_proj bias through attention_bias
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**common, rope_parameters=rope, attention_bias=True)
    if arch == "mistral":  # sliding window on every layer, shorter than the test sequences
        return MistralConfig(**common, sliding_window=12)
    if arch == "qwen2":  # q/k/v bias; the second layer slides (hybrid windows)
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=10, max_window_layers=1)
    if arch == "qwen3":  # q/k norm, head_dim != hidden / heads, tied embeddings
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "gemma3":
        # Two local layers, then a global one; the window is shorter than the test sequences.
        # head_dim, query_pre_attn_scalar and the two rope thetas all differ, so mixing them up shows.
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=10,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
            final_logit_softcapping=5.0,
        )
    if arch == "qwen3_moe":
        # Three layers, the middle one dense (mlp_only_layers); 8 experts, top-2, renormalised.
        return Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if arch == "mixtral":  # 4 experts, top-2, and Mistral's sliding window
        return MixtralConfig(
            **{**common, "intermediate_size": 48},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
        )
    if arch in ("deepseek_v2_moe", "deepseek_v2_moe_grouped"):
        # V2-Lite's layout: a dense first layer, then MoE layers with two shared experts. The grouped
        # one routes like V2 (group-limited top-k, a scaling factor) with queries through q_lora.
        moe = dict(
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=2,
            moe_intermediate_size=24,
            num_experts_per_tok=3,
        )
        common = {**common, "num_key_value_heads": 4, "num_hidden_layers": 3}
        if arch == "deepseek_v2_moe":
            return DeepseekV2Config(**common, **moe, q_lora_rank=None, topk_method="greedy")
        return DeepseekV2Config(
            **common,
            **moe,
            q_lora_rank=48,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        )
    if arch in ("deepseek_v2", "deepseek_v2_q_lora"):
        # MLA with dense MLPs only (every layer is below first_k_dense_replace).
        mla = dict(
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2
        )
        common = {**common, "num_key_value_heads": 4}
        if arch == "deepseek_v2":
            return DeepseekV2Config(**common, **mla, q_lora_rank=None)
        # Low-rank queries, biases, and YaRN with mscale_all_dim (which also scales the softmax).
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        }
        return DeepseekV2Config(**common, **mla, q_lora_rank=48, attention_bias=True, rope_parameters=rope)
    raise ValueError(arch)


def tiny_hf_model(arch: str, seed: int = 0, config=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or tiny_hf_config(arch), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return model.eval()


def save_tiny_hf_model(arch: str, directory: Path, seed: int = 0):
    model = tiny_hf_model(arch, seed)
    model.save_pretrained(directory)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_new_tokens: int) -> list[int]:
    """Greedy continuation by full recomputation each step (no cache: the plainest oracle)."""
    ids = list(prompt)
    for _ in range(num_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]
