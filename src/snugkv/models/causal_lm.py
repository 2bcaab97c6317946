"""`CausalLM` and `DecoderModel`: what the modules of every architecture share.

An architecture sets `config`, a decoder `model` (a `DecoderModel`: embedding, layers, final norm)
that maps (input ids, positions, forward batch) to the final hidden states `[T, hidden]`, and an
`lm_head`; `CausalLM` ties the head to the embedding when the config says so and turns hidden rows
into float32 logits. The runner only calls `forward` and `compute_logits`, so it never needs to
know which architecture it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from snugkv.core.forward import ForwardBatch
from snugkv.distributed.group import TensorParallel
from snugkv.layers.norm import RMSNorm
from snugkv.layers.parallel_linear import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding
from snugkv.memory.weight_arena import WeightArena
from snugkv.models.config import ModelConfig
from snugkv.models.weights import StackedParam, load_named_tensors


class PreNormDecoderLayer(nn.Module):
    """Input norm, attention, post-attention norm, MLP (Llama, Mistral, Qwen, DeepSeek-V2): each
    residual add runs inside the norm after it (`RMSNorm.add_and_norm`), the last one in the next
    layer's input norm. `x` is the previous layer's output; returns this layer's and the residual."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: nn.Module

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(x), x
        else:
            hidden, residual = self.input_layernorm.add_and_norm(x, residual)
        attn_out = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding (times `embed_scale`), the decoder layers in order, the final norm.

    Each layer is called as `layer(positions, hidden, residual, forward_batch)` and returns
    `(hidden, residual)`: the residual add of a layer's last sublayer is deferred to the next norm,
    which does it in the same kernel (`RMSNorm.add_and_norm`); the first layer gets `residual=None`.
    """

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleList
    norm: RMSNorm
    embed_scale: float = 1.0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """`num_layers`: run only the first that many layers before the final norm (a layer-skip
        draft, snugkv.runner.draft_steps); None: all of them."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        residual: torch.Tensor | None = None
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            x, residual = layer(positions, x, residual, forward_batch)
        if residual is None:
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]


class CausalLM(nn.Module):
    config: ModelConfig
    model: DecoderModel
    lm_head: ParallelLMHead
    tp: TensorParallel
    supports_tensor_parallel = False  # True where the layers are built from snugkv.layers.parallel_linear
    stacked_params: tuple[StackedParam, ...] = ()  # checkpoint tensors merged into one parameter
    ignored_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)  # checkpoint tensors computed here
    max_position: int  # positions the rotary caches were built for (the most a context can hold)
    weight_arena: WeightArena | None = None  # where the parameters live when placed in virtual memory

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads per layer this rank caches (what the KV pool holds): with tensor parallelism a
        rank keeps its share, or the one head its query heads read when there are fewer than ranks."""
        return self.tp.kv_heads(self.config.num_heads, self.config.num_kv_heads)[1]

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, forward_batch, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[n, vocab]` for hidden rows `[n, hidden]`."""
        return self.lm_head(hidden).float()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint"
    ) -> None:
        """Checkpoint tensors into this rank's parameters; stacked parts are split by the sizes
        the merged layer keeps on this rank (the same in every layer)."""
        ignore = list(self.ignored_weights)
        if self.config.tie_word_embeddings:
            ignore.append("lm_head.weight")
        targets = {param.target for param in self.stacked_params}
        shard_sizes: dict[str, Sequence[int]] = {
            name.rsplit(".", 1)[-1]: module.local_sizes
            for name, module in self.model.layers[0].named_modules()
            if name.rsplit(".", 1)[-1] in targets and isinstance(module, ColumnParallelLinear)
        }
        load_named_tensors(
            self, weights, stacked=self.stacked_params, shard_sizes=shard_sizes, ignore=ignore, source=source
        )
