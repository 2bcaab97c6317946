"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, sparse MLPs in most layers.

A layer is MoE unless it is listed in `mlp_only_layers` or `decoder_sparse_step` skips it (layer i
is sparse when `(i + 1) % decoder_sparse_step == 0`), as transformers builds it; the other layers
keep a dense MLP of `intermediate_size`. Routing: softmax top-k over `num_experts`, renormalised
when `norm_topk_prob` is set; every expert has `moe_intermediate_size`.
"""

from __future__ import annotations

from snugkv.layers.moe import SparseMoE
from snugkv.models.config import ConfigError, ModelConfig
from snugkv.models.llama import STACKED_PARAMS
from snugkv.models.moe import MoECausalLM, expert_stacked_params, moe_shape, need_int
from snugkv.models.qwen3 import Qwen3ForCausalLM


def qwen3_moe_layers(config: ModelConfig) -> list[bool]:
    """Which layers have a sparse MLP."""
    hf = config.hf
    step = int(hf.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step must be at least 1, got {step}")
    dense = set(hf.get("mlp_only_layers") or ())
    experts = need_int(config, "num_experts", "num_local_experts")
    return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(config.num_layers)]


class Qwen3MoeForCausalLM(MoECausalLM, Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, *, max_position: int | None = None) -> None:
        if config.hf.get("use_sliding_window"):
            raise ConfigError(
                "this Qwen3-MoE config sets use_sliding_window, which snugkv does not run for Qwen3-MoE; "
                "set it to false (the published Qwen3-MoE configs do)"
            )
        super().__init__(config, max_position=max_position)
        shape = moe_shape(
            config,
            num_experts_keys=("num_experts", "num_local_experts"),
            intermediate_key="moe_intermediate_size",
            renormalize=bool(config.hf.get("norm_topk_prob")),
        )
        for layer, sparse in zip(self.model.layers, qwen3_moe_layers(config)):
            if sparse:
                layer.mlp = SparseMoE(shape, self.tp)
        self.stacked_params = (
            *expert_stacked_params(shape.num_experts, "gate_proj", "up_proj", "down_proj"),
            *STACKED_PARAMS,
        )
