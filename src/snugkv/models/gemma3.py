"""Gemma 3 (text): local sliding-window layers interleaved with global ones.

What sets it apart from Llama: embeddings scaled by sqrt(hidden), RMSNorms whose scale is
`1 + weight` (layers.norm.GemmaRMSNorm), an RMSNorm over each q and k head, four norms per layer
(around both the attention and the MLP), attention scaled by `query_pre_attn_scalar ** -0.5`,
a different RoPE for local and global layers, and optional tanh soft-capping of the final logits.
The sliding-window layers make runner/kv_cache.py give the model the hybrid SWA pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from snugkv.core.forward import ForwardBatch
from snugkv.distributed.group import TensorParallel, current_tensor_parallel
from snugkv.layers.attention import PagedAttention
from snugkv.layers.norm import GemmaRMSNorm
from snugkv.layers.parallel_linear import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from snugkv.layers.rotary import RotaryEmbedding
from snugkv.models.causal_lm import CausalLM, DecoderModel
from snugkv.models.config import ConfigError, ModelConfig, normalize_rope_parameters
from snugkv.models.llama import STACKED_PARAMS, LlamaMLP

# transformers' defaults when a config leaves a layer type's theta out.
GLOBAL_ROPE_THETA = 1_000_000.0
LOCAL_ROPE_THETA = 10_000.0


def gemma3_rope_parameters(config: ModelConfig) -> dict[str, dict[str, Any]]:
    """RoPE parameters per layer kind: `{"full_attention": {...}, "sliding_attention": {...}}`.

    transformers >= 5 writes them per layer type; older configs have `rope_theta` (+ `rope_scaling`)
    for the global layers and `rope_local_base_freq` for the local ones, which never scale.
    """
    params: Mapping[str, Any] = config.rope_parameters
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = normalize_rope_parameters(
            {**config.hf, "rope_theta": config.hf.get("rope_theta", GLOBAL_ROPE_THETA)}
        )
        local = {"rope_theta": config.hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
    for kind, theta in ((full, GLOBAL_ROPE_THETA), (local, LOCAL_ROPE_THETA)):
        kind["rope_type"] = kind.get("rope_type") or kind.pop("type", None) or "default"
        kind.setdefault("rope_theta", theta)
    return {"full_attention": full, "sliding_attention": local}


def check_gemma3_config(config: ModelConfig) -> None:
    hf = config.hf
    if hf.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            f"attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported: transformers' Gemma 3 "
            "ignores it and snugkv's attention backends do not cap scores; set it to null"
        )
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention=true (an embedding model) is not supported; snugkv decodes causally"
        )


class Gemma3Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.attention_bias,
            tp=tp,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_bias, tp=tp
        )
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            config.head_dim,
            scaling=float(config.hf["query_pre_attn_scalar"]) ** -0.5,
            sliding_window=config.sliding_windows[layer_id],
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        out = self.attn.forward_qkv(
            self.qkv_proj(x),
            positions,
            self.rotary_emb,
            forward_batch,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
        )
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TensorParallel
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, layer_id, rotary_emb, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sandwich norms, each residual add fused into the norm after it: `x` is the previous
        layer's post-feedforward-normed output."""
        if residual is None:
            hidden, residual = self.input_layernorm(x), x
        else:
            hidden, residual = self.input_layernorm.add_and_norm(x, residual)
        attn_out = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(
            attn_out, residual, pre_norm=self.post_attention_layernorm
        )
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(DecoderModel):
    def __init__(self, config: ModelConfig, max_position: int, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        # The reference multiplies by sqrt(hidden) rounded to the weight dtype (55.4256 -> 55.5 in bf16).
        dtype = self.embed_tokens.weight.dtype
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype, device="cpu"))
        rope = gemma3_rope_parameters(config)
        rotary = {
            kind: RotaryEmbedding(
                config.head_dim, params, max_position, max_position_embeddings=config.max_position_embeddings
            )
            for kind, params in rope.items()
        }
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config, i, rotary["sliding_attention" if window is not None else "full_attention"], tp
            )
            for i, window in enumerate(config.sliding_windows)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    """`forward` returns the final hidden states `[T, hidden]`; `compute_logits` projects rows of them."""

    supports_tensor_parallel = True
    stacked_params = STACKED_PARAMS
    ignored_weights = ("rotary_emb.inv_freq", "embed_scale")

    def __init__(self, config: ModelConfig, *, max_position: int | None = None) -> None:
        super().__init__()
        check_gemma3_config(config)
        self.config = config
        self.tp = tp = current_tensor_parallel()
        self.max_position = max_position or config.max_position_embeddings
        self.final_logit_softcapping: float | None = config.hf.get("final_logit_softcapping")
        self.model = Gemma3Model(config, self.max_position, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        self.tie_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[n, vocab]` for hidden rows `[n, hidden]`, soft-capped if the config says so."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
