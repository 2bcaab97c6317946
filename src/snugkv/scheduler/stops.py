"""Why a request ends after its newest token: its grammar, a stop token, a stop string, its length,
the context, or a KV cache that could not hold its next token even with nothing else in it.

`stop_reason` is asked once per emitted token (a verify step asks after each of a row's tokens, and
the first answer ends the request there); it detokenizes a request with stop strings as it goes.
It never frees slots nor emits outputs: the scheduler does, with the reason.
"""

from __future__ import annotations

from snugkv.core.tokenizer import Tokenizer
from snugkv.scheduler.detokenizer import detokenize, find_stop
from snugkv.scheduler.request import Request


def stop_limits(context_length: int, kv_tokens: int, page_size: int) -> tuple[int, int]:
    """What `stop_reason` compares every request with: the context length, and the KV tokens a
    request may hold (`kv_tokens`: what the cache could hold with nothing else in it; a cache that
    can grow back retracts a request past its size of now, which then waits for memory) less a page."""
    return context_length, kv_tokens - page_size


def stop_reason(
    request: Request, limits: tuple[int, int], eos_token_ids: frozenset[int], tokenizer: Tokenizer | None
) -> str | None:
    """Why `request` ends after its newest token, or None; `limits` from `stop_limits`."""
    token = request.output_ids[-1]
    sampling = request.sampling
    grammar = request.grammar
    if grammar is not None and grammar.rejected:
        request.error = f"structured output: the grammar refused token {grammar.rejected_token}"
        return "error"
    if grammar is not None and grammar.terminated:
        return "stop"
    if (token in eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
        return "stop"
    if sampling.stop:
        searched = len(request.text)
        detokenize(tokenizer, request)
        # vLLM's rule: stop strings count from the token after `min_tokens`; text before it is
        # never searched again, so a stop string inside it does not end the request later.
        held_back = len(request.output_ids) <= sampling.min_tokens
        index = None if held_back else find_stop(request.text, sampling.stop, searched)
        if index is not None:
            request.text = request.text[:index]
            request.stopped_by_string = True
            return "stop"
    generated = len(request.output_ids)
    num_tokens = len(request.prompt_ids) + generated
    context_length, kv_limit = limits
    if generated >= sampling.max_new_tokens or num_tokens >= context_length:
        return "length"
    if num_tokens > kv_limit:
        return "kv_capacity"  # the KV cache could not hold its next token even with nothing else in it
    return None
