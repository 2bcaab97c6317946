"""`snugkv serve`'s engine process, spawned from the parsed flags before the server process imports
torch or the HTTP stack (docs/bench/startup.md). Nothing heavy is imported here at import time.

The server checks the flags itself (`checked_engine_args`, which imports torch) while the engine
process imports; a bad one is one line and the engine process is killed. The engine process checks
them too, first thing, and sends a refusal back as its start-up error, which `EngineProcess` raises
in the server's process as itself.
"""

from __future__ import annotations

import argparse
from multiprocessing.connection import Connection

from snugkv.driver.engine_start import LogSettings, StartedEngine, ignore_stop_signals, spawn
from snugkv.kernels import compile_workers


def start_from_flags(flags: argparse.Namespace) -> StartedEngine:
    """The engine process for `snugkv serve`'s flags (tensor parallel 1), spawned now."""
    values = {name: value for name, value in vars(flags).items() if not callable(value)}
    return spawn(_engine_main_from_flags, argparse.Namespace(**values), LogSettings.of_root())


def _engine_main_from_flags(conn: Connection, flags: argparse.Namespace, log: LogSettings) -> None:
    ignore_stop_signals()  # before the imports: a Ctrl-C during them is the server's to handle
    log.configure()
    if getattr(flags, "device", None) != "cpu":  # a cold start's Triton compile workers
        compile_workers.start()  # their imports beside this process's (kernels/compile_ahead.py)
    from snugkv.commands.engine_args import checked_engine_args
    from snugkv.driver.engine_process import EngineSpec, engine_main, send_start_failure

    try:
        args = checked_engine_args(flags, warn=False)  # the server warns (it checks them too)
    except Exception as exc:
        send_start_failure(conn, exc)
        return
    engine_main(conn, EngineSpec(args, log=log))
