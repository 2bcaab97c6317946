"""The model's own tokenizer and chat template (Hugging Face files or the GGUF's embedded tables).

transformers builds the tokenizer: `AutoTokenizer.from_pretrained(dir)` for a model directory,
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` for a GGUF. Converting a GGUF's 49k-entry
tables takes seconds, so the converted tokenizer is saved once under the cache directory, keyed by
the file's path, size and modification time, and loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from snugkv.models.default_model import cache_dir
from snugkv.models.loader import ModelSource

logger = logging.getLogger(__name__)


class TokenizerUnavailable(ValueError):
    """The model ships no tokenizer (e.g. a bare config for random weights)."""


class Tokenizer:
    """Text <-> token ids, chat formatting and the stop tokens of one model."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    def with_eos_token_ids(self, eos_token_ids: Iterable[int]) -> Tokenizer:
        """The same tokenizer that also stops at `eos_token_ids` (a model's extra EOS ids)."""
        return Tokenizer(self.hf, (*self.eos_token_ids, *eos_token_ids))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, sequences: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each sequence, in one call of the Rust tokenizer where its text is the same
        (no clean-up of tokenization spaces): the call releases the GIL and decodes in parallel,
        5x faster than a loop of `decode` for 512 short windows on a CI CPU."""
        backend = getattr(self.hf, "_tokenizer", None)
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]
        return list(
            backend.decode_batch([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens)
        )

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            raise TokenizerUnavailable("this model has no chat template; drop --chat and pass the raw prompt")
        return self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(
        self, messages: Sequence[dict[str, str]] | str, *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` (or one user message) formatted with the model's chat template."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        # The template already wrote the special tokens (BOS included where the model uses one).
        return self.encode(text, add_special_tokens=False)


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


# The class transformers saves a converted GGUF tokenizer as (5.x, 4.x): plain fast tokenizers.
_PLAIN_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _load_directory_tokenizer(directory: Path) -> Any:
    """A tokenizer directory's: a plain fast tokenizer (Llama 3's, a converted GGUF's) loads through
    its own class, which AutoTokenizer would pick too, without AutoTokenizer's reading of the model's
    config class first (transformers' model registry, torch.distributed.tensor and sympy: 1.2 s on a
    warm CI CPU for a 128k-vocab Llama 3 directory, against 0.16 s); any other class through
    AutoTokenizer."""
    try:
        saved_class = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        saved_class = None
    if saved_class in _PLAIN_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _load_gguf_tokenizer(path: Path) -> Any:
    cached = cache_dir() / "tokenizers" / _gguf_cache_key(path)
    if cached.is_dir():
        try:
            return _load_directory_tokenizer(cached)
        except (OSError, ValueError) as exc:
            logger.warning("Rebuilding the cached tokenizer at %s (%s)", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    logger.info("Building the tokenizer from %s (cached for next time)", path.name)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (struct.error, ValueError, KeyError, IndexError) as exc:  # transformers' own GGUF reader
        raise TokenizerUnavailable(
            f"{path}: transformers cannot read the tokenizer in this GGUF ({type(exc).__name__}: {exc}); "
            "is the file complete?"
        ) from exc
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=cached.parent, prefix="partial-"))
        tokenizer.save_pretrained(str(scratch))
        os.replace(scratch, cached)
    except OSError as exc:  # a read-only cache only costs the next start some seconds
        logger.warning("Could not cache the tokenizer at %s: %s", cached, exc)
    return tokenizer


def load_tokenizer(source: ModelSource, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
    """The tokenizer of a model source; raises TokenizerUnavailable when it ships none."""
    if source.kind == "gguf":
        return Tokenizer(_load_gguf_tokenizer(source.path), extra_eos_token_ids)
    directory = source.path if source.path.is_dir() else source.path.parent
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((directory / name).is_file() for name in names):
        raise TokenizerUnavailable(
            f"{directory} has no tokenizer files ({', '.join(names)}); pass token ids instead of text"
        )
    return Tokenizer(_load_directory_tokenizer(directory), extra_eos_token_ids)
