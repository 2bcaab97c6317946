"""The turns of an `LLM`'s ranks: rank 0 in the user's process, helper ranks with `--tp N`.

As in the server (`scheduler.lockstep`), rank 0 sends each turn's commands to the helpers, every
rank applies them in the same order to its own scheduler and steps if it has work; schedulers are
deterministic given their commands and rank 0's sampled tokens, so every rank batches the same
rows. Two things differ from the server's loop, which is why the helpers run `follow` here and
not `lockstep.follow`: rank 0 sends turns only while a call runs, so a turn that finds no work (the
next call, or `close`) may come after the user has thought for an hour and travels over the group
without a timeout (every rank sees the same `has_work`, so all pick the same group); and there is
one more command, `ResetPrefixCache`. At tp=1 a turn is a plain function call.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from snugkv.core.sampling import InvalidRequest
from snugkv.distributed.group import TensorParallel
from snugkv.engine import Engine, EngineArgs
from snugkv.models.tokenizer import Tokenizer, TokenizerUnavailable, load_tokenizer
from snugkv.scheduler import lockstep
from snugkv.scheduler.lockstep import Command, Stop
from snugkv.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Drop every unlocked prefix-cache entry."""


Turn = list[Command | ResetPrefixCache]


def share(scheduler: Scheduler, tp: TensorParallel, commands: Turn | None) -> Turn:
    """Rank 0's commands of this turn on every rank (others pass None)."""
    return tp.broadcast_object_from_first(commands, wait_for_user=not scheduler.has_work)


def apply(scheduler: Scheduler, command: Command | ResetPrefixCache) -> None:
    if isinstance(command, ResetPrefixCache):
        scheduler.cache.reset()
    else:
        lockstep.apply(scheduler, command)


def engine_tokenizer(engine: Engine) -> tuple[Tokenizer | None, str | None]:
    """The model's tokenizer (every rank's scheduler matches stop strings with it), or None and
    why there is none (a bare config with random weights: prompts are then token ids)."""
    try:
        return load_tokenizer(engine.loaded.source, engine.config.eos_token_ids), None
    except TokenizerUnavailable as exc:
        return None, str(exc)


def follow(tp: TensorParallel, args: EngineArgs, enable_prefix_cache: bool) -> None:
    """A helper rank: its own engine and scheduler, turn by turn with rank 0, until `Stop`."""
    engine = Engine(args, tp=tp)
    try:
        tokenizer, _ = engine_tokenizer(engine)
        scheduler = Scheduler.for_engine(engine, tokenizer=tokenizer, enable_prefix_cache=enable_prefix_cache)
        while True:
            for command in share(scheduler, tp, None):
                if isinstance(command, Stop):
                    return
                with contextlib.suppress(InvalidRequest):  # rank 0 checked every prompt first
                    apply(scheduler, command)
            if scheduler.has_work:
                error = lockstep.step_once(scheduler, tp)
                if error is not None:
                    logger.error("rank %d: a step failed: %s", tp.rank, error)
    finally:
        engine.close()
