"""Spawning the engine process, with nothing heavy imported: `snugkv serve` starts its engine process
from its flags before it imports torch or the HTTP stack itself, so that the engine's imports, load and
capture run while the server process imports what it serves with (docs/bench/startup.md). The server
then hands the `StartedEngine` to `EngineProcess`, which waits for "ready".

The server checks the flags (`checked_engine_args`, which imports torch) while the engine process
imports; a bad one is one line and the engine process is killed. The engine process checks them too,
first thing, and sends a refusal back as its start-up error.
"""

from __future__ import annotations

import argparse
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


def start_from_flags(flags: argparse.Namespace) -> StartedEngine:
    """The engine process for `snugkv serve`'s flags (tensor parallel 1), spawned now."""
    values = {name: value for name, value in vars(flags).items() if not callable(value)}
    return spawn(_engine_main_from_flags, argparse.Namespace(**values), LogSettings.of_root())


def ignore_stop_signals() -> None:
    """The server owns shutdown: it sends "stop" (and Ctrl-C in a terminal reaches both processes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _engine_main_from_flags(conn: Connection, flags: argparse.Namespace, log: LogSettings) -> None:
    ignore_stop_signals()  # before the imports: a Ctrl-C during them is the server's to handle
    log.configure()
    from snugkv.driver.engine_process import engine_main_from_flags

    engine_main_from_flags(conn, flags, log)
