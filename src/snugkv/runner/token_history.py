"""Each request's earlier tokens as penalties and `min_tokens` read them, kept on the device.

Per row of the request-to-token table: a mask of the tokens its prompt holds, how often each token
was generated, and how many were. A request's row is set from the host when it is prefilled (its
prompt, and the tokens it had generated before a retraction), then every sampling step adds the
sampled tokens on the device (`record`), so with overlapped scheduling the counts are current
without the host reading any token. The buffers (`[table rows, vocab]`, int32 and bool) are
allocated when a request first needs them; a server whose requests use no penalty never has them.
This module never decides which rows use them: the runner records only batches that have such a row,
and a row is set again whenever a request takes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snugkv.core.transfer import to_device
from snugkv.layers.sampler import TokenRows


class TokenHistory:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.output_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    @property
    def vocab_size(self) -> int:
        return int(self.output_counts.shape[1])

    def start(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Set table row `row` for a request with this prompt and these tokens generated so far."""
        device = self.output_counts.device
        self.prompt_mask[row] = False
        self.prompt_mask[row, to_device(list(prompt_ids), torch.int64, device)] = True
        self.output_counts[row] = 0
        if output_ids:
            outputs = to_device(list(output_ids), torch.int64, device)
            self.output_counts[row].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        self.output_lens[row] = len(output_ids)

    def rows(self, req_pool_indices: torch.Tensor) -> TokenRows:
        """The batch's rows (a gather on the device)."""
        return TokenRows(
            output_counts=self.output_counts[req_pool_indices],
            prompt_mask=self.prompt_mask[req_pool_indices],
            output_lens=self.output_lens[req_pool_indices],
        )

    def record(self, req_pool_indices: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count `tokens[i]`, just sampled, for the request in row `req_pool_indices[i]`."""
        # index_add_ on the flat buffer: atomic adds, with no sort and no wait for the stream
        flat = req_pool_indices * self.vocab_size + tokens
        self.output_counts.view(-1).index_add_(0, flat, torch.ones_like(tokens, dtype=torch.int32))
        self.output_lens.index_add_(0, req_pool_indices, torch.ones_like(tokens))

    def record_emitted(
        self, req_pool_indices: torch.Tensor, token_ids: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """Count the first `counts[i]` of `token_ids[i]` (a verify step's emitted tokens, padded
        with -1) for the request in row `req_pool_indices[i]`."""
        kept = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :] < counts[:, None]
        flat = req_pool_indices[:, None] * self.vocab_size + token_ids.clamp_min(0)
        self.output_counts.view(-1).index_add_(0, flat.flatten(), kept.flatten().to(torch.int32))
        self.output_lens.index_add_(0, req_pool_indices, counts)
