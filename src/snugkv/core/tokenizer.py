"""The one tokenizer type every layer takes: text <-> token ids of one model, and its chat template.

`snugkv.models.tokenizer.Tokenizer` is the implementation (Hugging Face files or a GGUF's
tables, through transformers); the server tests' byte tokenizer is another. Nothing here loads
a tokenizer; loading is the models layer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the scheduler (stop strings, detokenizing, structured output), the server (prompts,
    chat templates, token-id checks) and the Python API use of a model's tokenizer."""

    # The Hugging Face tokenizer underneath: a chat template that takes more than the messages
    # (tools) and xgrammar's tokenizer info read it directly.
    hf: Any
    eos_token_ids: frozenset[int]

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def decode_batch(
        self, sequences: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each sequence (one call: the server detokenizes a turn's streams at once)."""
        ...

    def encode_chat(
        self, messages: Sequence[dict[str, str]] | str, *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` (or one user message) formatted with the model's chat template."""
        ...
