"""The router in front of `snugkv serve --dp N`: Shepherd Model Gateway (`smg` on PyPI), its own process.

snugkv grows no router of its own. smg 1.13 was chosen over sglang-router and vllm-router (see
docs/SCALE.md): it takes snugkv's servers as they are, its cache-aware policy mirrors the prompts
it routed in a radix tree per worker and sends a request to the worker whose tree shares most of
its text, it retries a non-streamed request on another worker when one fails, and it polls
`GET /v1/loads` for queue and KV figures. This module finds the `smg` binary, writes its command
line and reads its worker list; `replicas` runs it.

Flags chosen here, and why:
- `--health-check-endpoint /ready` with a 2 s interval, 2 failures to drop and 1 success to take
  back: a sleeping, broken or restarting replica leaves the rotation within ~4 s and returns ~2 s
  after it is ready (smg's defaults take a minute);
- `--cb-timeout-duration-secs 5`: a replica whose circuit opened (it failed requests) is tried again
  after 5 s, not 60, once its restart is done;
- `--disable-tokenizer-autoload`: smg routes on request text; it fetches nothing at start;
- `--shutdown-grace-period-secs` as snugkv's own graceful shutdown, so a stop drains in step;
- `--host 127.0.0.1`: the front (`front.py`) takes --host/--port and passes requests on to smg;
- `--prometheus-host` as `--host`: smg's default binds every interface.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUTER_BINARY = "smg"
ROUTER_PACKAGE = "smg==1.13.0"
ROUTER_POLICIES = (
    "cache_aware",
    "round_robin",
    "power_of_two",
    "least_load",
    "prefix_hash",
    "consistent_hashing",
    "random",
)
HEALTH_CHECK_INTERVAL_S = 2
CIRCUIT_BREAKER_RETRY_S = 5


class RouterUnavailable(RuntimeError):
    """The `smg` binary is not installed where this Python can find it."""


def find_router_binary() -> str:
    """`smg` beside this Python (its console script in the same environment), else on PATH."""
    beside = Path(sys.executable).parent / ROUTER_BINARY
    if beside.is_file():
        return str(beside)
    found = shutil.which(ROUTER_BINARY)
    if found is not None:
        return found
    raise RouterUnavailable(
        f"--dp needs the router `{ROUTER_BINARY}` (Shepherd Model Gateway), which is not installed here; "
        f"install it with `pip install 'snugkv[router]'` (or `pip install {ROUTER_PACKAGE}`)"
    )


def router_version(binary: str) -> str:
    """`smg --version`'s line, e.g. "smg 1.13.0" (sglang-router installs another `smg`: this tells them apart)."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=False)
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else ""


@dataclass(frozen=True, slots=True)
class RouterOptions:
    host: str  # where smg listens: loopback under `serve --dp`, where only the front reaches it
    port: int
    metrics_port: int
    metrics_host: str = "127.0.0.1"  # --host: its Prometheus metrics are read from other machines
    policy: str = "cache_aware"
    api_key: str | None = None
    graceful_shutdown_s: int = 10
    log_level: str = "warn"


def router_command(binary: str, worker_urls: list[str], options: RouterOptions) -> list[str]:
    """smg's command line for these workers (the key, if any, is the one clients and workers share)."""
    command = [
        binary, "launch",
        "--host", options.host, "--port", str(options.port),
        "--worker-urls", *worker_urls,
        "--policy", options.policy,
        "--disable-tokenizer-autoload",
        "--health-check-endpoint", "/ready",
        "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
        "--health-failure-threshold", "2",
        "--health-success-threshold", "1",
        "--worker-startup-check-interval", "1",
        "--cb-timeout-duration-secs", str(CIRCUIT_BREAKER_RETRY_S),
        "--shutdown-grace-period-secs", str(options.graceful_shutdown_s),
        "--prometheus-host", options.metrics_host, "--prometheus-port", str(options.metrics_port),
        "--log-level", options.log_level,
    ]  # fmt: skip
    if options.api_key:
        command += ["--api-key", options.api_key]
    return command


def healthy_workers(router_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> list[str]:
    """URLs of the workers smg counts healthy now (`GET /workers`); [] when it does not answer."""
    import httpx  # here: `serve`'s flags (ROUTER_POLICIES) are built by every snugkv command

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{router_url}/workers", headers=headers, timeout=timeout_s)
        if response.status_code != 200:
            return []
        workers: list[dict[str, Any]] = response.json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return []
    return [str(worker["url"]) for worker in workers if worker.get("is_healthy")]
