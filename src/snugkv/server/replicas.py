"""`snugkv serve --dp N`: N `snugkv serve` replicas behind the router, watched by this process.

Each replica is an ordinary `snugkv serve` process (its own engine, scheduler and KV cache, sized
after capture as always; `--kv-elastic` replicas share a GPU as separate servers do) on a loopback
port of its own, and so is the router (`router.py`: smg). The front (`front.py`), in this process,
listens on the address clients use: it passes every request to the router, and a completion whose
prompt is token ids (which smg refuses) to a replica. This process starts them, copies their
output to its stderr with a `[replica N]` / `[router]` prefix (colour codes left out unless stderr
is a terminal), and:

- starts the router once every replica answers `/health` (it then registers them at once, with no
  failed probes in the log); when the router counts them healthy, the front starts listening and
  `snugkv is serving on URL` is announced;
- a replica that exits before that fails the whole start (the others would fail the same way);
- a replica that dies later is reported in one line and started again on its port (at most
  `max_restarts` times, then left down while the others go on); its in-flight requests fail
  (a stream ends with an error event; smg retries a non-streamed one on another replica);
  the router, which has no rotation of its own, is restarted the same way;
- Ctrl-C or SIGTERM stops the front taking connections, then the router and the replicas at once:
  the router takes nothing new and passes on the ends of what it forwarded, and the front the ends
  of what it passed on; each replica drains its in-flight requests (and cuts what is left, with
  finish_reason "abort") within its graceful shutdown, as one server does.

Children run in sessions of their own, so a terminal's Ctrl-C reaches only this process (which
stops them in that order), and get SIGTERM from Linux if this process dies (PR_SET_PDEATHSIG).
This module never looks inside a request (the front alone does, for a completion's prompt).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from snugkv.server.front import Front, FrontOptions
from snugkv.server.launch import GRACEFUL_SHUTDOWN_S
from snugkv.server.router import RouterOptions, healthy_workers, router_command

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health probe

POLL_S = 0.2
RESTART_DELAY_S = 1.0
# How long the router may take to count every ready replica healthy before the fleet is announced
# anyway (it adds the rest as its health checks pass).
ROUTER_REGISTRATION_S = 30.0
STOP_TIMEOUT_S = GRACEFUL_SHUTDOWN_S + 50.0  # a replica's drain, then releasing its engine

# A replica's access-log lines for the router's probes (every 2 s per replica): not copied.
_PROBE_LINE = re.compile(rb'"GET /(?:ready|health|v1/loads|metrics)\S* HTTP/1\.1" 200')
# The router's failed probes of replicas that are stopping, as they are told to: not copied then.
_FAILED_PROBE_LINE = re.compile(rb"health check failed for http://127\.0\.0\.1:\d+/ready")
# Terminal colour codes: smg colours its log lines whatever its output is (no flag turns it off).
_ANSI_ESCAPE = re.compile(rb"\x1b\[[0-9;]*m")

try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # not Linux: children then outlive a killed supervisor
    _LIBC = None


def _die_with_supervisor() -> None:
    """Runs in the child between fork and exec: SIGTERM it when this process exits."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica: its `snugkv serve` command (with its loopback port) and what its environment adds."""

    index: int
    port: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    host: str  # the front's address, where clients connect
    port: int
    replicas: list[ReplicaSpec]
    router_binary: str
    router_version: str
    router: RouterOptions
    max_restarts: int = 3
    secret_env: dict[str, str] = field(default_factory=dict)  # the API key, kept out of `ps`
    max_body_bytes: int = 4 << 20

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def router_url(self) -> str:
        return f"http://{self.router.host}:{self.router.port}"


class _Child:
    """One process of the fleet: how to start it again, its restarts, and a thread copying its output."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], stopping: threading.Event | None = None
    ) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.stopping = stopping  # set: the fleet is stopping (its replicas' probes fail, as they should)
        self.restarts = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.given_up = False

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_supervisor,
        )
        threading.Thread(
            target=self._copy_output, args=(self.process,), name=f"{self.name}-log", daemon=True
        ).start()

    def _copy_output(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        prefix = f"[{self.name}] ".encode()
        plain = not sys.stderr.isatty()  # a log file or a pipe gets no colour codes
        for line in process.stdout:
            if _PROBE_LINE.search(line):
                continue
            if self.stopping is not None and self.stopping.is_set() and _FAILED_PROBE_LINE.search(line):
                continue
            sys.stderr.buffer.write(prefix + (_ANSI_ESCAPE.sub(b"", line) if plain else line))
            sys.stderr.buffer.flush()

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()

    def wait(self, deadline: float) -> None:
        """Wait until `deadline` (monotonic), then kill its whole process group."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) did not stop in time; killing it", self.name, self.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"code {code}"


class Fleet:
    """The replicas, the router and the front of one `serve --dp` (see the module docstring)."""

    def __init__(self, spec: FleetSpec, sock: socket.socket) -> None:
        """`sock`: bound to the spec's host and port, not listening (the front listens on it)."""
        self.spec = spec
        base = {**os.environ, "TQDM_DISABLE": "1", **spec.secret_env}
        self.replicas = [
            _Child(f"replica {replica.index}", replica.command, {**base, **replica.env})
            for replica in spec.replicas
        ]
        worker_urls = [replica.url for replica in spec.replicas]
        self.stopping = threading.Event()
        command = router_command(spec.router_binary, worker_urls, spec.router)
        self.router = _Child("router", command, base, self.stopping)
        front_options = FrontOptions(
            router_port=spec.router.port,
            replica_ports=tuple(replica.port for replica in spec.replicas),
            api_key=spec.router.api_key,
            max_body_bytes=spec.max_body_bytes,
        )
        self.front = Front(sock, front_options)
        self.announced = False
        self._started_s = 0.0
        self._router_started_s = 0.0

    # -- running ------------------------------------------------------------------------
    def run(self) -> int:
        """Start everything, watch until a signal (or a failure) stops it; the exit code."""
        self._started_s = time.monotonic()
        with _signals_set(self.stopping):
            for child, replica in zip(self.replicas, self.spec.replicas, strict=True):
                child.start()
                logger.info("%s: pid %d on %s", child.name, child.pid, replica.url)
            try:
                code = self._watch()
            finally:
                self.stop()
        return code

    def _watch(self) -> int:
        while not self.stopping.wait(POLL_S):
            if self.router.process is None and self._replicas_healthy():
                self._start_router()
            for child in [*self.replicas, self.router]:
                code = child.exit_code()
                if code is None or child.given_up:
                    continue
                if not self.announced:
                    logger.error(
                        "%s exited with %s while the fleet started; stopping the others",
                        child.name,
                        describe_exit(code),
                    )
                    return 2 if code == 2 else 1
                self._restart_or_give_up(child, code)
            if all(child.given_up for child in self.replicas):
                logger.error(
                    "No replica is left (each one failed %d restarts); stopping", self.spec.max_restarts
                )
                return 1
            if self.router.given_up:
                logger.error("The router cannot be restarted; stopping")
                return 1
            if not self.announced and self.router.process is not None and self._router_ready():
                self.front.start()
                self.announced = True
                logger.info(
                    "snugkv is serving on %s (Ctrl-C to stop): %d replicas behind %s, policy %s, ready in %.1f s",
                    self.spec.url,
                    len(self.replicas),
                    self.spec.router_version or "smg",
                    self.spec.router.policy,
                    time.monotonic() - self._started_s,
                )
        return 0

    def _restart_or_give_up(self, child: _Child, code: int) -> None:
        if child.restarts >= self.spec.max_restarts:
            child.given_up = True
            logger.error(
                "%s (pid %d) exited with %s after %d restarts; leaving it down (the others go on)",
                child.name,
                child.pid,
                describe_exit(code),
                child.restarts,
            )
            return
        child.restarts += 1
        old_pid = child.pid
        time.sleep(RESTART_DELAY_S)  # a crash loop must not spin
        child.start()
        logger.error(
            "%s (pid %d) exited with %s; restarted as pid %d (restart %d of %d), the others go on",
            child.name,
            old_pid,
            describe_exit(code),
            child.pid,
            child.restarts,
            self.spec.max_restarts,
        )

    def _start_router(self) -> None:
        self.router.start()
        self._router_started_s = time.monotonic()
        logger.info(
            "router: %s, pid %d on %s, policy %s (its metrics: http://%s:%d/metrics)",
            self.spec.router_version or "smg",
            self.router.pid,
            self.spec.router_url,
            self.spec.router.policy,
            self.spec.router.metrics_host,
            self.spec.router.metrics_port,
        )

    def _replicas_healthy(self) -> bool:
        for replica in self.spec.replicas:
            try:
                if httpx.get(f"{replica.url}/health", timeout=2.0).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def _router_ready(self) -> bool:
        """The router counts every replica healthy (or has had its time to)."""
        healthy = healthy_workers(self.spec.router_url, self.spec.router.api_key)
        if len(healthy) >= len(self.replicas):
            return True
        if time.monotonic() - self._router_started_s > ROUTER_REGISTRATION_S:
            logger.warning(
                "The router counts %d of %d replicas healthy after %.0f s; announcing anyway",
                len(healthy),
                len(self.replicas),
                ROUTER_REGISTRATION_S,
            )
            return True
        return False

    # -- stopping -----------------------------------------------------------------------
    def stop(self) -> None:
        """The front stops taking connections, then the router and every replica stop at once: the
        router takes nothing new and passes on the ends of what it forwarded, which the replicas
        drain (cutting what is left) as one server does, so the fleet stops within one server's
        graceful time, not the router's and then theirs. The front passes those ends on too, and
        what it still holds once they are gone is cut."""
        self.stopping.set()
        self.front.stop_taking_connections()
        for child in [self.router, *self.replicas]:
            child.terminate()
        self.router.wait(time.monotonic() + self.spec.router.graceful_shutdown_s + 10.0)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.replicas:
            child.wait(deadline)
        self.front.close()
        if self.announced:
            logger.info("Stopped the router and %d replicas", len(self.replicas))


@contextlib.contextmanager
def _signals_set(event: threading.Event) -> Iterator[None]:
    """Ctrl-C and SIGTERM set `event` (the watch loop then stops the fleet in order)."""

    def handler(signum: int, frame: object) -> None:
        logger.info("%s: stopping the router and the replicas", signal.Signals(signum).name)
        event.set()

    previous: dict[int, Callable[..., object] | int | None] = {
        sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
