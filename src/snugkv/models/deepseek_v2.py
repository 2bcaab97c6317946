"""DeepSeek-V2 and V2-Lite: multi-head latent attention (MLA), dense then mixture-of-experts MLPs.

MLA compresses each token's keys and values into one latent row shared by all heads:
`c = kv_a_layernorm(kv_a_proj(x)[:kv_lora_rank])` plus a rotary key `k_pe` of `qk_rope_head_dim`.
Head h's key is `[W_UK[h] c, k_pe]` and its value `W_UV[h] c`, with W_UK/W_UV the two row blocks
of `kv_b_proj`. The model attends in the absorbed form, so only the latent is cached:
- the pool (memory/mla_pool.py) stores `[c, k_pe]`, one row of `kv_lora_rank + qk_rope_head_dim`
  per token, as a single KV head;
- each query head's `q_nope` is mapped into latent space, `W_UK[h]^T q_nope`, and concatenated
  with its rotated `q_pe`, so `q . key` over the latent row equals the expanded dot product;
- the values are the latent's first `kv_lora_rank` columns, and the attention output (a latent
  vector per head) is mapped back by `W_UV[h]` before `o_proj`.
The attention op therefore sees num_kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim and
v_head_dim = kv_lora_rank, scaled by the expanded head dim's `(qk_nope + qk_rope) ** -0.5`.
RoPE rotates interleaved pairs (transformers' complex-number form), not halves.

MLPs: the first `first_k_dense_replace` layers are dense (`intermediate_size`); from there every
`moe_layer_freq`-th layer is MoE (snugkv.layers.moe): `n_routed_experts` experts of
`moe_intermediate_size`, softmax scores computed in float32, greedy or group-limited top-k
(`topk_method`, `n_group`, `topk_group`), weights times `routed_scaling_factor` (or renormalised,
with `norm_topk_prob`: DeepSeek's own modeling code does one or the other), plus
`n_shared_experts` shared experts as one dense MLP of `n_shared_experts * moe_intermediate_size`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from snugkv.core.forward import ForwardBatch
from snugkv.distributed.group import TensorParallel, current_tensor_parallel
from snugkv.layers.attention import PagedAttention
from snugkv.layers.moe import MoEShape, SparseMoE
from snugkv.layers.norm import RMSNorm
from snugkv.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from snugkv.layers.rotary import RotaryEmbedding, yarn_mscale
from snugkv.models.causal_lm import DecoderModel, PreNormDecoderLayer
from snugkv.models.config import ConfigError, ModelConfig
from snugkv.models.llama import LlamaMLP
from snugkv.models.moe import MoECausalLM, expert_stacked_params, moe_shape
from snugkv.models.weights import StackedParam

STACKED_PARAMS: tuple[StackedParam, ...] = (
    StackedParam("gate_proj", "gate_up_proj", 0),
    StackedParam("up_proj", "gate_up_proj", 1),
)
TOPK_METHODS = ("greedy", "group_limited_greedy")
LATENT_NORM_EPS = 1e-6  # the reference builds q_a_layernorm/kv_a_layernorm without rms_norm_eps


@dataclass(frozen=True, slots=True)
class MLADims:
    kv_lora_rank: int
    q_lora_rank: int | None  # None: queries come from one q_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, config: ModelConfig) -> MLADims:
        """The MLA sizes of a DeepSeek-V2 config."""
        hf = config.hf

        def need(key: str) -> int:
            if not hf.get(key):
                raise ConfigError(f"config for {config.architecture} is missing {key!r}")
            return int(hf[key])

        q_lora_rank = hf.get("q_lora_rank")
        return cls(
            kv_lora_rank=need("kv_lora_rank"),
            q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
        )


def mla_softmax_scale(dims: MLADims, rope_parameters: Mapping[str, Any]) -> float:
    """`qk_head_dim ** -0.5`, times YaRN's `mscale(factor, mscale_all_dim) ** 2` when the config has it."""
    scale = dims.qk_head_dim**-0.5
    mscale_all_dim = rope_parameters.get("mscale_all_dim")
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim:
        mscale = yarn_mscale(float(rope_parameters["factor"]), float(mscale_all_dim))
        scale = scale * mscale * mscale
    return scale


def deepseek_moe_shape(config: ModelConfig) -> MoEShape | None:
    """The MoE layers' shape, or None for a config without MoE layers."""
    hf = config.hf
    if not hf.get("n_routed_experts") or not any(deepseek_moe_layers(config)):
        return None
    method = hf.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ConfigError(
            f"topk_method {method!r} is not supported; snugkv runs {' and '.join(TOPK_METHODS)}"
        )
    if (hf.get("scoring_func") or "softmax") != "softmax":
        raise ConfigError(f"scoring_func {hf['scoring_func']!r} is not supported; snugkv runs softmax")
    top_k = int(hf.get("num_experts_per_tok") or 0)
    renormalize = bool(hf.get("norm_topk_prob")) and top_k > 1
    scale = float(hf.get("routed_scaling_factor") or 1.0)
    if renormalize and scale != 1.0:
        raise ConfigError(
            f"norm_topk_prob with routed_scaling_factor={scale}: DeepSeek-V2's code renormalises and "
            "then ignores the factor, other implementations apply it; set one of the two"
        )
    grouped = method == "group_limited_greedy"
    return moe_shape(
        config,
        num_experts_keys=("n_routed_experts",),
        intermediate_key="moe_intermediate_size",
        renormalize=renormalize,
        scale=1.0 if renormalize else scale,
        num_groups=int(hf.get("n_group") or 1) if grouped else 1,
        topk_groups=int(hf.get("topk_group") or 1) if grouped else 1,
        router_float32=True,
        shared_intermediate_size=int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"]),
    )


def deepseek_moe_layers(config: ModelConfig) -> list[bool]:
    hf = config.hf
    first, every = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
    return [i >= first and i % every == 0 for i in range(config.num_layers)]


class DeepseekV2Attention(nn.Module):
    """Tensor parallel: query heads (q, kv_b, o) split over ranks; the low-rank down-projections
    and so the latent (the one KV "head") stay whole, and every rank caches all of it."""

    def __init__(
        self,
        config: ModelConfig,
        dims: MLADims,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.num_heads = heads = tp.split(config.num_heads, "num_attention_heads")  # this rank's
        hidden, bias = config.hidden_size, config.attention_bias
        all_heads = config.num_heads
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, (all_heads * dims.qk_head_dim,), bias=False, tp=tp)
        else:
            self.q_a_proj = nn.Linear(hidden, dims.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                dims.q_lora_rank, (all_heads * dims.qk_head_dim,), bias=False, tp=tp
            )
        self.kv_a_proj_with_mqa = nn.Linear(hidden, dims.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            dims.kv_lora_rank, (all_heads * (dims.qk_nope_head_dim + dims.v_head_dim),), bias=False, tp=tp
        )
        self.o_proj = RowParallelLinear(all_heads * dims.v_head_dim, hidden, bias=bias, tp=tp)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(
            layer_id,
            heads,
            1,
            dims.latent_dim,
            scaling=mla_softmax_scale(dims, config.rope_parameters),
            v_head_dim=dims.kv_lora_rank,
        )

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        dims, heads, num_tokens = self.dims, self.num_heads, x.shape[0]
        q = self._queries(x).reshape(num_tokens, heads, dims.qk_head_dim)
        q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split(
            [dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1
        )
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.reshape(num_tokens, 1, dims.qk_rope_head_dim))
        latent = torch.cat((self.kv_a_layernorm(compressed).unsqueeze(1), k_pe), dim=-1)

        kv_b = self.kv_b_proj.weight.view(heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
        w_uk, w_uv = kv_b.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=1)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # q_nope . (W_UK c) == (W_UK^T q_nope) . c
        # The latent is the one KV head: keys are whole rows, values their first kv_lora_rank columns.
        out_latent = self.attn(
            torch.cat((q_latent, q_pe), dim=-1), latent, latent[..., : dims.kv_lora_rank], forward_batch
        )
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv)
        return self.o_proj(out.reshape(num_tokens, heads * dims.v_head_dim))


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        dims: MLADims,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        tp: TensorParallel,
        moe: MoEShape | None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV2Attention(config, dims, layer_id, rotary_emb, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp) if moe is None else SparseMoE(moe, tp)


class DeepseekV2Model(DecoderModel):
    def __init__(
        self, config: ModelConfig, dims: MLADims, max_position: int, tp: TensorParallel, moe: MoEShape | None
    ) -> None:
        super().__init__()
        rotary_emb = RotaryEmbedding(
            dims.qk_rope_head_dim,
            config.rope_parameters,
            max_position,
            neox_style=False,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        sparse = deepseek_moe_layers(config)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, dims, i, rotary_emb, tp, moe if moe and sparse[i] else None)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(MoECausalLM):
    """`forward` returns the final hidden states `[T, hidden]`; `compute_logits` projects rows of them."""

    supports_tensor_parallel = True
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, *, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = current_tensor_parallel()
        self.dims = MLADims.from_config(config)
        self.max_position = max_position or config.max_position_embeddings
        moe = deepseek_moe_shape(config)
        self.model = DeepseekV2Model(config, self.dims, self.max_position, tp, moe)
        if moe is not None:
            self.stacked_params = (
                *expert_stacked_params(moe.num_experts, "gate_proj", "up_proj", "down_proj"),
                *STACKED_PARAMS,
            )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        self.tie_weights()

    @property
    def num_kv_heads_per_rank(self) -> int:
        """One latent per token, whole on every rank (the latent pool has no head count)."""
        return 1
