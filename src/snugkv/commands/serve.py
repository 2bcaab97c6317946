"""`snugkv serve`: an OpenAI-compatible HTTP API for the model (default: SmolLM2-135M-Instruct).

Serves POST /v1/completions and /v1/chat/completions (JSON or streamed as server-sent events),
GET /v1/models, /health, /server_info and /metrics, on 127.0.0.1:8000 unless --host and --port
say otherwise. Before opening it to other machines, set SNUGKV_API_KEY (or pass --api-key).
Ctrl-C or SIGTERM stops it once in-flight requests end (at most 10 s).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
from pathlib import Path

from snugkv.commands.engine_args import add_engine_arguments, engine_args_from

logger = logging.getLogger(__name__)

API_KEY_ENV = "SNUGKV_API_KEY"


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
        "--max-body-bytes", type=int, default=4 << 20, help="largest request body (default: 4 MiB)"
    )
    parser.add_argument("--disable-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    parser.set_defaults(func=run)


def port_number(value: str) -> int:
    """`--port`: 0 (any free port) to 65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number; use 0 to 65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; use 0 to 65535 (0 picks a free one)")
    return port


def build_async_engine(args: argparse.Namespace, metrics=None, tp=None):
    """Engine + scheduler thread for `args` (rank 0 of `tp`); returns (async engine, served model name)."""
    from snugkv.engine import Engine
    from snugkv.scheduler.async_engine import AsyncEngine

    engine = Engine(engine_args_from(args), tp=tp)
    name = args.served_model_name or _model_name(args.model, engine.loaded.source.path)
    async_engine = AsyncEngine(
        engine,
        tokenizer=_tokenizer_of(engine),
        model_name=name,
        metrics=metrics,
        enable_prefix_cache=not args.disable_prefix_cache,
    )
    return async_engine, name


def _model_name(model: str | None, path: Path) -> str:
    """A Hub id names the model as given (its snapshot directory is a commit hash); a path by its stem."""
    from snugkv.models.hub import is_hub_id

    if model is not None and not Path(model).expanduser().exists() and is_hub_id(model):
        return model
    return path.stem


def _tokenizer_of(engine):
    from snugkv.models.tokenizer import TokenizerUnavailable, load_tokenizer

    try:
        return load_tokenizer(engine.loaded.source, engine.config.eos_token_ids)
    except TokenizerUnavailable as exc:
        if engine.tp.is_first_rank:
            logger.warning("%s", exc)
        return None


def run(args: argparse.Namespace) -> int:
    from snugkv.distributed.launch import device_type_for, launch
    from snugkv.server.launch import GRACEFUL_SHUTDOWN_S, bind_socket

    # Hold the port now, so a taken one fails before the engine starts (listening comes later).
    sock = bind_socket(args.host, args.port, listen=False)
    with sock:
        return int(
            launch(
                _serve_rank,
                args.tp_size,
                (args,),
                device_type=device_type_for(args.device),
                leader_kwargs={"sock": sock},
                on_helper_failure=_stop_serving,
                helper_failure_grace_s=GRACEFUL_SHUTDOWN_S + 20,
            )
            or 0
        )


def _stop_serving() -> None:
    """A helper rank died (--tp): this server cannot generate any more. Stop as SIGTERM stops it
    (in-flight requests end, at the latest at the graceful-shutdown deadline, and the engine is
    released); the launch then fails, so the process exits non-zero and a supervisor restarts it."""
    logger.error("Stopping the server: a tensor-parallel rank is gone")
    os.kill(os.getpid(), signal.SIGTERM)


def _serve_rank(tp, args: argparse.Namespace, sock=None) -> int:
    """Rank 0 serves HTTP on `sock`; with --tp the other ranks follow its scheduler step by step."""
    if not tp.is_first_rank:
        return _follow(tp, args)
    from snugkv.server.app import create_app
    from snugkv.server.launch import serve
    from snugkv.server.metrics import ServerMetrics

    api_key = api_key_from(args)
    warn_if_open(args.host, api_key)
    metrics = ServerMetrics()
    async_engine, name = build_async_engine(args, metrics, tp)
    app = create_app(
        async_engine,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        served_model_name=name,
        metrics=metrics,
    )
    serve(
        app,
        host=args.host,
        port=args.port,
        sock=sock,
        on_shutdown=async_engine.stop,
        on_stop_requested=async_engine.abort_all,
    )
    return 0


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key if given (even empty: no key), else $SNUGKV_API_KEY; None or "" means no key."""
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


def _follow(tp, args: argparse.Namespace) -> int:
    from snugkv.engine import Engine
    from snugkv.scheduler import lockstep
    from snugkv.scheduler.scheduler import Scheduler

    engine = Engine(engine_args_from(args), tp=tp)
    try:
        scheduler = Scheduler.for_engine(
            engine, tokenizer=_tokenizer_of(engine), enable_prefix_cache=not args.disable_prefix_cache
        )
        lockstep.follow(scheduler, tp)
    finally:
        engine.close()
    return 0
