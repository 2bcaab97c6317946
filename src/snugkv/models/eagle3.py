"""An EAGLE-3 draft head (`--speculative eagle --draft-model PATH`), in its published checkpoint layout.

A head is one decoder layer that drafts from the model's own hidden states (Li et al., "EAGLE-3",
arXiv:2503.01840). Its checkpoint (`config.json` with `"architectures": ["LlamaForCausalLMEagle3"]`,
`*.safetensors`) holds:
- `fc.weight` `[hidden, 3 * target hidden]`: fuses the residual stream after three of the model's
  layers (`aux_layer_ids`; by default layers 2, L // 2 and L - 3 of an L-layer model, counted
  from 0, as SGLang takes them; a head's `eagle_config.eagle_aux_hidden_state_layer_ids` names its
  own) into one hidden row;
- `midlayer.*`: a Llama decoder layer whose attention reads `[input_layernorm(embed(token)) ;
  hidden_norm(h)]`, twice the hidden width (`q/k/v_proj` of `2 * hidden` inputs), with its residual
  `h` (or `hidden_norm(h)` where the config says `norm_before_residual`);
- `norm.weight`, `lm_head.weight` `[draft vocab, hidden]` and `d2t` `[draft vocab]`: draft token `i`
  is the model's token `i + d2t[i]` (`t2d`, the inverse as a mask, is not needed).
The token embedding is the model's (`attach_to_model`; so are the rotary settings where the
head's config leaves them out): an `embed_tokens.weight` in the head's
checkpoint is skipped (heads are trained with the model's embedding frozen).

`draft(input_ids, positions, hidden, forward_batch, from_model=...)` runs the layer at the rows'
positions: `hidden` is either the model's three captured states (`from_model`, through `fc`) or the
head's own pre-norm output of the step before, and the call returns (the normed rows for the LM
head, the pre-norm rows for the next step). `compute_logits` gives float32 logits over the model's
vocabulary, -inf outside the draft vocabulary, so sampling and verification never see draft ids.

The head has no KV pool of its own: its one layer is a draft layer of the model's pool
(`DraftKv`), and snugkv.runner.eagle3 decides what it computes where. This module never sizes
anything and never decides what drafts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from snugkv.core.forward import ForwardBatch
from snugkv.distributed.group import TensorParallel
from snugkv.layers.norm import RMSNorm
from snugkv.layers.parallel_linear import ColumnParallelLinear, ParallelLMHead, QKVParallelLinear
from snugkv.layers.rotary import RotaryEmbedding
from snugkv.models.causal_lm import CausalLM, DecoderModel
from snugkv.models.config import ConfigError, ModelConfig
from snugkv.models.llama import STACKED_PARAMS, LlamaAttention, LlamaMLP
from snugkv.models.weights import WeightLoadError, load_named_tensors

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


def is_eagle3(config: ModelConfig) -> bool:
    """Whether `config` is an EAGLE-3 head's."""
    return config.architecture in EAGLE3_ARCHITECTURES


def aux_layer_ids(head: ModelConfig, num_layers: int) -> tuple[int, ...]:
    """The model layers (0-based) after which the head reads the residual stream: the head config's
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else (2, L // 2, L - 3). `ConfigError` when
    they are not three layers of a `num_layers`-layer model."""
    eagle_config = head.hf.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if num_layers < 4:
            raise ConfigError(
                f"an EAGLE-3 head needs a model of 4 layers or more (layers 2, L // 2, L - 3); "
                f"this one has {num_layers}"
            )
        ids = (2, num_layers // 2, num_layers - 3)
    layers = tuple(int(i) for i in ids)
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids {list(layers)} are not three layers of a {num_layers}-layer model"
        )
    return layers


def fitting_layer_ids(head: ModelConfig, model: CausalLM) -> tuple[int, ...]:
    """`aux_layer_ids` of `head` for `model`, once the head is known to fit it: `ConfigError` when
    the model's decoder runs a forward of its own (which captures no states) or its hidden size is
    not the width the head reads and embeds in."""
    if type(model.model).forward is not DecoderModel.forward:
        raise ConfigError(
            f"{model.config.architecture} runs a decoder forward of its own, whose hidden states the "
            "head cannot read yet (Llama, Mistral, Qwen2 and Qwen3 models can)"
        )
    target_hidden = int(head.hf.get("target_hidden_size") or head.hidden_size)
    if target_hidden != model.config.hidden_size or head.hidden_size != model.config.hidden_size:
        raise ConfigError(
            f"the head reads hidden states of width {target_hidden} and embeds tokens in "
            f"{head.hidden_size}; the model's hidden size is {model.config.hidden_size}"
        )
    return aux_layer_ids(head, model.config.num_layers)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: its attention reads the normed embedding and hidden row side by side."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        tp = TensorParallel()
        hidden = config.hidden_size
        self.norm_before_residual = bool(config.hf.get("norm_before_residual", False))
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, 0, rotary_emb, tp, qkv_bias=False, o_bias=False, qk_norm=False
        )
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden, config.head_dim, config.num_heads, config.num_kv_heads, bias=False, tp=tp
        )
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn_out = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(x), residual


class Eagle3Model(DecoderModel):
    """`fc`, the one layer (`layers[0]`, the checkpoint's `midlayer`), the final norm; the embedding
    is the model's (`Eagle3ForCausalLM.attach_to_model`), held outside the module tree so the
    head's parameters, bytes and reloads are its own."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, target_hidden: int) -> None:
        super().__init__()
        bias = bool(config.hf.get("bias", False))
        self.fc = ColumnParallelLinear(
            3 * target_hidden, (config.hidden_size,), bias=bias, tp=TensorParallel()
        )
        self.layers = nn.ModuleList([Eagle3Layer(config, rotary_emb)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._embedding: tuple[nn.Module, float] | None = None

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise TypeError("an EAGLE-3 head drafts from the model's hidden states: call Eagle3ForCausalLM.draft")

    @property
    def layer(self) -> Eagle3Layer:
        layer = self.layers[0]
        assert isinstance(layer, Eagle3Layer)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embedding is None:
            raise RuntimeError("the EAGLE-3 head has no embedding yet (attach_to_model)")
        embedding, scale = self._embedding
        x = embedding(input_ids)
        return x * scale if scale != 1.0 else x


class Eagle3ForCausalLM(CausalLM):
    """An EAGLE-3 head (module docstring). `config.vocab_size` is the model's vocabulary;
    `draft_vocab_size` the LM head's rows (the config's `draft_vocab_size`, else the vocabulary)."""

    stacked_params = STACKED_PARAMS
    model: Eagle3Model
    model_token_ids: torch.Tensor  # draft token i is the model's token model_token_ids[i]

    def __init__(self, config: ModelConfig, *, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = TensorParallel()
        self.max_position = max_position or config.max_position_embeddings
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.rope_parameters,
            self.max_position,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.target_hidden_size = int(config.hf.get("target_hidden_size") or config.hidden_size)
        self.draft_vocab_size = int(config.hf.get("draft_vocab_size") or config.vocab_size)
        if self.draft_vocab_size > config.vocab_size:
            raise ConfigError(
                f"draft_vocab_size {self.draft_vocab_size} is larger than the vocabulary ({config.vocab_size})"
            )
        self.model = Eagle3Model(config, rotary_emb, self.target_hidden_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size, tp=self.tp)
        # draft token i is the model's token model_token_ids[i] (i + d2t[i]); the identity until loaded
        self.register_buffer("model_token_ids", torch.empty(self.draft_vocab_size, dtype=torch.int64))
        self.identity_map = self.draft_vocab_size == config.vocab_size  # until a d2t says otherwise

    def init_buffers(self) -> None:
        self.model_token_ids.copy_(torch.arange(self.draft_vocab_size, device=self.model_token_ids.device))

    def tie_weights(self) -> None:
        pass  # the embedding is the model's, the LM head the head's own

    def attach_to_model(self, model: CausalLM) -> None:
        """Draft with `model`'s token embedding (and its scale), which stays the model's; a head whose
        config names no rotary settings (no `rope_theta`, `rope_parameters` or `rope_scaling`: some
        published heads leave them null) takes the model's. The head must fit it (`fitting_layer_ids`)."""
        self.model._embedding = (model.model.embed_tokens, model.model.embed_scale)
        hf = self.config.hf
        if all(hf.get(key) is None for key in ("rope_theta", "rope_parameters", "rope_scaling")):
            attention = self.model.layer.self_attn
            device = attention.rotary_emb.cos_cache.device
            with torch.device(device):
                attention.rotary_emb = RotaryEmbedding(
                    self.config.head_dim,
                    model.config.rope_parameters,
                    self.max_position,
                    max_position_embeddings=model.config.max_position_embeddings,
                )

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise TypeError("an EAGLE-3 head drafts from the model's hidden states: call draft()")

    def draft(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        forward_batch: ForwardBatch,
        *,
        from_model: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed rows for `compute_logits`, pre-norm rows for the next step) of the rows' tokens at
        their positions; `hidden` is `[rows, 3 * target hidden]` of the model's layers (`from_model`)
        or `[rows, hidden]`, the head's pre-norm output of the step before."""
        if from_model:
            hidden = self.model.fc(hidden)
        x, residual = self.model.layer(positions, self.model.embed(input_ids), hidden, forward_batch)
        return self.model.norm.add_and_norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the model's vocabulary: the draft vocabulary's at their model ids, -inf
        elsewhere (a draft never proposes a token outside it)."""
        draft_logits = self.lm_head(hidden).float()
        if self.identity_map:
            return draft_logits
        logits = draft_logits.new_full((hidden.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, self.model_token_ids] = draft_logits
        return logits

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint"
    ) -> None:
        """The published names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`) into the head; `t2d`
        and an `embed_tokens.weight` are skipped (module docstring)."""
        d2t: list[torch.Tensor] = []

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name == "d2t":
                    d2t.append(tensor)
                    continue
                if name == "t2d" or name.startswith("embed_tokens."):
                    continue
                if name.startswith("midlayer."):
                    name = "layers.0." + name.removeprefix("midlayer.")
                yield (name if name.startswith("lm_head.") else "model." + name), tensor

        layer = self.model.layer
        shard_sizes: dict[str, Sequence[int]] = {
            "qkv_proj": layer.self_attn.qkv_proj.local_sizes,
            "gate_up_proj": layer.mlp.gate_up_proj.local_sizes,
        }
        load_named_tensors(
            self, renamed(), stacked=self.stacked_params, shard_sizes=shard_sizes, source=source
        )
        if d2t:
            offsets = d2t[0].to(torch.int64)
            if offsets.shape != (self.draft_vocab_size,):
                raise WeightLoadError(
                    f"{source}: d2t has shape {tuple(offsets.shape)}; the head's draft vocabulary is "
                    f"{self.draft_vocab_size} tokens"
                )
            ids = torch.arange(self.draft_vocab_size) + offsets
            if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
                raise WeightLoadError(
                    f"{source}: d2t maps draft tokens outside the vocabulary ({self.config.vocab_size})"
                )
            self.model_token_ids.copy_(ids)
            self.identity_map = self.draft_vocab_size == self.config.vocab_size and bool(
                (ids == torch.arange(self.draft_vocab_size)).all()
            )
        elif self.draft_vocab_size != self.config.vocab_size:
            raise WeightLoadError(
                f"{source} has no d2t, but its draft vocabulary ({self.draft_vocab_size} tokens) is not the "
                f"model's ({self.config.vocab_size})"
            )
