"""Mixtral (8x7B, 8x22B): Mistral's attention, a sparse MLP in every layer.

Routing: softmax over `num_local_experts`, the top `num_experts_per_tok`, renormalised to sum to
one. The checkpoint names the block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up), w2 (down); names are read as `mlp.` (as transformers renames them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from snugkv.layers.moe import SparseMoE
from snugkv.models.config import ModelConfig
from snugkv.models.llama import STACKED_PARAMS
from snugkv.models.mistral import MistralForCausalLM
from snugkv.models.moe import MoECausalLM, expert_stacked_params, moe_shape


class MixtralForCausalLM(MoECausalLM, MistralForCausalLM):
    def __init__(self, config: ModelConfig, *, max_position: int | None = None) -> None:
        super().__init__(config, max_position=max_position)
        shape = moe_shape(
            config,
            num_experts_keys=("num_local_experts",),
            intermediate_key="intermediate_size",
            renormalize=True,
        )
        for layer in self.model.layers:
            layer.mlp = SparseMoE(shape, self.tp)
        self.stacked_params = (*expert_stacked_params(shape.num_experts, "w1", "w3", "w2"), *STACKED_PARAMS)

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
