"""`snugkv serve`: an OpenAI-compatible HTTP API for the model (default: SmolLM2-135M-Instruct).

Serves POST /v1/completions and /v1/chat/completions (JSON or streamed as server-sent events),
GET /v1/models, /health, /server_info and /metrics, on 127.0.0.1:8000 unless --host and --port
say otherwise. Before opening it to other machines, set SNUGKV_API_KEY (or pass --api-key).
Ctrl-C or SIGTERM stops it once in-flight requests end (at most 10 s).
`--dp N` serves N replicas behind the smg router instead (`serve_replicas`); `--nnodes` spreads
the `--tp` ranks over several hosts (`distributed.nodes`).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from snugkv.commands.engine_args import add_engine_arguments, checked_engine_args, engine_args_from
from snugkv.commands.serve_replicas import add_replica_arguments
from snugkv.distributed.nodes import add_node_arguments

if TYPE_CHECKING:  # the commands import what they run lazily: `snugkv --help` loads no torch
    from fastapi import FastAPI

    from snugkv.distributed.group import TensorParallel
    from snugkv.driver.engine_process import EngineProcess
    from snugkv.driver.engine_start import StartedEngine
    from snugkv.driver.engine_thread import EngineThread
    from snugkv.engine import Engine
    from snugkv.engine.kv_sizing import StartGate
    from snugkv.memory_share.share import MemoryShare
    from snugkv.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

API_KEY_ENV = "SNUGKV_API_KEY"
DEFAULT_MEMORY_SHARE = 1.0
DEFAULT_KV_MIN_TOKENS = 4096
# Set while rank 0 serves (its signal handlers stop the server gracefully): `_stop_serving`.
_LISTENING = threading.Event()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument(
        "--port", type=port_number, default=8000, help="port (default: 8000; 0 picks a free one)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on all but /health (default: ${API_KEY_ENV}, which "
        "keeps the key out of `ps`)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: from the model)"
    )
    parser.add_argument(
        "--max-body-bytes", type=body_bytes, default=4 << 20, help="largest request body (default: 4 MiB)"
    )
    parser.add_argument("--disable-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine and its scheduler in a process of their own, so the HTTP server's Python "
        "work does not hold up the next step (default: on, except with --tp or --kv-elastic, which "
        "run it in the server's process)",
    )
    share = parser.add_argument_group("several engines on one GPU")
    share.add_argument(
        "--kv-elastic",
        action="store_true",
        help="share the GPU's memory with other --kv-elastic engines: ask them for room before loading, "
        "rebalance KV memory by demand and --memory-share, grow into what others free (post-capture only; "
        "KV chunks default to 16 MiB so that a shrink on a full GPU frees memory)",
    )
    share.add_argument(
        "--memory-share",
        type=positive_weight,
        default=None,
        metavar="W",
        help=f"--kv-elastic: this engine's weight when engines split KV memory (default: {DEFAULT_MEMORY_SHARE:g})",
    )
    share.add_argument(
        "--kv-min-tokens",
        type=int,
        default=None,
        help="--kv-elastic: the KV cache this engine asks for at start and never gives below "
        f"(default: {DEFAULT_KV_MIN_TOKENS})",
    )
    add_replica_arguments(parser)
    add_node_arguments(parser)
    parser.set_defaults(func=run)


def _serve_parser() -> argparse.ArgumentParser:
    """A fresh `serve` parser (`--dp` repeats each flag given to it for every replica)."""
    subparsers = argparse.ArgumentParser(add_help=False).add_subparsers()
    register(subparsers)
    parser: argparse.ArgumentParser = subparsers.choices["serve"]
    return parser


def positive_weight(value: str) -> float:
    """`--memory-share`: a positive number."""
    try:
        weight = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number; pass a weight such as 1 or 2.5"
        ) from None
    if not weight > 0 or weight == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive weight; pass a number above 0")
    return weight


def body_bytes(value: str) -> int:
    """`--max-body-bytes`: a positive number of bytes (0 would refuse every request)."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of bytes; pass e.g. 4194304") from None
    if size < 1:
        raise argparse.ArgumentTypeError(
            f"{size} bytes would refuse every request body; pass a positive size (default: 4 MiB)"
        )
    return size


def port_number(value: str) -> int:
    """`--port`: 0 (any free port) to 65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number; use 0 to 65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; use 0 to 65535 (0 picks a free one)")
    return port


def build_engine_thread(
    args: argparse.Namespace,
    metrics: ServerMetrics | None = None,
    tp: TensorParallel | None = None,
    after_engine: Callable[[Engine], None] | None = None,
    start_gate: StartGate | None = None,
) -> tuple[EngineThread, str]:
    """The engine core for `args` (rank 0 of `tp`) on a scheduler thread in this process; returns
    (engine thread, served model name). `after_engine(engine)` runs as soon as the engine is sized
    (before the tokenizer loads); `start_gate` bounds its KV cache at the sizing point."""
    from snugkv.driver.engine_core import EngineCore
    from snugkv.driver.engine_thread import EngineThread

    engine_args = engine_args_from(args)
    if start_gate is not None and args.guest_room_mib is None:
        # a memory share's engines: the share keeps room for a newcomer once for all of them
        engine_args = engine_args.with_settings(guest_room_mib=0)
    engine_thread = EngineThread.build(  # on the thread that runs its steps
        lambda: EngineCore.build(
            engine_args,
            tp=tp,
            after_engine=after_engine,
            start_gate=start_gate,
        ),
        model_name=lambda core: (
            args.served_model_name or _model_name(args.model, core.engine.loaded.source.path)
        ),
        metrics=metrics,
    )
    return engine_thread, engine_thread.model_name


def _model_name(model: str | None, path: Path) -> str:
    """A Hub id names the model as given (its snapshot directory is a commit hash); a path by its stem."""
    from snugkv.models.hub import is_hub_id

    if model is not None and not Path(model).expanduser().exists() and is_hub_id(model):
        return model
    return path.stem


def build_engine_process(
    args: argparse.Namespace,
    on_exit: Callable[[str], None] | None = None,
    started: StartedEngine | None = None,
) -> tuple[EngineProcess, str]:
    """--engine-process: the engine core and its scheduler thread in a child process (`started`, if
    `run` spawned it already); returns (client, name) once the engine is ready."""
    from snugkv.commands.engine_spawn import start_from_flags
    from snugkv.driver.engine_process import EngineProcess

    client = EngineProcess(started or start_from_flags(args), on_exit=on_exit)
    name = args.served_model_name or _model_name(args.model, client.source.path)
    client.model_name = name
    return client, name


def run(args: argparse.Namespace) -> int:
    from snugkv.commands.engine_spawn import start_from_flags
    from snugkv.distributed.nodes import NodePlacementError, placement_from
    from snugkv.server.sockets import bind_socket

    # The flags as given: replicas get these, not the defaults the checks below fill in (a filled-in
    # --memory-share would read to a replica as given without --kv-elastic).
    given = argparse.Namespace(**vars(args))
    problem = _api_key_problem(args) or _share_flags_problem(args)
    if problem:
        logger.error("%s", problem)
        return 2
    if getattr(args, "dp_size", 1) > 1:
        checked_engine_args(args)  # one line for a bad flag, before any replica starts
        from snugkv.commands.serve_replicas import serve_replicas

        return serve_replicas(given, _serve_parser(), api_key=api_key_from(args), api_key_env=API_KEY_ENV)
    try:
        nodes = placement_from(args)  # torchrun's environment may set --tp
    except NodePlacementError as exc:
        logger.error("%s", exc)
        return 2
    if getattr(args, "kv_elastic", False):
        problem = _kv_elastic_problem(args)
        if problem:
            logger.error("%s", problem)
            return 2
    problem = _choose_engine_process(args)
    if problem:
        logger.error("%s", problem)
        return 2
    # Hold the port now, so a taken one fails before the engine starts (listening comes later);
    # only rank 0's host serves HTTP.
    sock = bind_socket(args.host, args.port, listen=False) if nodes.hosts_rank_zero else None
    with sock if sock is not None else contextlib.nullcontext():
        # The engine process starts before this process imports torch and the HTTP stack: its
        # imports, load and capture overlap this process's imports (docs/bench/startup.md).
        started = start_from_flags(args) if args.engine_process else None
        try:
            checked_engine_args(args)  # a bad flag is one line, not a traceback after loading
            from snugkv.distributed.launch import device_type_for, launch
            from snugkv.server.launch import GRACEFUL_SHUTDOWN_S

            return int(
                launch(
                    _serve_rank,
                    args.tp_size,
                    (args,),
                    device_type=device_type_for(args.device),
                    leader_kwargs={"sock": sock, "started": started},
                    on_helper_failure=_stop_serving,
                    helper_failure_grace_s=GRACEFUL_SHUTDOWN_S + 20,
                    nodes=nodes,
                )
                or 0
            )
        finally:
            if started is not None:
                started.stop_unless_adopted()


def _api_key_problem(args: argparse.Namespace) -> str | None:
    """An empty key (`--api-key "$UNSET"`) would silently open the server to everyone."""
    key = api_key_from(args)
    if key is not None and not key.strip():
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        return (
            f"{source} is empty, which would turn authentication off; pass a key, or leave "
            f"{source} out to serve without one"
        )
    return None


def _share_flags_problem(args: argparse.Namespace) -> str | None:
    """--memory-share and --kv-min-tokens do nothing without --kv-elastic; sets their defaults."""
    for flag, name in (("--memory-share", "memory_share"), ("--kv-min-tokens", "kv_min_tokens")):
        if getattr(args, name, None) is not None and not getattr(args, "kv_elastic", False):
            return f"{flag} applies only with --kv-elastic; add --kv-elastic or drop {flag}"
    if getattr(args, "memory_share", None) is None:
        args.memory_share = DEFAULT_MEMORY_SHARE
    if getattr(args, "kv_min_tokens", None) is None:
        args.kv_min_tokens = DEFAULT_KV_MIN_TOKENS
    return None


def _kv_elastic_problem(args: argparse.Namespace) -> str | None:
    """Why --kv-elastic cannot run with these flags, or None."""
    if args.tp_size > 1:
        return "--kv-elastic shares one GPU between engines; it does not run with --tp yet (use --tp 1)"
    if args.kv_sizing not in (None, "post-capture"):
        return f"--kv-elastic resizes the KV cache at run time, which needs --kv-sizing post-capture, not {args.kv_sizing}"
    if args.kv_min_tokens < 2:
        return f"--kv-min-tokens {args.kv_min_tokens} is too small; pass at least 2"
    return None


def _choose_engine_process(args: argparse.Namespace) -> str | None:
    """Set `args.engine_process` (unset: on wherever it can run); returns why an explicit
    --engine-process cannot run with the other flags, or None."""
    requested = getattr(args, "engine_process", None)
    if args.tp_size > 1:
        problem = "--engine-process runs one engine in one process; it does not run with --tp yet"
    elif getattr(args, "kv_elastic", False):
        problem = "--engine-process does not run with --kv-elastic yet"
    else:
        args.engine_process = requested is not False
        return None
    args.engine_process = False
    return f"{problem} (drop --engine-process)" if requested else None


def _engine_exited(reason: str) -> None:
    """--engine-process: the engine process died. Stop as SIGTERM stops the server, so that the
    process exits and a supervisor restarts it."""
    logger.error("Stopping the server: %s", reason)
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_serving() -> None:
    """A helper rank died (--tp): this server cannot generate any more. Stop as SIGTERM stops it
    (in-flight requests end, at the latest at the graceful-shutdown deadline, and the engine is
    released); the launch then fails, so the process exits non-zero and a supervisor restarts it.

    Before the server listens there is nothing to stop gracefully, and a SIGTERM would kill rank 0
    in the middle of its start-up: it goes on instead, and meets the helper's refusal itself (a
    model that does not split: the same one-line error) or the launch's grace period ends it."""
    if not _LISTENING.is_set():
        logger.error("A tensor-parallel rank is gone before the server started")
        return
    logger.error("Stopping the server: a tensor-parallel rank is gone")
    os.kill(os.getpid(), signal.SIGTERM)


def _serve_rank(
    tp: TensorParallel,
    args: argparse.Namespace,
    sock: socket.socket | None = None,
    started: StartedEngine | None = None,
) -> int:
    """Rank 0 serves HTTP on `sock` (with the engine process `started`, if `run` spawned it); with
    --tp the other ranks follow its scheduler step by step."""
    if not tp.is_first_rank:
        return _follow(tp, args)
    from snugkv.server.app import create_app
    from snugkv.server.launch import serve
    from snugkv.server.metrics import ServerMetrics

    api_key = api_key_from(args)
    warn_if_open(args.host, api_key)
    metrics = ServerMetrics()
    share: MemoryShare | None = None
    client: EngineThread | EngineProcess
    engine_thread: EngineThread | None = None  # the engine in this process (--kv-elastic needs it)
    if getattr(args, "kv_elastic", False):
        from snugkv.memory_share.share import MemoryShareError

        try:
            share = _join_memory_share(args)
        except MemoryShareError as exc:
            logger.error("Cannot start: %s", exc)
            return 2
    try:
        if getattr(args, "engine_process", False):
            client, name = build_engine_process(args, on_exit=_engine_exited, started=started)
        else:
            with share.holding_others_headroom() if share is not None else contextlib.nullcontext():
                after = share.started if share is not None else None
                gate = share.agree_start_kv if share is not None else None
                engine_thread, name = build_engine_thread(
                    args, metrics, tp, after_engine=after, start_gate=gate
                )
            client = engine_thread
    except BaseException:
        if share is not None:
            share.leave()
        raise
    app = create_app(
        client,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        served_model_name=name,
        metrics=metrics,
    )
    on_shutdown = client.stop
    if share is not None and engine_thread is not None:
        on_shutdown = _share_then_stop(share, engine_thread, app, args.host, sock)
    try:
        serve(
            app,
            host=args.host,
            port=args.port,
            sock=sock,
            on_shutdown=on_shutdown,
            on_listening=lambda url: _LISTENING.set(),
            on_stop_requested=client.abort_all,
        )
    finally:
        _LISTENING.clear()
    died = getattr(client, "died", None)  # an engine process's
    if died:  # the server stopped because its engine process died: a supervisor should restart it
        logger.error("Stopped serving: %s", died)
        return 1
    return 0


def _join_memory_share(args: argparse.Namespace) -> MemoryShare:
    """--kv-elastic: register on the GPU's record and wait until the running engines made room."""
    from snugkv.memory_share.estimate import device_total_gib
    from snugkv.memory_share.share import MemoryShare, ShareOptions

    if args.kv_reserve_gib is None:  # room to grow into all the others may give back
        args.kv_reserve_gib = device_total_gib(engine_args_from(args))
    # The share sizes this engine (it gives back what a process outside takes, and grows only into
    # what the others leave): a pressure grow of its own would take what a starting engine was given.
    args.no_kv_pressure = True

    options = ShareOptions(weight=args.memory_share, min_tokens=args.kv_min_tokens)
    name = args.served_model_name or str(args.model or "default")
    return MemoryShare.before_start(engine_args_from(args), name, options)


def _share_then_stop(
    share: MemoryShare, engine_thread: EngineThread, app: FastAPI, host: str, sock: socket.socket | None
) -> Callable[[], None]:
    """Start rebalancing now; the returned shutdown stops it, then the engine, then leaves the record
    (after the memory is released, so the others grow only into memory that is free)."""
    from snugkv.memory_share.wake import asking_to_wake
    from snugkv.server.elastic_routes import install_share_routes

    port = sock.getsockname()[1] if sock is not None else 0
    share.attach(engine_thread, f"http://{host}:{port}")
    install_share_routes(app, share)
    # Every wake (the routes', or a direct call) asks the others for its memory first.
    engine_thread.wake_gate = lambda tags: asking_to_wake(share, tags)

    def stop() -> None:
        share.stop()
        try:
            engine_thread.stop()
        finally:
            share.leave()

    return stop


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key if given, else $SNUGKV_API_KEY; None means no key (an empty one is refused first)."""
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)


def warn_if_open(host: str, api_key: str | None) -> None:
    """One warning when the server is reachable from other machines and asks for no key."""
    if api_key or _is_loopback(host):
        return
    logger.warning(
        "Serving on %s without an API key: anyone who can reach this address can use the model; "
        "set %s (or pass --api-key)",
        host,
        API_KEY_ENV,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def _follow(tp: TensorParallel, args: argparse.Namespace) -> int:
    from snugkv.driver.follower import run_follower

    return run_follower(tp, engine_args_from(args))
