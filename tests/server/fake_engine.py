"""A deterministic stand-in for the engine, implementing `EngineClient` for the server tests.

It "generates" a fixed English text, one token at a time with a small delay, rotated by the
seed when sampling (so different seeds give different texts and one seed always the same), and
honours max_new_tokens, stop strings and logprobs. It records every `abort(rid)` so the tests
can see that a client leaving freed its request. A prompt containing `ENGINE_ERROR_MARKER`
makes the engine fail that request after one token.

`ByteTokenizer` covers the part of the transformers tokenizer API the server uses (one token per
byte, a ChatML-like template, `apply_chat_template` returning a mapping as transformers 5 does).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

from snugkv.core.outputs import GenerateInput, GenerateOutput, TokenLogprob
from snugkv.core.sampling import InvalidRequest

REPLY = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
ENGINE_ERROR_MARKER = "[[fail-in-engine]]"
KV_CAPACITY_TOKENS = 65536


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 3); 0, 1, 2 are pad, bos, eos."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    eos_token = "</s>"
    chat_template = "<|role|>\\ncontent\\n per message, then <|assistant|>\\n"
    roles = ("system", "user", "assistant", "tool")

    def __len__(self) -> int:
        return 256 + 3

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [byte + 3 for byte in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False, tokenize: bool = True
    ) -> Any:
        for message in messages:
            if message["role"] not in self.roles:
                raise ValueError(f"unknown role {message['role']!r}")
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return {"input_ids": self.encode(text)} if tokenize else text


class FakeEngine:
    def __init__(
        self,
        *,
        tokenizer: Any = None,
        model_name: str = "fake-model",
        max_context_tokens: int = 512,
        token_delay_s: float = 0.002,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.token_delay_s = token_delay_s
        self.healthy = True
        self.aborted_rids: list[str] = []
        self.finished_rids: list[str] = []
        self._running: dict[str, tuple[asyncio.Event, int]] = {}
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._reply_ids = list(self.tokenizer.encode(REPLY * 64, add_special_tokens=False))

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateOutput]:
        if request.rid in self._running:
            raise InvalidRequest(f"request id {request.rid} is already running")
        prompt = tuple(request.input_ids)
        cached = len(prompt) - 1 if prompt in self._seen_prompts else 0
        self._seen_prompts.add(prompt)
        abort = asyncio.Event()
        self._running[request.rid] = (abort, len(prompt))
        try:
            async for output in self._run(request, abort, cached):
                yield output
        finally:
            self._running.pop(request.rid, None)

    async def _run(
        self, request: GenerateInput, abort: asyncio.Event, cached: int
    ) -> AsyncIterator[GenerateOutput]:
        sampling = request.sampling
        fails = ENGINE_ERROR_MARKER in self.tokenizer.decode(request.input_ids)
        ids = self._reply_ids[self._offset(request) :]
        longest_stop = max((len(s) for s in sampling.stop), default=0)
        base = {"rid": request.rid, "prompt_tokens": len(request.input_ids), "cached_tokens": cached}
        text, sent_chars = "", 0
        for count in range(1, sampling.max_new_tokens + 1):
            await asyncio.sleep(self.token_delay_s)
            if abort.is_set():
                yield GenerateOutput(**base, token_ids=[], text="", finished=True, finish_reason="abort")
                return
            if fails:
                yield GenerateOutput(
                    **base,
                    token_ids=[],
                    text="",
                    finished=True,
                    finish_reason="error",
                    error="injected failure",
                )
                return
            token_id = ids[count - 1]
            previous_len = len(text)
            text = self.tokenizer.decode(ids[:count])
            piece = text[previous_len:]
            stop_at = min((text.find(s) for s in sampling.stop if s in text), default=-1)
            finished = stop_at >= 0 or count == sampling.max_new_tokens
            if stop_at >= 0:
                text = text[:stop_at]
            # Hold back text that may be the start of a stop string until it is known not to be.
            visible = len(text) if finished else max(sent_chars, len(text) - max(longest_stop - 1, 0))
            delta, sent_chars = text[sent_chars:visible], visible
            yield GenerateOutput(
                **base,
                token_ids=[token_id],
                text=delta,
                finished=finished,
                finish_reason=("stop" if stop_at >= 0 else "length") if finished else None,
                completion_tokens=count,
                logprobs=self._logprobs(token_id, piece, sampling.logprobs),
            )
            if finished:
                self.finished_rids.append(request.rid)
                return

    def _offset(self, request: GenerateInput) -> int:
        if request.sampling.greedy:
            return 0
        seed = request.sampling.seed if request.sampling.seed is not None else random.randrange(2**31)
        return seed % len(REPLY)

    @staticmethod
    def _logprobs(token_id: int, piece: str, top: int | None) -> list[TokenLogprob]:
        if top is None:
            return []
        alternatives = [(piece, -0.25)] + [(f"<alt{rank}>", -2.0 - rank) for rank in range(1, top)]
        return [TokenLogprob(token_id=token_id, token=piece, logprob=-0.25, top=alternatives[:top])]

    def abort(self, rid: str) -> None:
        self.aborted_rids.append(rid)
        running = self._running.get(rid)
        if running is not None:
            running[0].set()

    def server_info(self) -> dict[str, Any]:
        return {
            "max_total_num_tokens": KV_CAPACITY_TOKENS,
            "sizing_mode": "fake",
            "memory_ledger": {"kv_cache_bytes": 0},
            "args": {"max_context_tokens": self.max_context_tokens, "token_delay_s": self.token_delay_s},
            "num_running_requests": len(self._running),
            "running_rids": sorted(self._running),
            "aborted_rids": self.aborted_rids[-1000:],
        }

    def metrics_snapshot(self) -> dict[str, float]:
        used_tokens = sum(prompt_len for _, prompt_len in self._running.values())
        return {
            "kv_cache_usage": used_tokens / KV_CAPACITY_TOKENS,
            "num_running_requests": len(self._running),
            "num_queued_requests": 0,
        }

    def check_health(self) -> bool:
        return self.healthy
