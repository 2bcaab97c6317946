"""`snugkv serve --dp N`: the flags, and turning one `serve` command line into N replicas' and a router's.

Every replica gets the `serve` flags it was given except those of the fleet (`--dp`, the router's,
`--host`, `--port`, `--api-key`): each listens on 127.0.0.1 on a free port, the key reaches it
through its environment, and the front (`server.front`) takes `--host`/`--port`, with the router
on a loopback port behind it. On GPUs each replica sees its own
`--tp` GPUs (`CUDA_VISIBLE_DEVICES`), or with `--kv-elastic` replicas may share them; on a CPU the
cores are split between the replicas. `server.replicas` runs the fleet.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

# Flags that describe the fleet, not one replica; a replica gets its own value or none.
FLEET_FLAGS = frozenset(
    {"dp_size", "router_policy", "router_metrics_port", "replica_restarts", "host", "port", "api_key"}
    | {"nnodes", "node_rank", "master_addr", "master_port", "help", "log_level"}
)


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    from snugkv.server.router import ROUTER_POLICIES

    group = parser.add_argument_group("replicas behind a router (--dp; needs `pip install 'snugkv[router]'`)")
    group.add_argument(
        "--dp",
        dest="dp_size",
        type=_replica_count,
        default=1,
        help="replicas: N `snugkv serve` processes (each with its own --tp GPUs) behind the smg router; "
        "--host/--port pass every request to the router, except a completion whose prompt is token ids "
        "(which smg cannot read), sent straight to the least loaded replica (default: 1, no router)",
    )
    group.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default="cache_aware",
        help="how the router picks a replica (default: cache_aware: the one whose cache shares most of the prompt)",
    )
    group.add_argument(
        "--router-metrics-port",
        type=int,
        default=0,
        help="port of the router's Prometheus metrics, on --host (default: 0, a free one)",
    )
    group.add_argument(
        "--replica-restarts",
        type=int,
        default=3,
        help="how often a replica (or the router) that dies is started again before it is left down (default: 3)",
    )


def _replica_count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of replicas; pass 1 or more") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count} replicas serve nothing; pass 1 or more")
    return count


def serve_replicas(
    args: argparse.Namespace, serve_parser: argparse.ArgumentParser, *, api_key: str | None, api_key_env: str
) -> int:
    """Run `args` (parsed by `serve_parser`) as `--dp` replicas behind the router; the exit code. The
    key reaches the replicas as `api_key_env` in their environment, the router on its command line."""
    from snugkv.distributed.launch import free_port
    from snugkv.server.replicas import Fleet, FleetSpec, ReplicaSpec
    from snugkv.server.router import RouterOptions, RouterUnavailable, find_router_binary, router_version
    from snugkv.server.sockets import bind_socket

    problem = _fleet_problem(args)
    if problem:
        logger.error("%s", problem)
        return 2
    try:
        binary = find_router_binary()
    except RouterUnavailable as exc:
        logger.error("%s", exc)
        return 2
    try:
        devices = replica_devices(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    # The front's port is held now, so a taken one fails before any replica loads a model.
    sock = bind_socket(args.host, args.port, listen=False)
    metrics_port = args.router_metrics_port or free_port()
    flags = replica_flags(args, serve_parser)
    head = [
        sys.executable,
        "-m",
        "snugkv",
        "--log-level",
        logging.getLevelName(logging.getLogger().level),
        "serve",
    ]
    threads = _cpu_threads_per_replica(args)
    replicas = []
    for index, visible in enumerate(devices):
        port = free_port()
        env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        replicas.append(
            ReplicaSpec(index, port, [*head, *flags, "--host", "127.0.0.1", "--port", str(port)], env)
        )
    from snugkv.server.launch import GRACEFUL_SHUTDOWN_S

    spec = FleetSpec(
        host=args.host,
        port=sock.getsockname()[1],
        replicas=replicas,
        router_binary=binary,
        router_version=router_version(binary),
        router=RouterOptions(
            host="127.0.0.1",
            port=free_port(),
            metrics_port=metrics_port,
            metrics_host=args.host,
            policy=args.router_policy,
            api_key=api_key or None,
            graceful_shutdown_s=GRACEFUL_SHUTDOWN_S,
        ),
        max_restarts=args.replica_restarts,
        # No key: nothing in the environment (an empty one is a key a replica refuses).
        secret_env={api_key_env: api_key} if api_key else {},
        max_body_bytes=args.max_body_bytes,
    )
    return Fleet(spec, sock).run()


def _fleet_problem(args: argparse.Namespace) -> str | None:
    if (getattr(args, "nnodes", None) or 1) > 1 or getattr(args, "node_rank", None):
        return (
            "--dp starts its replicas on this host; it does not run with --nnodes (for replicas on several "
            "hosts, run `snugkv serve` on each and one `smg launch --worker-urls ...` in front: docs/SCALE.md)"
        )
    if args.replica_restarts < 0:
        return f"--replica-restarts {args.replica_restarts} is negative; pass 0 (never restart) or more"
    if not 0 <= args.router_metrics_port <= 65535:
        return f"--router-metrics-port {args.router_metrics_port} is not a TCP port; use 0 to 65535"
    return None


def replica_flags(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> list[str]:
    """The `serve` flags of `args` that differ from their defaults, fleet flags left out."""
    flags: list[str] = []
    for action in serve_parser._actions:
        if action.dest in FLEET_FLAGS or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(option if value else "--no-" + option.removeprefix("--"))
        elif action.nargs == 0:  # store_true / store_false
            flags.append(option)
        elif isinstance(value, list | tuple):
            flags += [option, *map(str, value)]
        else:
            flags += [option, str(value)]
    return flags


def replica_devices(args: argparse.Namespace) -> list[str | None]:
    """Each replica's `CUDA_VISIBLE_DEVICES` (None: leave it as it is, on a CPU or a named GPU)."""
    from snugkv.distributed.launch import device_type_for  # torch: not while the parser is built

    dp, tp = args.dp_size, args.tp_size
    if device_type_for(args.device) == "cpu":
        return [None] * dp
    if args.device is not None and ":" in str(args.device):
        if not args.kv_elastic:
            raise ValueError(
                f"--dp {dp} with --device {args.device} puts every replica on one GPU; add --kv-elastic to "
                "share its memory between them, or drop --device to give each replica GPUs of its own"
            )
        return [None] * dp
    visible = _visible_gpus()
    if dp * tp <= len(visible):
        return [",".join(visible[i * tp : (i + 1) * tp]) for i in range(dp)]
    if args.kv_elastic and tp == 1:  # replicas take turns over the GPUs and share each one's memory
        return [visible[i % len(visible)] for i in range(dp)]
    raise ValueError(
        f"--dp {dp} x --tp {tp} needs {dp * tp} GPUs and {len(visible)} are visible; lower --dp, or share "
        "GPUs between replicas with --kv-elastic (at --tp 1)"
    )


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [device.strip() for device in listed.split(",") if device.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def _cpu_threads_per_replica(args: Any) -> int | None:
    """On a CPU the replicas split the cores (oversubscribed OpenMP threads spin against each
    other); None on GPUs or when OMP_NUM_THREADS is already set."""
    from snugkv.distributed.launch import device_type_for

    if device_type_for(args.device) != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // args.dp_size)
