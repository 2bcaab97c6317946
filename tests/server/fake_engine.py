"""A deterministic stand-in for the engine, implementing `EngineClient` (snugkv.core.engine_client)
for the server tests.

It "generates" a fixed English text, one token at a time with a small delay, rotated by the
seed when sampling (so different seeds give different texts and one seed always the same), and
honours max_new_tokens, stop strings and logprobs. It records every `abort(rid)` so the tests
can see that a client leaving freed its request. A prompt containing `ENGINE_ERROR_MARKER`
makes the engine fail that request after one token.

`ByteTokenizer` implements the project's `Tokenizer` (snugkv.core.tokenizer): one token per byte,
a ChatML-like template; its `hf` is itself, with the transformers `apply_chat_template` a chat with
tools renders through. The fake has no KV cache: the elastic calls are refused with a 501.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from snugkv.core.outputs import GenerateInput, GenerateOutput, TokenLogprob
from snugkv.core.profiles import ProfileError, ProfileReport
from snugkv.core.reports import (
    EngineInfo,
    KvInfo,
    KvResizeReply,
    MemoryLedger,
    MetricsSnapshot,
    SchedulerStats,
    SleepReply,
    SleepState,
    SlotAccounting,
    StartupReport,
)
from snugkv.core.sampling import InvalidRequest
from snugkv.sizing.resize import KvResizeError

REPLY = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
ENGINE_ERROR_MARKER = "[[fail-in-engine]]"
KV_CAPACITY_TOKENS = 65536


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 3); 0, 1, 2 are pad, bos, eos."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    eos_token = "</s>"
    eos_token_ids = frozenset({2})
    chat_template = "<|role|>\\ncontent\\n per message, then <|assistant|>\\n"
    roles = ("system", "user", "assistant", "tool")

    @property
    def hf(self) -> ByteTokenizer:
        return self

    @property
    def vocab_size(self) -> int:
        return 256 + 3

    @property
    def has_chat_template(self) -> bool:
        return True

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [byte + 3 for byte in text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in token_ids if i >= 3).decode("utf-8", errors="replace")

    def decode_batch(
        self, sequences: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def encode_chat(
        self, messages: Sequence[dict[str, str]] | str, *, add_generation_prompt: bool = True
    ) -> list[int]:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = self.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_variables: Any,
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
        self._prompt_tokens = self._cached_tokens = 0

    async def generate(self, request: GenerateInput) -> AsyncGenerator[GenerateOutput, None]:
        if request.rid in self._running:
            raise InvalidRequest(f"request id {request.rid} is already running")
        prompt = tuple(request.input_ids)
        cached = len(prompt) - 1 if prompt in self._seen_prompts else 0
        self._seen_prompts.add(prompt)
        self._prompt_tokens += len(prompt)
        self._cached_tokens += cached
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

    def abort_all(self) -> None:
        for rid in list(self._running):
            self.abort(rid)

    def check_health(self) -> bool:
        return self.healthy

    def is_sleeping(self) -> bool:
        return False

    def server_info(self) -> EngineInfo:
        ledger = MemoryLedger("fake", 0, 0, 0, 0, 0, 0, 0, 0, 0, weights_in_device_memory=False)
        return EngineInfo(
            model=self.model_name,
            startup=StartupReport("fake", KV_CAPACITY_TOKENS, 256, ledger, sizing_ms=0.0),
            page_size=1,
            kv_layout="nhd",
            kv_dtype="none",
            attention_backend="none",
            tp_size=1,
            context_length=self.max_context_tokens,
            chunked_prefill_size=self.max_context_tokens,
            cuda_graph_max_bs=0,
            prefill_graph_max_tokens=0,
            overlap_schedule=False,
            device="none",
            kv_capacity_tokens=KV_CAPACITY_TOKENS,
            stats=self._stats(),
            step_times={},
            step_errors=0,
            gc={},
            is_sleeping=False,
            kv_events=(),
            aborted_rids=tuple(self.aborted_rids[-1000:]),
            slot_accounting_when_idle=SlotAccounting(),
        )

    def _stats(self) -> SchedulerStats:
        used_tokens = sum(prompt_len for _, prompt_len in self._running.values())
        return SchedulerStats(
            kv_cache_usage=used_tokens / KV_CAPACITY_TOKENS,
            kv_cache_cached_usage=0.0,
            num_running_requests=len(self._running),
            num_queued_requests=0,
            prefix_cache_hit_rate=self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            prefix_cache_tokens=0,
            num_retractions=0,
            generated_tokens=0,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            self._stats(),
            kv_max_total_num_tokens=KV_CAPACITY_TOKENS,
            kv_committed_bytes=0,
            kv_resizes=0,
            sleep_level=0,
        )

    def recent_steps(self) -> list[tuple[object, ...]]:
        return []

    def sleep_state(self) -> SleepState:
        return SleepState(frozenset(), None, False, 0, None)

    async def kv_info(self) -> KvInfo:
        raise self._no_kv_cache()

    async def resize_kv(
        self, *, max_total_num_tokens: int | None = None, free_gib: float | None = None
    ) -> KvResizeReply:
        raise self._no_kv_cache()

    async def sleep(self, *, level: int = 1, tags: tuple[str, ...] = ()) -> SleepReply:
        raise self._no_kv_cache()

    async def wake_up(self, *, tags: tuple[str, ...] = ()) -> SleepReply:
        raise self._no_kv_cache()

    async def start_profile(self, *, output_dir: str | None = None, num_steps: int | None = None) -> str:
        raise ProfileError("the test engine runs no steps to profile")

    async def stop_profile(self) -> ProfileReport:
        raise ProfileError("no profile is running; POST /start_profile first")

    @staticmethod
    def _no_kv_cache() -> KvResizeError:
        return KvResizeError(
            "This engine cannot change its memory at run time (a fake has none).", status=501
        )

    def stop(self) -> None:
        self.abort_all()
