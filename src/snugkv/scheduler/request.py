"""A request inside the scheduler: its tokens, its slots, its stop conditions, its text.

Slot ownership along the request's row of the request-to-token table:
`[0, prefix_len)` are prefix-cache slots (locked through `prefix_node`), `[prefix_len, kv_len)`
are slots the request allocated itself. `kv_len` tokens have KV in the pool; the last sampled
token never does until the next step computes it. Positions `[kv_len, kv_len + in_flight)` belong
to steps launched but not read back yet (overlapped scheduling): their slots are the request's,
and their KV counts only once the host has read the step (a failed or discarded step's is freed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from snugkv.core.sampling import SamplingParams
from snugkv.scheduler.radix_cache import TreeNode
from snugkv.speculative.drafter import RowDrafter
from snugkv.structured.matcher import RequestGrammar


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_node: TreeNode | None = None
    prefix_len: int = 0
    kv_len: int = 0
    in_flight: int = 0  # tokens of launched steps not read back yet: their slots lie past kv_len
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # structured output: its place in the grammar
    drafter: RowDrafter | None = None  # speculative decoding: its proposer and acceptance
    finish_reason: str | None = None
    error: str | None = None
    retry_after_s: float | None = None  # it waited for KV memory in vain: a 503, try again after this
    aborted: bool = False
    retractions: int = 0
    seq: int = 0  # arrival order in its scheduler (the same on every tensor-parallel rank)
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    # incremental detokenization
    text: str = ""
    stopped_by_string: bool = False  # `text` is already cut at the stop string
    sent_text_len: int = 0
    sent_token_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list[Any] = field(default_factory=list)
    sent_logprobs_len: int = 0
    # a `TokenLogprob` per prompt position scored so far (position 0 has none: None), when asked
    prompt_logprobs: list[Any] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def scores_prompt(self) -> bool:
        """The request asked for its prompt's log-probabilities and some are not computed yet: its
        prefill must compute every prompt position (no prefix-cache hit: a cached prefix has no logits)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def launched_len(self) -> int:
        """Positions whose KV is computed or on its way (steps launched, not read back yet): where
        the next step of this request starts, and how many slots it holds."""
        return self.kv_len + self.in_flight

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_admitted(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def table_row(self) -> int:
        """The request's row of the request-to-token table (it must be admitted)."""
        if self.req_pool_idx is None:
            raise RuntimeError(f"request {self.rid} holds no table row: it is not admitted")
        return self.req_pool_idx
