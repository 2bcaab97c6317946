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

    `capture_aux_states(layer_ids, rows)` makes every forward also write the residual stream after
    each of those layers into `aux_states` (`[rows, len(layer_ids) * hidden]`, one static buffer, so
    a CUDA graph's replay writes it too; an EAGLE-3 head drafts from it): row t holds token t's.
    A forward of more tokens than `rows` writes a buffer of its own instead (`aux_output`).
    """

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleList
    norm: RMSNorm
    embed_scale: float = 1.0
    aux_columns: dict[int, tuple[int, ...]] | None = None  # captured layer -> its column blocks in aux_states
    aux_states: torch.Tensor | None = None
    aux_overflow: torch.Tensor | None = None  # the last forward's states when it outgrew aux_states

    def capture_aux_states(self, layer_ids: Sequence[int], rows: int) -> None:
        """Capture the residual stream after `layer_ids` (0-based) from the next forward on, into a
        buffer of `rows` tokens (made once: graphs captured after it keep writing it)."""
        self.aux_columns = {
            layer: tuple(column for column, other in enumerate(layer_ids) if other == layer)
            for layer in layer_ids
        }
        weight = self.norm.weight
        self.aux_states = torch.zeros(
            rows, len(layer_ids) * weight.shape[0], dtype=weight.dtype, device=weight.device
        )

    def aux_output(self, num_tokens: int) -> torch.Tensor:
        """The captured states of the last forward's `num_tokens` tokens."""
        if self.aux_states is None:
            raise RuntimeError("this model captures no hidden states (capture_aux_states)")
        if num_tokens <= self.aux_states.shape[0]:
            return self.aux_states[:num_tokens]
        if self.aux_overflow is None or self.aux_overflow.shape[0] != num_tokens:
            raise RuntimeError(f"the last forward did not capture {num_tokens} tokens' states")
        return self.aux_overflow

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
        columns = self.aux_columns if num_layers is None else None
        aux = None if columns is None else self._aux_buffer(x.shape[0])
        for index, layer in enumerate(layers):
            x, residual = layer(positions, x, residual, forward_batch)
            if aux is not None and columns is not None and index in columns:
                width = x.shape[-1]
                stream = x if residual is None else x + residual
                for column in columns[index]:
                    aux[:, column * width : (column + 1) * width].copy_(stream)
        if residual is None:
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]

    def _aux_buffer(self, num_tokens: int) -> torch.Tensor:
        assert self.aux_states is not None
        if num_tokens <= self.aux_states.shape[0]:
            self.aux_overflow = None
            return self.aux_states[:num_tokens]
        self.aux_overflow = self.aux_states.new_empty(num_tokens, self.aux_states.shape[1])
        return self.aux_overflow


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
