"""One request's place in its grammar: an xgrammar matcher fed every token the request accepts.

Tokens are fed once each, in order, from the request's output (`advance`): the scheduler may feed
a token as soon as it reaches the host (to fill the next step's mask) and again when it reads the
step, and the second time is a no-op. A token the grammar refuses (it cannot happen when the mask
was applied) marks the matcher `rejected`; the grammar's end, reached by a stop token, marks it
`terminated`. `close` drops the matcher with its request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from snugkv.structured.grammars import xgrammar


class RequestGrammar:
    def __init__(self, compiled_grammar: Any) -> None:
        self._matcher: Any = xgrammar().GrammarMatcher(compiled_grammar)
        self.accepted = 0  # leading tokens of the request's output fed to the matcher
        self.rejected_token: int | None = None

    @property
    def terminated(self) -> bool:
        """The grammar ended (a stop token was accepted): no token may follow."""
        return self._matcher is None or bool(self._matcher.is_terminated())

    @property
    def rejected(self) -> bool:
        return self.rejected_token is not None

    def advance(self, output_ids: Sequence[int]) -> None:
        """Feed the tokens of `output_ids` past those already fed; stops at a refused token."""
        while self.accepted < len(output_ids) and not self.rejected and not self.terminated:
            token = output_ids[self.accepted]
            if not self._matcher.accept_token(token):
                self.rejected_token = token
                return
            self.accepted += 1

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` := the tokens that may come next (all of them once ended, as
        such a row's token is never read)."""
        if not self.terminated and not self.rejected:
            self._matcher.fill_next_token_bitmask(bitmask, index)

    def close(self) -> None:
        self._matcher = None
