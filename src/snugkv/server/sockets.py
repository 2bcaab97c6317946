"""The server's listening socket, bound before anything starts (so a taken port or a bad host is one
line before the engine loads); no HTTP stack imported here, so `snugkv serve` binds it before it
spawns the engine process."""

from __future__ import annotations

import errno
import socket

BACKLOG = 2048
# A client connection with no request for this long is closed by the server. Longer than the idle
# expiry of common clients (httpx, which the OpenAI SDK uses, drops idle connections after 5 s; a
# load balancer's idle timeout is often 60 s): with equal timers the client may send a request on
# a connection the server is closing at that moment, and see the stream cut (uvicorn's own default
# is 5 s).
KEEP_ALIVE_S = 75
MAX_PORT = 65535


class ServerBindError(OSError):
    """The address cannot be bound (port taken, bad host); the message names the flag to change."""

    def __str__(self) -> str:
        return str(self.strerror)


def bind_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port. Without `listen`, the port is only held: connections are
    refused (not queued) until `serve` starts listening, e.g. while the engine starts up."""
    if not 0 <= port <= MAX_PORT:
        raise ServerBindError(errno.EINVAL, f"--port {port} is not a TCP port; use 0 to {MAX_PORT}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ServerBindError(exc.errno, _bind_failure(host, port, exc)) from exc
    return sock


def _bind_failure(host: str, port: int, exc: OSError) -> str:
    """Which flag to change: the host when it is not an address of this machine, else the port."""
    if isinstance(exc, socket.gaierror):
        return (
            f"cannot listen on {host}:{port}: {host!r} is not an IP address or a name this machine "
            "resolves; choose another --host (127.0.0.1 for this machine only, 0.0.0.0 for every interface)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {host}:{port}: {host} is not an address of this machine; choose another "
            "--host (127.0.0.1 for this machine only, 0.0.0.0 for every interface)"
        )
    return f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port"
