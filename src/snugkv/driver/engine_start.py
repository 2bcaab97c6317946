"""Spawning the engine process, with nothing heavy imported (no torch, no engine, no HTTP stack):
`EngineProcess` spawns through it, and `snugkv serve` (commands/engine_spawn.py) spawns its engine
process from its flags before it imports torch or the HTTP stack itself, so that the engine's
imports, load and capture run while the server process imports what it serves with
(docs/bench/startup.md). `EngineProcess` then takes the `StartedEngine` over and waits for its
`Ready` (`wire`).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


@dataclass(frozen=True)
class LogSettings:
    """The server's logging, for the engine process to log as it does."""

    level: int = logging.INFO
    format: str | None = None
    datefmt: str | None = None

    @classmethod
    def of_root(cls) -> LogSettings:
        root = logging.getLogger()
        formatter = root.handlers[0].formatter if root.handlers else None
        return cls(root.level, getattr(formatter, "_fmt", None), getattr(formatter, "datefmt", None))

    def configure(self) -> None:
        logging.basicConfig(
            level=self.level,
            format=self.format or "%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt=self.datefmt,
            stream=sys.stderr,
        )


@dataclass
class StartedEngine:
    """A spawned engine process and the server's end of its pipe, not yet ready."""

    process: BaseProcess
    conn: Connection
    adopted: bool = False  # an `EngineProcess` owns it now

    def stop_unless_adopted(self) -> None:
        """The server failed before it took the engine over: end the engine process."""
        if self.adopted:
            return
        self.conn.close()
        if self.process.is_alive():  # it ignores SIGTERM (the server owns shutdown)
            self.process.kill()
        self.process.join(timeout=10)


def spawn(target: Callable[..., None], *args: Any) -> StartedEngine:
    """`target(conn, *args)` in a spawned process named snugkv-engine."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(target=target, args=(child_conn, *args), name="snugkv-engine", daemon=False)
    process.start()
    child_conn.close()
    return StartedEngine(process, conn)


def ignore_stop_signals() -> None:
    """The server owns shutdown: it sends `StopEngine` (and Ctrl-C in a terminal reaches both processes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
