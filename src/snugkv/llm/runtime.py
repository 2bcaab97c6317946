"""What an open `LLM` holds and how a call runs: rank 0's engine, tokenizer and scheduler, the
helper ranks of `tp > 1`, and the loop of turns that drives them.

A call checks every prompt first (`Scheduler.check_request` and the token-id range: a bad prompt
raises before anything is queued), adds them all in one turn, then takes turns until the scheduler
has no work; outputs arrive through the scheduler's `on_output` callback (`Collector`). A failed
step ends the call's requests (`EngineCore.step`) and raises `GenerationError`; an interrupt
ends them too (tp=1) or closes the runtime (tp > 1). `close` tells the helpers to stop, closes the
engine and waits for them. Nothing here knows about the `LLM` object itself.
"""

from __future__ import annotations

import gc
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch
import torch.distributed as dist

from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.distributed.launch import HelperRanks, device_type_for, start_helpers
from snugkv.driver.commands import Add, Stop, Turn
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.follower import run_follower
from snugkv.engine import Engine, EngineArgs
from snugkv.llm.outputs import Collector, CompletionOutput, Progress, RequestOutput
from snugkv.models.tokenizer import Tokenizer, TokenizerUnavailable
from snugkv.scheduler.scheduler import Scheduler

PromptInput = str | Sequence[int]
Conversation = Sequence[Mapping[str, str]]
CLOSED = "this LLM is closed; create a new one"


class GenerationError(RuntimeError):
    """A step failed while generating (an engine bug or a device error). The call's requests
    ended; the `LLM` stays usable."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None  # as given, None for token ids and chats
    ids: list[int]
    sampling: SamplingParams


class Runtime:
    """What an open `LLM` holds: rank 0's engine core (engine, tokenizer, scheduler) and the helper
    ranks. Holds no reference to the `LLM`, so dropping the `LLM` can close it."""

    def __init__(self, args: EngineArgs) -> None:
        self.tp = TensorParallel()
        self.helpers: HelperRanks | None = None
        self.collector = Collector()
        self._core: EngineCore | None = None
        self.tokenizer: Tokenizer | None = None
        self._no_tokenizer: str | None = None
        self._rids = itertools.count()
        self._out_of_step = False  # an interrupted call left the ranks at different points
        if args.parallel.tp_size > 1:
            if dist.is_initialized():
                raise RuntimeError(
                    "this process already has a torch.distributed group (another LLM with tp > 1?); "
                    "close it before starting a tensor-parallel LLM"
                )
            self.tp, self.helpers = start_helpers(
                run_follower,
                args.parallel.tp_size,
                (args, True),  # between calls the ranks wait on the user
                device_type=device_type_for(args.parallel.device),
            )
        try:
            self._core = core = EngineCore.build(args, tp=self.tp, turns_wait_on_user=True)
            core.deliver_outputs_to(self.collector.on_output)
            self.tokenizer, self._no_tokenizer = core.tokenizer, core.no_tokenizer
        except BaseException:
            self._out_of_step = True  # the helpers may be anywhere in their start-up
            self.close()
            raise

    @property
    def is_open(self) -> bool:
        return self._core is not None

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise RuntimeError(CLOSED)
        return self._core

    @property
    def engine(self) -> Engine:
        return self.core.engine

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # -- prompts ------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerUnavailable(self._no_tokenizer or "this model has no tokenizer; pass token ids")
        return self.tokenizer

    def encode(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt)
        try:
            return [operator.index(token) for token in prompt]
        except TypeError:
            bad = next(token for token in prompt if not isinstance(token, Integral))
            raise TypeError(f"a prompt of token ids holds {bad!r:.80}, which is not an integer") from None

    def encode_chat(self, conversation: Conversation, add_generation_prompt: bool, name: str) -> list[int]:
        tokenizer = self._require_tokenizer()
        if not tokenizer.has_chat_template:
            raise TokenizerUnavailable("this model has no chat template; use generate with the raw prompt")
        if not conversation:
            raise InvalidRequest(f"{name}messages is empty; send at least one message", param="messages")
        try:
            messages = [dict(message) for message in conversation]
            return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # template errors come as jinja2, ValueError or TypeError
            raise InvalidRequest(
                f"{name}the model's chat template rejected these messages ({exc}); check the roles and their order"
            ) from None

    def check(self, prompts: list[Prompt], what: str) -> None:
        """Every prompt as the scheduler would take it, before any is queued."""
        vocab_size = self.engine.config.vocab_size
        for index, prompt in enumerate(prompts):
            name = prompt_name(what, index, prompts)
            bad = next((t for t in prompt.ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{name}token id {bad} in the prompt is out of range; ids must be 0 to {vocab_size - 1}"
                )
            try:
                self.scheduler.check_request(prompt.ids, prompt.sampling)
            except InvalidRequest as exc:
                raise InvalidRequest(f"{name}{exc}", param=exc.param) from None

    # -- running ------------------------------------------------------------------------
    def run(self, prompts: list[Prompt], *, use_tqdm: bool, what: str) -> list[RequestOutput]:
        self.check(prompts, what)
        rids = [f"llm-{next(self._rids)}" for _ in prompts]
        self.collector.expect(rids)
        # Without stop strings or log-probabilities nothing needs text while the call runs, so
        # the text is decoded once at the end instead of incrementally for every row at every step.
        text_at_end = self.tokenizer is not None and not any(
            p.sampling.stop or p.sampling.logprobs is not None for p in prompts
        )
        if text_at_end:
            self.scheduler.outputs.tokenizer = None
        progress = Progress(len(prompts), use_tqdm)
        try:
            error = self._turns([Add(rid, p.ids, p.sampling) for rid, p in zip(rids, prompts)], progress)
        except BaseException:
            self._after_interrupt()
            raise
        finally:
            progress.close()
            if self._core is not None:
                self._core.scheduler.outputs.tokenizer = self.tokenizer
        if error is not None:
            raise GenerationError(f"generation failed: {type(error).__name__}: {error}") from error
        return [self._result(rid, prompt, text_at_end) for rid, prompt in zip(rids, prompts)]

    def turn(self, commands: Turn) -> None:
        core = self.core
        for command in core.share(commands):
            core.apply(command)

    def _turns(self, commands: Turn, progress: Progress) -> Exception | None:
        """Turns until the scheduler has no work: the same loop as every helper rank's `follow`."""
        core = self.core
        failure: Exception | None = None
        while True:
            self.turn(commands)
            commands = []
            if not core.has_work:
                return failure
            error = core.step()  # a failure ends every request
            failure = failure or error
            progress.update(self.collector)
            if not core.has_work:
                return failure

    def _after_interrupt(self) -> None:
        """After an interrupt inside a call: end its requests and free their slots (tp=1), or close
        (tp > 1: the ranks may have stopped at different points)."""
        if self.tp.enabled:
            self._out_of_step = True
            self.close()
            return
        scheduler = self.scheduler
        queued = {id(r) for r in (*scheduler.waiting, *scheduler.running)}
        # A step interrupted between taking its batch from the queues and putting it back.
        scheduler.waiting.extend(r for r in scheduler.requests.values() if id(r) not in queued)
        scheduler.fail_all("interrupted")

    def _result(self, rid: str, prompt: Prompt, text_at_end: bool) -> RequestOutput:
        stream = self.collector.streams[rid]
        final, times = stream.final, stream.times
        # The scheduler finished every request of the call (a failed step raised before this).
        assert final is not None and final.finish_reason is not None and times is not None, rid
        text = "".join(stream.text_pieces)
        if text_at_end and self.tokenizer is not None:
            text = self.tokenizer.decode(stream.token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=stream.token_ids,
            finish_reason=final.finish_reason,
            logprobs=stream.logprobs if prompt.sampling.logprobs is not None else None,
            times=times,
            cached_tokens=final.cached_tokens,
            draft_tokens=final.draft_tokens,
            accepted_draft_tokens=final.accepted_draft_tokens,
        )
        return RequestOutput(rid, prompt.text, prompt.ids, [completion], stream.prompt_logprobs)

    # -- closing ------------------------------------------------------------------------
    def close(self) -> None:
        """Tell the helper ranks to stop (when they are in step with rank 0), release rank 0's
        engine, wait for the helpers; idempotent."""
        core, helpers = self._core, self.helpers
        if core is None and helpers is None:
            return
        self._core, self.tokenizer, self.helpers = None, None, None
        told_helpers = False
        try:
            if helpers is not None and core is not None and not self._out_of_step:
                core.share([Stop()])
                told_helpers = True
        finally:
            if core is not None:
                core.close()
            if helpers is not None:
                helpers.stop(finished=told_helpers)
            del core
            gc.collect()  # the weights go now, not at the next collection
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def prompt_name(what: str, index: int, batch: Sequence[Any]) -> str:
    """How a message names the prompt it is about: nothing for a single one."""
    return f"{what}[{index}]: " if len(batch) > 1 else ""
