"""The helper ranks of `--tp N`: the one loop every rank other than 0 runs, whoever leads.

Rank 0 (the server's engine thread, the Python API, a test) takes turns with its engine core; a
follower takes the same turns with its own: it receives each turn's commands (`EngineCore.share`),
applies them in order, and steps when it has work, until `Stop`. A command rank 0 refused (a bad
request, a resize out of bounds) was refused here too and answered there, so it is dropped here.
A step that failed was agreed on by every rank (`EngineCore.step`); the loop goes on.

`run_follower` is the target a launcher gives the helper processes: it builds this rank's core,
follows, and releases the engine however the loop ends.
"""

from __future__ import annotations

import contextlib
import logging

from snugkv.core.sampling import InvalidRequest
from snugkv.distributed.group import TensorParallel
from snugkv.driver.commands import Stop
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import EngineArgs
from snugkv.sizing.resize import KvResizeError

logger = logging.getLogger(__name__)


def follow(core: EngineCore) -> None:
    """Apply rank 0's turns to `core` and step with it, until `Stop`."""
    tp = core.tp
    if tp.is_first_rank:
        raise ValueError("rank 0 leads; only the other ranks follow")
    while True:
        for command in core.share(None):
            if isinstance(command, Stop):
                return
            with contextlib.suppress(InvalidRequest, KvResizeError):  # rank 0 refused it too and said so
                core.apply(command)
        if core.has_work:
            error = core.step()
            if error is not None:
                logger.error("rank %d: a step failed: %s", tp.rank, error)


def run_follower(tp: TensorParallel, args: EngineArgs, turns_wait_on_user: bool = False) -> int:
    """A helper rank: its own engine core, turn by turn with rank 0, until `Stop`. The flags are
    rank 0's (`turns_wait_on_user`: its idle turns travel without the collectives' timeout)."""
    core = EngineCore.build(args, tp=tp, turns_wait_on_user=turns_wait_on_user)
    try:
        follow(core)
    finally:
        core.close()
    return 0
