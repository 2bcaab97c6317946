"""What the HTTP server needs from the engine, and nothing more.

The server validates and translates requests into `GenerateInput`s, then streams
`GenerateOutput`s back (both in snugkv.core). It never touches pools, allocators or the model:
the async engine (the scheduler thread and its runner) implements `EngineClient`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from snugkv.core.outputs import GenerateInput, GenerateOutput


class EngineClient(Protocol):
    model_name: str
    max_context_tokens: int
    tokenizer: Any  # a transformers tokenizer with a chat template

    def generate(self, request: GenerateInput) -> AsyncIterator[GenerateOutput]:
        """Stream outputs for one request; cancelling the iterator aborts the request."""
        ...

    def abort(self, rid: str) -> None: ...

    def server_info(self) -> dict[str, Any]:
        """max_total_num_tokens, sizing mode, memory ledger, key arguments."""
        ...

    def check_health(self) -> bool: ...
