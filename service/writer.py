"""Group commit for metric ingest: one writer thread per server process.

Requests hand their parsed steps to ``IngestWriter.submit`` and await the outcome. The writer thread
takes everything queued at that moment (up to ``max_points``) and writes it with
``metrics.ingest_many``: one transaction, one commit for the whole group. One trainer sees the
latency it would see with a thread per request (one hand-off to a thread and one back); eight
trainers at once share commits instead of queueing for the database lock one by one, and no request
pays for thread-pool bookkeeping. A request answers only after its points are committed.

Why a thread and not the event loop: the database drivers block, and the health rules are CPU work;
the loop must stay free to parse the next requests meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from rlvitals.service import metrics

if TYPE_CHECKING:
    from rlvitals.service.context import Services
    from rlvitals.service.schemas import StepIn

log = logging.getLogger("rlvitals.service.writer")

# A queued request: run id, its steps, how many points, the future to answer, the loop it lives on.
_Item = tuple[int, "list[StepIn]", int, "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class IngestWriter:
    def __init__(self, services: Services, *, max_points: int = 20_000):
        self.services = services
        self.max_points = max_points
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.groups = 0  # transactions written (/metrics: rlvitals_ingest_commits_total)
        self.requests = 0

    async def submit(self, run_id: int, steps: list[StepIn]) -> dict[str, int]:
        """Queue one request's steps; returns its ``metrics.ingest_many`` outcome or raises its error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        points = sum(len(step.metrics) for step in steps)
        with self._cond:
            self._queue.append((run_id, steps, points, future, loop))
            if self._thread is None:
                self._start()
            else:
                self._cond.notify()
        # A client that hangs up cancels the future, not the write: the points stay queued and are
        # stored; the writer skips answering a cancelled future.
        return await future

    def queued(self) -> int:
        """Requests waiting for the writer now."""
        return len(self._queue)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rlvitals-ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Write everything queued, then end the thread (a later ``submit`` starts a new one)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout)
            if thread.is_alive():
                log.warning("the ingest writer is still writing after %.0f s", timeout)
        with self._cond:
            self._stopping = False

    def _take(self) -> list[_Item] | None:
        with self._cond:
            while not self._queue:
                if self._stopping:
                    self._thread = None  # under the lock: the next submit starts a new thread
                    return None
                self._cond.wait()
            group = [self._queue.popleft()]
            points = group[0][2]
            while self._queue and points + self._queue[0][2] <= self.max_points:
                item = self._queue.popleft()
                points += item[2]
                group.append(item)
            return group

    def _run(self) -> None:
        held = self.services.db.held_writer()
        try:
            while (group := self._take()) is not None:
                self._write(group, held.write)
        finally:
            held.close()  # normally _take already let go; this covers a thread dying of a bug
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
                    if self._queue:
                        self._start()

    def _write(self, group: list[_Item], write) -> None:
        try:
            outcomes: list[Any] = metrics.ingest_many(
                self.services, [(i[0], i[1]) for i in group], write=write
            )
        except Exception as exc:  # a bug, not a database error (those come back per item)
            log.exception("ingest group failed")
            outcomes = [exc] * len(group)
        self.groups += 1
        self.requests += len(group)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for item, outcome in zip(group, outcomes, strict=True):
            by_loop.setdefault(item[4], []).append((item[3], outcome))
        for loop, answers in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_answer, answers)


def _answer(answers: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, outcome in answers:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
