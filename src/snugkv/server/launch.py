"""Running an app under uvicorn until Ctrl-C, then shutting down in order.

`serve` binds the socket itself (so a busy port fails with a clear message before anything
starts, and port 0 picks a free one), announces the address, runs uvicorn, and on Ctrl-C or
SIGTERM stops within `graceful_shutdown_s`, the release of the engine included: it stops taking
connections and lets in-flight requests finish; what is still running `RELEASE_RESERVE_S +
CUT_MARGIN_S` before the end is cut by `on_stop_requested` (the engine ends it with finish_reason
"abort", so the client sees a cut answer and not a normal finish), and a second Ctrl-C cuts at
once. Then `on_shutdown` runs (where the engine releases its pools), however serving ends.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from snugkv.core.process_clock import process_age_s
from snugkv.server.http11 import HttpProtocol
from snugkv.server.sockets import BACKLOG, KEEP_ALIVE_S, bind_socket

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
GRACEFUL_SHUTDOWN_S = 10  # from the stop signal to the end of `serve`, the engine's release included
# Kept at the end of the graceful time for `on_shutdown` (the engine releasing its memory, about
# 0.7 s on a CPU) and the process's exit; requests are cut before it. 3 s was too little for a
# `--dp 2` fleet on a loaded 2-core CI machine (10.4 s from the signal to the fleet's exit).
RELEASE_RESERVE_S = 4.0
# Requests are cut this long before uvicorn's own deadline, so that their last output ("abort")
# reaches the client before uvicorn cancels what is left.
CUT_MARGIN_S = 1.0


def serve(
    app: FastAPI,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    on_shutdown: Callable[[], None] | None = None,
    on_listening: Callable[[str], None] | None = None,
    on_stop_requested: Callable[[], None] | None = None,
    log_level: str = "info",
    graceful_shutdown_s: int = GRACEFUL_SHUTDOWN_S,
    sock: socket.socket | None = None,
) -> None:
    """Serve `app` on host:port (or on `sock`, already bound there) until interrupted;
    `on_listening(url)` runs once the socket is bound."""
    try:
        drain_s = max(graceful_shutdown_s - RELEASE_RESERVE_S, CUT_MARGIN_S)
        config = uvicorn.Config(
            app,
            http=HttpProtocol,
            log_level=log_level,
            timeout_graceful_shutdown=round(drain_s),
            timeout_keep_alive=KEEP_ALIVE_S,
            lifespan="off",
        )
        server = _Server(config, on_stop_requested, cut_after_s=drain_s - CUT_MARGIN_S)
        if sock is None:
            sock = bind_socket(host, port)
        else:
            sock.listen(BACKLOG)
        url = _url(host, sock.getsockname()[1])
        with sock, _signals_stop(server):
            age_s = process_age_s()
            ready = "" if age_s is None else f", {age_s:.1f} s after this process started"
            logger.info("snugkv is serving on %s (Ctrl-C to stop)%s", url, ready)
            if on_listening is not None:
                on_listening(url)
            try:
                server.run(sockets=[sock])
            finally:
                server.finish_cut_timer()
        logger.info("Stopped serving on %s", url)
    finally:
        if on_shutdown is not None:
            on_shutdown()


class _Server(uvicorn.Server):
    """uvicorn's server, which on the first stop signal lets in-flight requests run on and cuts
    them (`on_stop_requested`) `cut_after_s` later; on a second Ctrl-C at once. The cut requests
    end properly (finish_reason "abort") before the graceful-shutdown deadline."""

    def __init__(
        self, config: uvicorn.Config, on_stop_requested: Callable[[], None] | None, *, cut_after_s: float
    ) -> None:
        super().__init__(config)
        self._on_stop_requested = on_stop_requested
        self._cut_after_s = cut_after_s
        self._cut_timer: threading.Timer | None = None
        self._cut_lock = threading.Lock()

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._on_stop_requested is not None:
            if not self.should_exit:
                logger.info(
                    "Stopping: in-flight requests may finish for %.0f s, then they are cut", self._cut_after_s
                )
                self._cut_timer = threading.Timer(self._cut_after_s, self._cut)
                self._cut_timer.daemon = True
                self._cut_timer.start()
            elif sig == signal.SIGINT:  # uvicorn's force exit: no more waiting
                self._cut()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    def _cut(self) -> None:
        with self._cut_lock:
            if self._cut_timer is None or self._on_stop_requested is None:
                return
            self._cut_timer.cancel()
            self._cut_timer = None
            cut = self._on_stop_requested
        cut()

    def finish_cut_timer(self) -> None:
        """Serving is over: a cut not yet due has nothing left to cut."""
        with self._cut_lock:
            if self._cut_timer is not None:
                self._cut_timer.cancel()
                self._cut_timer = None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def _signals_stop(server: uvicorn.Server) -> Iterator[None]:
    """Ctrl-C and SIGTERM ask `server` to stop, also in the moments uvicorn is not listening for them.

    uvicorn installs its own handlers only while it runs, and re-raises the signal that stopped it
    once it is done; with the default handlers that would be a KeyboardInterrupt, or for SIGTERM
    the end of the process before `on_shutdown` ran. Around uvicorn, a signal sets `should_exit`
    instead: before start-up uvicorn then stops at once, after shutdown it is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_exit(signum: int, frame: object) -> None:
        logger.debug("%s: stopping", signal.Signals(signum).name)
        server.handle_exit(signum, frame)  # type: ignore[arg-type]

    previous = {sig: signal.signal(sig, request_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
