"""The allowed-token mask of a batch's constrained rows: filled on the host, applied to logits.

`fill_token_bitmask` asks each row's matcher which tokens may follow (an int32 bitmask, 32 tokens
a word, xgrammar's layout) and sends it to the device with the row indices; `apply_token_bitmask`
sets every refused token's logit to -inf in those rows only, with plain torch ops that run alike
on CPU and GPU. A batch without constrained rows never reaches this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snugkv.core.structured_output import TokenBitmask
from snugkv.core.transfer import to_device
from snugkv.structured.matcher import RequestGrammar

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def fill_token_bitmask(
    grammars: Sequence[RequestGrammar], rows: Sequence[int], vocab_size: int, device: torch.device
) -> TokenBitmask:
    """The mask of batch rows `rows`, row `rows[i]` constrained by `grammars[i]`."""
    bits = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for index, grammar in enumerate(grammars):
        grammar.fill(bits, index)
    return TokenBitmask(
        rows=to_device(list(rows), torch.int64, device), bits=to_device(bits, torch.int32, device)
    )


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool `[n, vocab_size]`: True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, device=bits.device, dtype=torch.int32)
    allowed = (bits[:, :, None] >> shifts) & 1
    return allowed.reshape(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`logits` with every token a constrained row refuses at -inf (a new tensor; other rows as they were)."""
    allowed = unpack_bitmask(mask.bits, logits.shape[-1])
    masked = logits.clone()
    masked[mask.rows] = logits[mask.rows].masked_fill(~allowed, float("-inf"))
    return masked
