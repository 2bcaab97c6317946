"""A separate draft model (`--speculative draft --draft-model PATH`) or an EAGLE-3 head
(`--speculative eagle --draft-model PATH`): found, checked against the model and loaded beside it,
and the shape of its KV per token.

The draft is a second `CausalLM` of its own weights, in the model's dtype on the model's device,
loaded as the model is (a GGUF file or a model directory; `--load-format dummy` gives it random
weights too), with a weight arena of its own where the model has one (post-capture), so sleep can
release it with the model's. Before any weight is read its vocabulary is checked: the same number
of tokens as the model's, and, where both ship a tokenizer, the same tokens; a mismatch is one line
naming the flag (`InvalidEngineArgs`). Its KV goes into the model's pool as layers of their own at
the same slots (`draft_kv_shape`, `MHAKVPool`'s `draft`).

This module never sizes the KV cache, never runs a forward and never decides what drafts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.engine.args import EngineArgs, InvalidEngineArgs
from snugkv.memory.kv_pool import DraftKvShape
from snugkv.memory.vmm import VirtualMemory
from snugkv.models.config import ConfigError, ModelConfig
from snugkv.models.eagle3 import fitting_layer_ids, is_eagle3
from snugkv.models.loader import (
    LoadedModel,
    ModelLoadError,
    ModelSource,
    load_model,
    read_model_config,
    resolve_model_source,
)
from snugkv.models.tokenizer import TokenizerUnavailable, load_tokenizer

logger = logging.getLogger(__name__)


def draft_path(args: EngineArgs) -> str | None:
    """The `--draft-model` path when it names a separate draft model, None otherwise."""
    speculative = args.speculative
    if speculative is None or not speculative.separate_draft:
        return None
    return speculative.draft_model


def find_draft_source(args: EngineArgs, tp: TensorParallel) -> ModelSource | None:
    """Where the separate draft model is (None: there is none), checked before the model loads:
    `InvalidEngineArgs` naming the flag when the path is nothing loadable or under `--tp`."""
    path = draft_path(args)
    if path is None:
        return None
    if tp.enabled:
        raise InvalidEngineArgs(
            f"--draft-model {path}: a separate draft model with --tp {tp.world_size} is not built yet; "
            "run it with --tp 1, or use --draft-model layers:N or self"
        )
    if not Path(path).expanduser().exists():
        raise InvalidEngineArgs(
            f"--draft-model {path}: no such file or directory; pass a .gguf file or a model directory "
            "(config.json + *.safetensors), or layers:N or self"
        )
    load_format = "dummy" if args.load.load_format == "dummy" else "auto"
    try:
        return resolve_model_source(path, load_format)
    except ModelLoadError as exc:
        raise InvalidEngineArgs(f"--draft-model {path}: {exc}") from None


def load_draft_model(
    args: EngineArgs,
    name: str,
    source: ModelSource,
    target: LoadedModel,
    *,
    context_length: int,
    weights_memory: VirtualMemory | None,
    tp: TensorParallel,
) -> LoadedModel:
    """The draft model of `source` (`--draft-model name`) in `target`'s dtype on its device, holding
    `context_length` positions; its vocabulary is checked before its weights load."""
    path = str(source.path)
    try:
        config = read_model_config(source)
    except ModelLoadError as exc:
        raise InvalidEngineArgs(f"--draft-model {name}: {exc}") from None
    check_vocabulary(name, config, source, target)
    check_kind(args, name, config, target)
    if config.hf.get("kv_lora_rank"):
        raise InvalidEngineArgs(
            f"--draft-model {name}: a draft with latent (MLA) attention is not "
            "built yet; use a draft with multi-head or grouped-query attention"
        )
    with use_tensor_parallel(tp):
        return load_model(
            path,
            load_format="dummy" if args.load.load_format == "dummy" else "auto",
            dtype=target.dtype,
            device=target.device,
            seed=args.load.weights_seed,
            max_position=context_length,
            weights_memory=weights_memory,
        )


def check_kind(args: EngineArgs, name: str, draft: ModelConfig, target: LoadedModel) -> None:
    """`InvalidEngineArgs` (one line naming the flag) when an EAGLE-3 head goes with anything but
    `--speculative eagle`, or anything else with it, or the head does not fit the model."""
    eagle = args.speculative is not None and args.speculative.method == "eagle"
    if is_eagle3(draft) != eagle:
        raise InvalidEngineArgs(
            f"--draft-model {name}: it is an EAGLE-3 head ({draft.architecture}); use --speculative eagle"
            if not eagle
            else f"--draft-model {name}: {draft.architecture} is not an EAGLE-3 head (LlamaForCausalLMEagle3); "
            "use --speculative draft for a draft model"
        )
    if not eagle:
        return
    try:
        fitting_layer_ids(draft, target.model)
    except ConfigError as exc:
        raise InvalidEngineArgs(f"--draft-model {name}: {exc}") from None


def check_vocabulary(name: str, draft: ModelConfig, source: ModelSource, target: LoadedModel) -> None:
    """`InvalidEngineArgs` (one line naming the flag) when the draft's vocabulary is not the model's:
    a different token count, or, where both ship a tokenizer, different tokens."""
    if draft.vocab_size != target.config.vocab_size:
        raise InvalidEngineArgs(
            f"--draft-model {name}: its vocabulary has {draft.vocab_size} tokens, the model's "
            f"{target.config.vocab_size}; a draft model must share the model's vocabulary"
        )
    if source.path.resolve() == target.source.path.resolve():
        return  # the same files: the same tokenizer
    try:
        draft_vocab = load_tokenizer(source).hf.get_vocab()
        target_vocab = load_tokenizer(target.source).hf.get_vocab()
    except TokenizerUnavailable:
        return  # one of them ships none (random weights on a config): the token count is all there is
    if draft_vocab != target_vocab:
        differing = sum(1 for token, index in draft_vocab.items() if target_vocab.get(token) != index)
        raise InvalidEngineArgs(
            f"--draft-model {name}: its tokenizer maps {differing} tokens differently from the model's; "
            "a draft model must share the model's tokenizer"
        )


def draft_kv_shape(draft: LoadedModel) -> DraftKvShape:
    """The draft's KV per token, as the pool lays it out beside the model's."""
    return DraftKvShape(draft.config.num_layers, draft.model.num_kv_heads_per_rank, draft.config.head_dim)


def weights_bytes(loaded: LoadedModel | None) -> int:
    """Bytes of a model's parameters (0 for none)."""
    if loaded is None:
        return 0
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters())
