"""The Llama decoder, and the family members that differ from it only by switches.

Llama 2/3 and Mistral use it as is (Mistral through its per-layer sliding windows), Qwen2 adds a
bias to q/k/v (qwen2.py), Qwen3 adds an RMSNorm over each q/k head before rotary (qwen3.py).
Module names mirror Hugging Face's so checkpoints load by name; q/k/v and gate/up are merged
into one matmul each and filled slice by slice at load time.

Tensor parallelism: the model reads the current `TensorParallel` once, when it is built, and hands
it to its parallel layers (snugkv.layers.parallel_linear): attention heads and MLP rows split over
ranks, the embedding and the LM head split over the vocabulary. At tp=1 those are plain layers.
"""

from __future__ import annotations

import torch
from torch import nn

from snugkv.core.forward import ForwardBatch
from snugkv.distributed.group import TensorParallel, current_tensor_parallel
from snugkv.layers.activation import GatedActivation
from snugkv.layers.attention import PagedAttention
from snugkv.layers.norm import RMSNorm
from snugkv.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from snugkv.layers.rotary import RotaryEmbedding
from snugkv.models.causal_lm import CausalLM, DecoderModel, PreNormDecoderLayer
from snugkv.models.config import ModelConfig
from snugkv.models.weights import StackedParam

STACKED_PARAMS: tuple[StackedParam, ...] = (
    StackedParam("q_proj", "qkv_proj", 0),
    StackedParam("k_proj", "qkv_proj", 1),
    StackedParam("v_proj", "qkv_proj", 2),
    StackedParam("gate_proj", "gate_up_proj", 0),
    StackedParam("up_proj", "gate_up_proj", 1),
)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()  # other architectures reuse this MLP unsharded
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, (config.intermediate_size,) * 2, bias=config.mlp_bias, tp=tp
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, tp=tp
        )
        self.act = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        tp: TensorParallel,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, bias=qkv_bias, tp=tp
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=o_bias, tp=tp
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            config.head_dim,
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


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        tp: TensorParallel,
        **attn_switches: bool,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, tp, **attn_switches)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)


class LlamaModel(DecoderModel):
    def __init__(
        self, config: ModelConfig, rotary_emb: RotaryEmbedding, tp: TensorParallel, **attn_switches: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, tp, **attn_switches) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """`forward` returns the final hidden states `[T, hidden]`; `compute_logits` projects rows of them.

    Subclasses change the switches below; everything else is shared.
    """

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm = False
    supports_tensor_parallel = True
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, *, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = current_tensor_parallel()
        self.max_position = max_position or config.max_position_embeddings
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.rope_parameters,
            self.max_position,
            max_position_embeddings=config.max_position_embeddings,
        )
        switches = {
            "qkv_bias": config.attention_bias if self.qkv_bias is None else self.qkv_bias,
            "o_bias": config.attention_bias if self.o_bias is None else self.o_bias,
            "qk_norm": self.qk_norm,
        }
        self.model = LlamaModel(config, rotary_emb, tp, **switches)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        self.tie_weights()
