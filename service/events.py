"""Live events for SSE clients: new points, alert transitions, audit results.

Three buses with one interface:

- ``LocalBus`` (SQLite, one process): events fan out in-process to the subscribers' asyncio queues.
- ``SqliteLogBus`` (SQLite, ``--workers N``): writers append events to the ``event_payloads`` table
  in their transaction; every worker process tails it (every 50 ms) and fans out to its subscribers.
- ``PostgresBus`` (scale-out): events are sent with ``pg_notify`` inside the writer's transaction
  (so they leave only on commit) and every replica LISTENs on a dedicated psycopg connection and fans
  them out to its own subscribers. Payloads over NOTIFY's 8000-byte limit travel by reference through
  the ``event_payloads`` table. The same connection also carries ``jobs`` wake-ups so idle audit
  workers and webhook senders on every replica react at once instead of at their next poll.

Writers call ``stage(session, events)`` inside their transaction and ``flush(events)`` after commit.
Each event is rendered to its SSE frame once, whatever the number of subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlvitals.service.encoding import dumps
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database
from sqlalchemy.engine import Connection as Session

log = logging.getLogger("rlvitals.service.events")

EVENTS_CHANNEL = "rlvitals_events"
JOBS_CHANNEL = "rlvitals_jobs"
_NOTIFY_LIMIT = 7900  # bytes; PostgreSQL's limit is 8000


@dataclass(frozen=True)
class Event:
    run_id: int
    kind: str  # points | alert | audit
    data: Any

    def frame(self) -> str:
        return sse_frame(self.kind, dumps(self.data))


def sse_frame(kind: str, data_json: str) -> str:
    return f"event: {kind}\ndata: {data_json}\n\n"


@dataclass(eq=False)
class Subscription:
    run_id: int
    queue: asyncio.Queue
    closed: bool = field(default=False)


class EventBus:
    """Fan-out to subscribers of this process. Subclasses decide how events reach every process."""

    def __init__(self, *, queue_size: int = 1000):
        self.queue_size = queue_size
        self._subs: dict[int, set[Subscription]] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._job_listeners: list[Callable[[str], None]] = []

    # --- lifecycle (called from the app's lifespan, in the event loop) -------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the app's event loop (subscribers' queues live there)."""
        self._loop = loop

    def stop(self) -> None:
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:
            self._close(sub)

    # --- subscribers ----------------------------------------------------------------------------
    def subscribe(self, run_id: int) -> Subscription:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        sub = Subscription(run_id=run_id, queue=asyncio.Queue(maxsize=self.queue_size))
        with self._lock:
            self._subs.setdefault(run_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            group = self._subs.get(sub.run_id)
            if group is not None:
                group.discard(sub)
                if not group:
                    del self._subs[sub.run_id]

    def subscriber_count(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._subs.values())

    def wants(self, run_id: int) -> bool:
        """Whether building events for this run is worth it (someone may be listening)."""
        return True

    def on_job(self, callback: Callable[[str], None]) -> None:
        """``callback(kind)`` when another replica queued work (``audit`` / ``webhook``)."""
        self._job_listeners.append(callback)

    # --- publishing -----------------------------------------------------------------------------
    def stage(self, *, session: Session, events: list[Event]) -> None:
        """Inside the writer's transaction (PostgreSQL: NOTIFY on commit)."""

    def flush(self, events: list[Event]) -> None:
        """After the writer's commit (in-process delivery)."""

    def stage_job(self, *, session: Session, kind: str) -> None:
        """Tell idle workers on other replicas that work is waiting (PostgreSQL only)."""

    # --- delivery to this process's subscribers -------------------------------------------------
    def deliver_frame(self, run_id: int, frame: str) -> None:
        """An SSE frame built elsewhere (the audit worker process) to this process's subscribers."""
        self._deliver(run_id, frame)

    def notify_job(self, kind: str) -> None:
        """Work was queued elsewhere (``audit`` / ``webhook``): tell the listeners of ``on_job``."""
        for callback in self._job_listeners:
            callback(kind)

    def _deliver(self, run_id: int, frame: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._lock:
            subs = list(self._subs.get(run_id, ()))
        if not subs:
            return
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            loop.call_soon_threadsafe(self._put_all, subs, frame)

    def _put_all(self, subs: list[Subscription], frame: str) -> None:
        for sub in subs:
            if sub.closed:
                continue
            try:
                sub.queue.put_nowait(frame)
            except asyncio.QueueFull:  # a client that does not read: cut it off, never buffer more
                log.warning(
                    "SSE client of run %s fell %d events behind; disconnecting it",
                    sub.run_id,
                    self.queue_size,
                )
                self._close(sub)

    def _close(self, sub: Subscription) -> None:
        sub.closed = True
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)


class LocalBus(EventBus):
    def wants(self, run_id: int) -> bool:
        with self._lock:
            return run_id in self._subs

    def flush(self, events: list[Event]) -> None:
        for event in events:
            self._deliver(event.run_id, event.frame())


class PostgresBus(EventBus):
    def __init__(self, db: Database, *, queue_size: int = 1000):
        super().__init__(queue_size=queue_size)
        self.db = db
        self._stop = threading.Event()
        self.listening = threading.Event()
        self._thread: threading.Thread | None = None
        self._staged = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Also open the LISTEN connection (blocks until it listens, at most 15 s: call off-loop)."""
        super().start(loop)
        self._stop.clear()
        self._thread = threading.Thread(target=self._listen, name="rlvitals-listen", daemon=True)
        self._thread.start()
        if not self.listening.wait(15):
            log.warning("LISTEN connection not up after 15 s; live events from other replicas are delayed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        super().stop()

    def stage(self, *, session: Session, events: list[Event]) -> None:
        now = time.time()
        for event in events:
            payload = dumps({"run_id": event.run_id, "kind": event.kind, "data": event.data})
            if len(payload.encode()) > _NOTIFY_LIMIT:
                ref = repo.store_event_payload(session=session, payload=payload, now=now)
                payload = json.dumps({"run_id": event.run_id, "ref": ref})
                self._staged += 1
                if self._staged % 200 == 0:
                    repo.prune_event_payloads(session=session, before=now - 300)
            repo.notify(session=session, channel=EVENTS_CHANNEL, payload=payload)

    def stage_job(self, *, session: Session, kind: str) -> None:
        repo.notify(session=session, channel=JOBS_CHANNEL, payload=kind)

    def _listen(self) -> None:
        import psycopg

        backoff = 0.2
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.db.libpq_url(), autocommit=True) as conn:
                    conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    conn.execute(f"LISTEN {JOBS_CHANNEL}")
                    self.listening.set()
                    backoff = 0.2
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._handle(note.channel, note.payload)
            except Exception as exc:  # connection lost: keep trying, events resume on reconnect
                self.listening.clear()
                if self._stop.is_set():
                    return
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _handle(self, channel: str, payload: str) -> None:
        if channel == JOBS_CHANNEL:
            for callback in self._job_listeners:
                callback(payload)
            return
        try:
            message = json.loads(payload)
            run_id = int(message["run_id"])
            with self._lock:
                if run_id not in self._subs:
                    return
            if "ref" in message:
                with self.db.read() as session:
                    stored = repo.load_event_payload(session=session, payload_id=int(message["ref"]))
                if stored is None:
                    return
                message = json.loads(stored)
            self._deliver(
                run_id, sse_frame(message["kind"], json.dumps(message["data"], separators=(",", ":")))
            )
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring malformed event notification: %s", exc)


class SqliteLogBus(EventBus):
    """Events shared by the worker processes of one SQLite database through a tailed table."""

    POLL = 0.05  # seconds between tails
    KEEP = 120.0  # seconds events stay in the table

    def __init__(self, db: Database, *, queue_size: int = 1000):
        super().__init__(queue_size=queue_size)
        self.db = db
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_id = 0
        self._staged = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        super().start(loop)
        with self.db.read() as session:
            self._last_id = repo.last_event_payload_id(session=session)
        self._stop.clear()
        self._thread = threading.Thread(target=self._tail, name="rlvitals-tail", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        super().stop()

    def stage(self, *, session: Session, events: list[Event]) -> None:
        now = time.time()
        for event in events:
            payload = dumps({"run_id": event.run_id, "kind": event.kind, "data": event.data})
            repo.store_event_payload(session=session, payload=payload, now=now)
        self._staged += 1
        if self._staged % 500 == 0:
            repo.prune_event_payloads(session=session, before=now - self.KEEP)

    def _tail(self) -> None:
        while not self._stop.wait(self.POLL):
            try:
                with self._lock:
                    wanted = set(self._subs)
                with self.db.read() as session:
                    rows = repo.event_payloads_after(session=session, after_id=self._last_id)
            except Exception as exc:  # database busy or away: try again at the next tick
                log.warning("reading the event log failed: %s", exc)
                continue
            for payload_id, payload in rows:
                self._last_id = payload_id
                if not wanted:
                    continue
                try:
                    message = json.loads(payload)
                    if int(message["run_id"]) in wanted:
                        data = json.dumps(message["data"], separators=(",", ":"))
                        self._deliver(int(message["run_id"]), sse_frame(message["kind"], data))
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring malformed event row %s: %s", payload_id, exc)
