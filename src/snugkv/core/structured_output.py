"""What a request's output must match (a JSON schema, a regex, a grammar...) and the token mask
that enforces it in one sampling step. Plain data: compiling and matching live in snugkv.structured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The constraint of one request. `spec` is its text, the grammar cache's key: a JSON schema
    serialised with sorted keys, a regex, a JSON list of choices, an EBNF grammar (empty for
    `json_object`: any JSON object)."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; use one of {STRUCTURED_KINDS}")


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    """The tokens allowed at one step for some rows of a batch: bit `t % 32` of
    `bits[i, t // 32]` (int32) is set when token `t` may follow in batch row `rows[i]`. Rows not
    listed are unconstrained. Both tensors are on the logits' device."""

    rows: torch.Tensor  # int64 [n]
    bits: torch.Tensor  # int32 [n, ceil(vocab / 32)]
