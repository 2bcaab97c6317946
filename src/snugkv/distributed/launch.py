"""Starting the ranks of `--tp N`: this process is rank 0, ranks 1..N-1 are spawned.

Rank 0 stays in the process the user started, so it owns the terminal (stdin for `chat`, Ctrl-C,
the server's socket) and its return value needs no pipe. The other ranks are helpers that follow
rank 0: they ignore Ctrl-C (rank 0 decides when to stop and tells them), and die with it if it is
killed (PR_SET_PDEATHSIG). A helper that fails takes the launch down instead of leaving rank 0
waiting in a collective: rank 0 is told (`on_helper_failure`, e.g. a server stops the way SIGTERM
stops it, failing its in-flight requests), the launch then ends with `RankFailed`, and if rank 0
has not finished within the grace period the process exits with code 1.

Across hosts (`nodes`, see `nodes.NodePlacement`) each host's launch starts its own share of the
ranks the same way, all meeting at node 0; only the launch that holds rank 0 gets `leader_kwargs`.
Under torchrun every rank is a process torchrun started, and a launch starts no helper.

`launch(target, tp_size, args)` calls `target(tp, *args)` on every rank and returns rank 0's
value. With `tp_size == 1` it calls `target` here with no process groups at all. Every process
has the no-multicast variables set before NCCL is touched. `start_helpers` is the same start for
a rank 0 that outlives one call (`snugkv.LLM`): it returns, and `HelperRanks.stop` ends the helpers.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from snugkv.distributed.group import TensorParallel
from snugkv.distributed.nodes import NodePlacement, single_host
from snugkv.distributed.setup import (
    NO_MULTICAST_ENV,
    destroy_tensor_parallel,
    disable_multicast,
    init_tensor_parallel,
)

logger = logging.getLogger(__name__)

# After a helper fails, rank 0 gets this long to finish (notice a gloo peer error, or stop as
# `on_helper_failure` asks) before the process exits with code 1.
HELPER_FAILURE_GRACE_S = 10.0
# A helper that refused a flag or a model (exit code USER_ERROR_EXIT) leaves rank 0 longer: it meets
# the same refusal on its own and says it, however slowly a busy host gets it there.
USER_ERROR_EXIT = 2
USER_ERROR_GRACE_S = 300.0
# Once rank 0 is done, helpers have this long to release their engines and exit.
HELPER_EXIT_TIMEOUT_S = 120.0


class RankFailed(RuntimeError):
    """A helper rank exited with an error."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type_for(device: str | None) -> str:
    """The kind of process group a `--device` value needs: "cpu" (gloo) or "cuda" (NCCL)."""
    if device is None:
        return default_device_type()
    return "cpu" if str(device).startswith("cpu") else "cuda"


def launch(
    target: Callable[..., Any],
    tp_size: int,
    args: tuple[Any, ...] = (),
    *,
    device_type: str | None = None,
    leader_kwargs: dict[str, Any] | None = None,
    on_helper_failure: Callable[[], None] | None = None,
    helper_failure_grace_s: float = HELPER_FAILURE_GRACE_S,
    nodes: NodePlacement | None = None,
) -> Any:
    """Run `target(tp, *args)` on `tp_size` ranks; returns rank 0's result (across hosts, this
    launch's first rank's).

    `target` must be importable (a module-level function): spawned ranks import it by name.
    `leader_kwargs` go to rank 0's call only, unpickled (e.g. a socket bound before start-up).
    `on_helper_failure()` runs (on a watch thread) when a helper dies while rank 0 still runs;
    rank 0 then has `helper_failure_grace_s` to return before the process exits with code 1.
    """
    check_tp_size(tp_size)
    nodes = nodes or single_host(tp_size)
    leader_kwargs = (leader_kwargs or {}) if nodes.hosts_rank_zero else {}
    if nodes.torchrun and not nodes.hosts_rank_zero:
        # torchrun sends Ctrl-C and SIGTERM to every rank at once; rank 0 decides when to stop and
        # tells the others, as it tells its helpers (it kills what is left once its grace is over).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if tp_size == 1:
        disable_multicast()
        return target(TensorParallel(), *args, **leader_kwargs)
    tp, helpers = start_helpers(
        target,
        tp_size,
        args,
        device_type=device_type,
        on_helper_failure=on_helper_failure,
        helper_failure_grace_s=helper_failure_grace_s,
        nodes=nodes,
    )
    try:
        value = target(tp, *args, **leader_kwargs)
    except BaseException as exc:
        # A collective that fails because a helper died is the helper's failure, not rank 0's.
        dead = _dead_helpers(helpers.processes) if isinstance(exc, RuntimeError) else []
        helpers.stop(finished=False)
        if dead:
            raise RankFailed(
                f"tensor-parallel {', '.join(dead)}, so rank 0 stopped ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]})"
            ) from exc
        raise
    helpers.stop(finished=True)
    return value


def check_tp_size(tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"--tp must be >= 1, got {tp_size}")


def start_helpers(
    target: Callable[..., Any],
    tp_size: int,
    args: tuple[Any, ...] = (),
    *,
    device_type: str | None = None,
    on_helper_failure: Callable[[], None] | None = None,
    helper_failure_grace_s: float = HELPER_FAILURE_GRACE_S,
    nodes: NodePlacement | None = None,
) -> tuple[TensorParallel, HelperRanks]:
    """Spawn ranks 1..N-1 running `target(tp, *args)` and join this process to their groups as
    rank 0; returns rank 0's `TensorParallel` and the helpers, which `stop` ends (for callers whose
    rank 0 outlives one call, such as `snugkv.LLM`)."""
    check_tp_size(tp_size)
    nodes = nodes or single_host(tp_size)
    disable_multicast()  # inherited by every helper, and set again inside each one
    device_type = device_type or default_device_type()
    init_method = nodes.init_method if nodes.spans_nodes else f"tcp://127.0.0.1:{free_port()}"
    log_level = logging.getLogger().getEffectiveLevel()
    placement = (nodes.first_rank, nodes.local_ranks)
    processes = mp.start_processes(
        _helper_main,
        args=(tp_size, init_method, device_type, target, args, log_level, os.getpid(), placement),
        nprocs=nodes.helpers,
        join=False,
        start_method="spawn",
    )
    helpers = HelperRanks(processes, on_helper_failure, helper_failure_grace_s)
    try:
        tp = init_tensor_parallel(
            nodes.first_rank,
            tp_size,
            init_method=init_method,
            device_type=device_type,
            local_rank=nodes.local_rank,
            local_world_size=nodes.local_ranks,
        )
    except BaseException:
        helpers.abandon()
        raise
    return tp, helpers


class HelperRanks:
    """The spawned ranks of a launch, watched while rank 0 works (see `_HelperWatch`)."""

    def __init__(
        self,
        processes: Any,
        on_failure: Callable[[], None] | None = None,
        grace_s: float = HELPER_FAILURE_GRACE_S,
    ) -> None:
        self.processes = processes
        self._watch = _HelperWatch(processes, on_failure, grace_s)
        self._threads = torch.get_num_threads()

    @property
    def helper_failed(self) -> bool:
        return self._watch.helper_failed

    def stop(self, *, finished: bool) -> None:
        """Rank 0 leaves the groups, then the helpers are waited for. `finished`: rank 0 ended
        normally, so the helpers meet it at a barrier and must exit cleanly (else `RankFailed`);
        otherwise they are stopped."""
        try:
            destroy_tensor_parallel(meet_first=finished and not self.helper_failed)  # nobody to meet
        except BaseException:
            self.abandon()
            raise
        if not finished:
            self.abandon()
            return
        self._release()
        _join(self.processes, raise_on_failure=True)

    def abandon(self) -> None:
        """Stop the helpers on purpose (rank 0 failed), without raising for their exit codes."""
        self._release()
        for process in self.processes.processes:
            if process.is_alive():
                process.terminate()
        _join(self.processes, raise_on_failure=False)

    def _release(self) -> None:
        self._watch.stop()  # the helpers are about to exit
        torch.set_num_threads(self._threads)  # the CPU split between ranks ends with them


def _helper_main(
    index: int,
    world_size: int,
    init_method: str,
    device_type: str,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    log_level: int,
    parent_pid: int,
    placement: tuple[int, int] = (0, 0),
) -> None:
    first_rank, local_ranks = placement  # this host's first rank (the parent) and its rank count
    rank = first_rank + index + 1
    # Signals for the terminal or for rank 0's process group (Ctrl-C, `kill -- -PGID`, systemd)
    # are rank 0's to handle: it tells the helpers when to stop. A session of our own keeps them
    # out; PR_SET_PDEATHSIG still ends a helper whose rank 0 is gone.
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    disable_multicast()
    logging.basicConfig(
        level=max(log_level, logging.WARNING),
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    tp = init_tensor_parallel(
        rank,
        world_size,
        init_method=init_method,
        device_type=device_type,
        local_rank=index + 1,
        local_world_size=local_ranks or world_size,
    )
    finished = False
    try:
        target(tp, *args)
        finished = True
    except ValueError as exc:  # a flag or a model that does not fit; rank 0 reports it too
        logger.error("%s", exc)
        raise SystemExit(USER_ERROR_EXIT) from None
    except Exception:
        logger.exception("this tensor-parallel rank failed")
        raise
    finally:
        destroy_tensor_parallel(meet_first=finished)
    _exit_now()


def _exit_now() -> None:
    """End a helper that finished and left its groups, skipping the interpreter's teardown: there
    a thread gloo left joinable can be destroyed, which aborts the process ("terminate called
    without an active exception", SIGABRT): seen once in a whole CPU suite on a loaded 2-core
    machine (tests/models/test_fp8_engine.py's two-rank test, after its barrier and its groups were
    gone), and in test_follower before dd0cd15. The helper's work is done and was reported over the
    group; nothing is left for the teardown to do but flush."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when rank 0 exits, however it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: helpers then outlive a killed rank 0
        pass
    if os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        os._exit(1)


def _dead_helpers(helpers: Any, wait_s: float = 1.0) -> list[str]:
    """'rank N exited with CODE' for each helper that ended with an error; waits up to `wait_s`
    for one to show, as a helper may close its connections an instant before it exits."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [
            f"rank {index + 1} exited with {process.exitcode}"
            for index, process in enumerate(helpers.processes)
            if process.exitcode not in (None, 0)
        ]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def _join(helpers: Any, *, raise_on_failure: bool, timeout_s: float = HELPER_EXIT_TIMEOUT_S) -> None:
    """Wait for the helpers to exit (rank 0 is done); one that hangs past `timeout_s` is killed."""
    deadline = time.monotonic() + timeout_s
    try:
        while not helpers.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in helpers.processes:
                    if process.is_alive():
                        process.kill()
                if raise_on_failure:
                    raise RankFailed(f"a tensor-parallel helper rank did not exit within {timeout_s:.0f} s")
                return
    except RankFailed:
        raise
    except Exception as exc:  # torch's Process*Exception, numbered by helper (helper i is rank i + 1)
        if raise_on_failure:
            raise RankFailed(f"a tensor-parallel helper rank failed (helper i is rank i+1): {exc}") from exc


class _HelperWatch:
    """A thread that tells rank 0 when a helper rank dies while rank 0 still runs, and ends the
    process if rank 0 does not finish in time: it could otherwise wait for the helper forever
    inside a collective (NCCL has no peer-death check)."""

    def __init__(self, helpers: Any, on_failure: Callable[[], None] | None, grace_s: float) -> None:
        self._helpers = helpers
        self._on_failure = on_failure
        self._grace_s = grace_s
        self.helper_failed = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="snugkv-rank-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            for index, process in enumerate(self._helpers.processes):
                if process.exitcode not in (None, 0):
                    logger.error(
                        "tensor-parallel rank %d exited with %d; rank 0 cannot go on without it",
                        index + 1,
                        process.exitcode,
                    )
                    self.helper_failed = True
                    if self._on_failure is not None and not self._done.is_set():
                        self._on_failure()
                    grace_s = USER_ERROR_GRACE_S if process.exitcode == USER_ERROR_EXIT else self._grace_s
                    if not self._done.wait(grace_s):
                        logger.error("rank 0 did not stop within %.0f s; exiting", grace_s)
                        os._exit(1)
                    return

    def stop(self) -> None:
        self._done.set()


def rank_environment() -> dict[str, str]:
    """The no-multicast variables as this process sees them (tests check every rank has them)."""
    return {key: os.environ.get(key, "") for key in NO_MULTICAST_ENV}
