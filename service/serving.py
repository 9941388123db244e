"""Running the app under uvicorn: one process, or ``--workers N`` processes sharing the socket.

One ``rlvitals serve`` per SQLite file (``sqlite_serve_lock``): its processes keep live state (the
health monitors, the event bus) that a second, independent ``serve`` on the same file would not
see. ``--workers N`` is the way to run several processes there: the parent holds the lock, and its
workers coordinate (detector state written with every update, events relayed through a table).

uvicorn#3149: with ``--workers > 1`` the accepted sockets miss ``TCP_NODELAY`` (the listening socket
is re-created from its file descriptor in each worker, so asyncio no longer recognises it as TCP and
skips its usual ``TCP_NODELAY``), and Nagle's algorithm meets the client's delayed ACK: about +40 ms
on every keep-alive request. ``NoDelayHTTPProtocol`` sets the option on every accepted connection,
whatever the worker count.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import socket

from uvicorn.protocols.http import h11_impl, httptools_impl
from uvicorn.protocols.http.auto import AutoHTTPProtocol

PROTOCOL = "rlvitals.service.serving:NoDelayHTTPProtocol"
SETTINGS_ENV = "_RLVITALS_SERVE_SETTINGS"  # how the parent hands its Settings to worker processes


class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's protocol with ``TCP_NODELAY`` (above), and a deadline for a new connection's first
    request headers (``Settings.header_timeout``; uvicorn has none, so a client that connects and
    trickles a header line every few seconds would hold a connection slot for ever)."""

    header_timeout: float | None = None  # set from the settings before uvicorn starts

    def connection_made(self, transport) -> None:  # type: ignore[override]
        set_nodelay(transport.get_extra_info("socket"))
        super().connection_made(transport)
        if self.header_timeout:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)


def uvicorn_limit_concurrency(max_connections: int) -> int:
    """uvicorn answers 503 once ``len(connections) >= limit_concurrency``, counting the connection
    asking: ``max_connections`` open connections are served, one more gets the 503."""
    return max_connections + 1


async def _over_connection_cap(scope, receive, send) -> None:
    """uvicorn's 503 past ``limit_concurrency`` (``max_connections``), in the one JSON error shape
    instead of its plain-text "Service Unavailable"."""
    from rlvitals.service.errors import error_response

    response = error_response(
        503,
        "unavailable",
        "the server holds as many connections as it accepts (max_connections): retry shortly",
        headers={"Retry-After": "1", "Connection": "close"},
    )
    await response(scope, receive, send)


for _impl in (httptools_impl, h11_impl):  # the name their protocols look up for that 503
    _impl.service_unavailable = _over_connection_cap


def set_nodelay(sock) -> None:
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def tune_gc() -> None:
    """Call once the app is built. Moves the long-lived objects of the loaded modules (torch,
    SQLAlchemy, FastAPI: a few hundred thousand) out of the cyclic collector's reach and makes young
    collections rarer. Without it, a 20,000-point history query spends most of its time in full
    collections triggered by its own row tuples (measured: 38 -> 11 ms CPU)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def app_from_env():
    """uvicorn factory for worker processes: the parent's Settings, passed as JSON in the env."""
    from rlvitals.service.app import create_app
    from rlvitals.service.settings import Settings

    settings = Settings(**json.loads(os.environ[SETTINGS_ENV]))
    NoDelayHTTPProtocol.header_timeout = settings.header_timeout
    app = create_app(settings)
    tune_gc()
    return app


class ServeLocked(RuntimeError):
    pass


def sqlite_serve_lock(database_url: str):
    """Lock ``<db>.serve.lock`` beside a SQLite database for this process's lifetime (an open file
    with an exclusive ``flock``; the kernel drops it when the process dies, however it dies). Raises
    ``ServeLocked`` naming the holder's pid. ``None`` (no lock needed) for PostgreSQL or memory."""
    from sqlalchemy.engine import make_url

    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    path = os.path.abspath(url.database) + ".serve.lock"
    handle = open(path, "a+")  # noqa: SIM115 (held open on purpose until the process exits)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise ServeLocked(
            f"another rlvitals serve (pid {holder}) already serves {url.database}; two servers on one "
            "SQLite file would each see only part of the steps. Stop it, use --workers N for more "
            "processes, or PostgreSQL for several servers."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
