"""A minimal offline generate loop over a ModelRunner: the reference loop of the tests.

Serving, the CLI and the benchmarks go through `snugkv.scheduler` (chunked prefill, prefix cache, retraction);
this loop stays small on purpose and is the one place that runs prefill and decode rows in the
same forward, which keeps mixed batches tested end to end.

Every step runs one mixed batch: the prompts admitted this step (whole-prompt prefill rows) plus
one decode row per running request. A request is admitted when a table row is free and the pool
has room for its prompt, its whole token budget and a partial page, so decode never runs out of
slots. It finishes on a stop token (EOS unless `ignore_eos`), after `max_new_tokens`, or when the
context is full; its slots and table row are freed right away.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from snugkv.core.forward import BatchRow
from snugkv.core.sampling import SamplingParams
from snugkv.runner.model_runner import ModelRunner


class PromptTooLongError(ValueError):
    pass


@dataclass(slots=True)
class GenerationRequest:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    budget_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "stop", "length"


def kv_tokens_needed(
    prompt_lens: Iterable[int], max_new_tokens: int, page_size: int, max_context_len: int
) -> int:
    """Pool tokens that let every prompt run to its budget at once (what `generate` admits against)."""
    return sum(min(n + max_new_tokens, max_context_len) + page_size for n in prompt_lens)


def generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    eos_token_ids: Iterable[int] = (),
    on_token: Callable[[int, int], None] | None = None,
) -> list[GenerationResult]:
    """Generate for every prompt (token ids); results in prompt order.

    `on_token(prompt_index, token_id)` is called for each new token as it is sampled.
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    eos = frozenset(eos_token_ids)
    context = runner.max_context_len
    page_size = runner.allocator.page_size
    requests = []
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {index} is empty; it needs at least one token")
        if len(prompt) >= context:
            raise PromptTooLongError(
                f"prompt {index} has {len(prompt)} tokens but the context holds {context} "
                "(prompt plus at least one new token); shorten the prompt or raise the context length"
            )
        budget = min(len(prompt) + request_params.max_new_tokens, context) + page_size
        if budget > runner.allocator.capacity_tokens:
            raise PromptTooLongError(
                f"prompt {index} needs {budget} KV slots but the pool holds {runner.allocator.capacity_tokens}"
            )
        requests.append(
            GenerationRequest(
                index,
                prompt,
                request_params,
                generator=request_params.make_generator(runner.device),
                budget_tokens=budget,
            )
        )

    waiting = deque(requests)
    running: list[GenerationRequest] = []
    reserved_tokens = 0
    while waiting or running:
        admitted: list[GenerationRequest] = []
        while waiting and reserved_tokens + waiting[0].budget_tokens <= runner.allocator.capacity_tokens:
            row = runner.req_to_token_pool.alloc()
            if row is None:
                break
            request = waiting.popleft()
            request.req_pool_idx = row
            reserved_tokens += request.budget_tokens
            admitted.append(request)
        if not admitted and not running:
            raise RuntimeError("no request fits the KV pool and no request is running")
        batch = running + admitted
        rows = [
            BatchRow(r.req_pool_idx, r.num_tokens - 1, [r.output_token_ids[-1]])
            if r.output_token_ids
            else BatchRow(r.req_pool_idx, 0, r.prompt_token_ids)
            for r in batch
        ]
        out_cache_loc = runner.allocate_slots(rows)
        if out_cache_loc is None:  # admission reserved every request's budget, so this is a bug
            raise RuntimeError("the KV pool ran out of slots despite the admission budget")
        logits = runner.forward(rows, out_cache_loc)
        tokens = runner.sample(logits, [r.params for r in batch], [r.generator for r in batch])
        running = []
        for request, token in zip(batch, tokens):
            request.output_token_ids.append(token)
            if on_token is not None:
                on_token(request.index, token)
            stop = request.params.stop_token_ids
            if (token in eos and not request.params.ignore_eos) or token in stop:
                request.finish_reason = "stop"
            elif (
                len(request.output_token_ids) >= request.params.max_new_tokens
                or request.num_tokens >= context
            ):
                request.finish_reason = "length"
            if request.finish_reason is None:
                running.append(request)
                continue
            # The last sampled token was never written to the cache: free positions before it.
            runner.free_request_slots(request.req_pool_idx, request.num_tokens - 1)
            runner.req_to_token_pool.free(request.req_pool_idx)
            reserved_tokens -= request.budget_tokens
    return [
        GenerationResult(r.prompt_token_ids, r.output_token_ids, r.finish_reason or "length")
        for r in requests
    ]
