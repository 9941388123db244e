"""The background half of a run: a pump thread that drains the caller's queue, and a sender thread that posts.

    trainer thread ──append──▶ deque ──pump──▶ memory outbox (bounded) ──sender──▶ HTTP API v1
                                         └──▶ disk spool (over the bound, server unreachable, offline) ──┘

- The pump never touches the network: it resolves GPU copies, encodes step records and safetensors
  batches, and routes each to memory (server healthy, under ``max_memory_points``) or to the spool.
  If the spool cannot be written (disk full) records stay in memory up to twice the bound; beyond that
  they are dropped and counted — never silently.
- The sender sends the oldest first (spool segments, then memory), one request per segment or per up to
  ``max_steps_per_request`` step records, alternating with tensor batches. Connection errors, timeouts,
  5xx, 429 and auth failures are retried with capped exponential backoff and jitter (``Retry-After``
  respected); while failing, everything new goes to the spool so memory stays bounded and a crash loses
  nothing. Other 4xx answers mean the bytes can never succeed: counted as rejected, reported at finish.
- Locks are held only to move references, never across I/O. Both threads wait on ``Event.wait(timeout)``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass

from rlvitals.client.capture import CapturedBatch
from rlvitals.client.problems import Problems
from rlvitals.client.settings import ClientSettings
from rlvitals.client.spool import Spool, read_lines
from rlvitals.client.transport import HttpApi, RejectedError, RetryableError, RunNotFoundError
from rlvitals.client.values import encode_value


def encode_step(step: int, values: dict, wall_time: float, device: dict | None) -> tuple[bytes, int]:
    """One API step record as a JSON line (bytes are not tracked by the GC: less collector work while the
    trainer runs), and its point count."""
    if device is not None:
        values.update(device)
    metrics = {name: encode_value(value) for name, value in values.items()}
    body = json.dumps(metrics, allow_nan=False, separators=(",", ":"))
    return f'{{"step":{step},"metrics":{body},"wall_time":{wall_time!r}}}'.encode(), len(metrics)


@dataclass
class Stats:
    """Counters, each written by one background thread; read at finish."""

    points_logged: int = 0
    points_sent: int = 0
    points_spooled: int = 0
    points_dropped: int = 0
    points_rejected: int = 0
    batches_logged: int = 0
    batches_sent: int = 0
    batches_spooled: int = 0
    batches_dropped: int = 0
    batches_rejected: int = 0
    requests: int = 0
    retries: int = 0


class Worker:
    """Owns the two background threads of one ``Run`` in one process."""

    def __init__(
        self,
        *,
        queue: deque,
        wake: threading.Event,
        spool: Spool,
        settings: ClientSettings,
        problems: Problems,
        stats: Stats,
        api: HttpApi | None,
        run_id: str | None,
        online: bool,
    ) -> None:
        self.queue = queue
        self.wake = wake
        self.spool = spool
        self.settings = settings
        self.problems = problems
        self.stats = stats
        self.api = api
        self.run_id = run_id
        self.online = online and api is not None
        self.healthy = self.online and run_id is not None
        self.critical: list[dict] = []  # open critical incidents of the run, per the last metrics write
        self.answered = 0  # steps the server has answered for from memory (halt_on waits on it)
        self.answer = threading.Event()  # set after every answered metrics write
        self._lock = threading.Lock()
        self._mem_steps: deque[tuple[bytes, int]] = deque()  # (JSON line, points)
        self._mem_points = 0
        self._mem_batches: deque[list[bytes]] = deque()
        self._mem_batch_bytes = 0
        self._closing = threading.Event()
        self._stop = threading.Event()
        self._send_wake = threading.Event()
        self._pump_done = threading.Event()
        self._deadline: float | None = None
        self._batch_turn = False
        self._pump = threading.Thread(target=self._pump_main, name="rlvitals-pump", daemon=True)
        self._sender = (
            threading.Thread(target=self._send_main, name="rlvitals-sender", daemon=True)
            if self.online
            else None
        )

    def start(self) -> None:
        self._pump.start()
        if self._sender is not None:
            self._sender.start()

    # -- pump ---------------------------------------------------------------------------------
    def _pump_main(self) -> None:
        while True:
            closing = self._closing.is_set()
            if not closing:
                self.wake.wait(self.settings.flush_interval)
                self.wake.clear()
            try:
                self._drain()
            except Exception as exc:  # the outer boundary: a bug here must not stop the pump
                self.problems.report("internal", "encode records", repr(exc), "skipping them")
            if closing and not self.queue:
                break
        self._pump_done.set()
        self._send_wake.set()

    def _drain(self) -> None:
        items: list[tuple[bytes, int]] = []
        points = 0
        batches: list[CapturedBatch] = []
        queue = self.queue
        while True:
            try:
                item = queue.popleft()
            except IndexError:
                break
            if type(item) is tuple:
                line, count = encode_step(*item)
                items.append((line, count))
                points += count
                if len(items) >= 10_000:
                    self.stats.points_logged += points
                    self._route_steps(items, points)
                    items, points = [], 0
            else:
                batches.append(item)
        if items:
            self.stats.points_logged += points
            self._route_steps(items, points)
        for batch in batches:
            try:
                payload = batch.serialize()
            except Exception as exc:
                self.stats.batches_dropped += 1
                self.problems.report("batch", "serialize tensor batch", repr(exc), "this batch is dropped")
                continue
            self.stats.batches_logged += 1
            self._route_batch(payload)

    def _route_steps(self, items: list[tuple[bytes, int]], points: int) -> None:
        soft = self.settings.max_memory_points
        with self._lock:
            if self.healthy and self._mem_points + points <= soft:
                self._mem_steps.extend(items)
                self._mem_points += points
                items = []
        if items:
            self._park_steps(items, points, from_memory=False)
        if self._mem_points >= self.settings.max_steps_per_request:
            self._send_wake.set()

    def _park_steps(self, items: list[tuple[bytes, int]], points: int, *, from_memory: bool) -> None:
        """Spool records; if the disk refuses, keep them in memory (up to 2x the bound) or count the drop."""
        try:
            self.spool.append(items)
        except OSError as exc:
            where = "keeping them in memory and resending from there"
            with self._lock:
                hard = 2 * self.settings.max_memory_points
                if from_memory or self._mem_points + points <= hard:
                    self._mem_steps.extendleft(reversed(items))
                    if not from_memory:
                        self._mem_points += points
                    items = []
            if items:
                self.stats.points_dropped += points
                where = f"{points} points dropped (memory also full; counted, reported at finish)"
            self.problems.report("spool", f"write spool {self.spool.directory}", _os_cause(exc), where)
            return
        if from_memory:
            with self._lock:
                self._mem_points -= points
        self.stats.points_spooled += points
        self._send_wake.set()

    def _route_batch(self, payload: list[bytes]) -> None:
        size = _size(payload)
        with self._lock:
            if self.healthy and self._mem_batch_bytes + size <= self.settings.max_memory_batch_bytes:
                self._mem_batches.append(payload)
                self._mem_batch_bytes += size
                payload = []
        if payload:
            self._park_batch(payload)
        self._send_wake.set()

    def _park_batch(self, payload: list[bytes]) -> None:
        try:
            self.spool.write_batch(payload)
        except OSError as exc:
            self.stats.batches_dropped += 1
            self.problems.report(
                "spool-batch",
                f"write spool {self.spool.directory}",
                _os_cause(exc),
                "tensor batch dropped (counted)",
            )
            return
        self.stats.batches_spooled += 1

    # -- sender -------------------------------------------------------------------------------
    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _send_main(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                break
            try:
                outcome = self._send_once(remaining)
            except _Retry:
                outcome = "retry"
            except Exception as exc:  # the outer boundary: never let the sender die silently
                self.problems.report("internal", "send", repr(exc), "retrying")
                outcome = "retry"
            if outcome == "sent":
                attempt = 0
                self._retry_after = None
            elif outcome == "idle":
                if self._closing.is_set() and self._pump_done.is_set() and not self._has_pending():
                    break
                self._send_wake.wait(self.settings.flush_interval)
                self._send_wake.clear()
            elif outcome == "retry":
                self.stats.retries += 1
                delay = self.settings.retry.delay(attempt, self._retry_after)
                attempt += 1
                remaining = self._remaining()
                if remaining is not None:
                    delay = min(delay, max(0.0, remaining))
                self._stop.wait(delay)

    _retry_after: float | None = None

    def _has_pending(self) -> bool:
        return bool(self._mem_steps or self._mem_batches or self.spool.has_pending())

    def _failed(self, exc: RetryableError, what: str) -> str:
        self.healthy = False
        self._retry_after = exc.retry_after
        self.problems.report(
            "unreachable",
            exc.operation,
            exc.cause,
            f"{what}; spooling to {self.spool.directory} and retrying with backoff (max "
            f"{self.settings.retry.maximum:g} s)",
        )
        self._spill_memory()
        return "retry"

    def _spill_memory(self) -> None:
        """Move everything held in memory to the spool (it is failing anyway; a crash must not lose it)."""
        with self._lock:
            steps = list(self._mem_steps)
            self._mem_steps.clear()
            batches = list(self._mem_batches)
            self._mem_batches.clear()
            self._mem_batch_bytes = 0
        if steps:
            self._park_steps(steps, sum(points for _, points in steps), from_memory=True)
        for payload in batches:
            self._park_batch(payload)

    def _request_timeout(self, remaining: float | None) -> float | None:
        return None if remaining is None else max(0.05, remaining)

    def _send_once(self, remaining: float | None) -> str:
        api = self.api
        if self.run_id is None:
            info = self.spool.info
            try:
                self.run_id = api.create_run(
                    project=info.project,
                    name=info.name,
                    config=info.config,
                    tags=info.tags,
                    timeout=self._request_timeout(remaining),
                )
            except RetryableError as exc:
                return self._failed(exc, "records are kept")
            except RejectedError as exc:
                self.problems.report(
                    "rejected-run",
                    exc.operation,
                    exc.cause,
                    f"records stay in {self.spool.directory} for `rlvitals sync`",
                )
                self._spill_memory()
                return "retry"
        self._batch_turn = not self._batch_turn
        if self._batch_turn and self._send_batch(remaining):
            return "sent"
        return "sent" if self._send_steps(remaining) or self._send_batch(remaining) else "idle"

    def _send_steps(self, remaining: float | None) -> bool:
        """Send one request of step records, if any; True if one was attempted."""
        path = None
        steps: list[tuple[bytes, int]] = []
        if self.spool.sealed:
            path, points = self.spool.sealed[0]
            try:
                lines = read_lines(path)
            except OSError as exc:
                self.problems.report("spool", f"read spool segment {path}", _os_cause(exc), "skipping it")
                self.spool.sealed.popleft()
                return True
        elif self.spool.open_records and self.spool.seal():
            return True  # sealed: sent from the spool on the next turn
        else:
            with self._lock:
                lines = []
                points = 0
                limit = self.settings.max_steps_per_request
                while self._mem_steps and len(steps) < limit:
                    item = self._mem_steps.popleft()
                    steps.append(item)
                    lines.append(item[0])
                    points += item[1]
                self._mem_points -= points
            if not steps:
                return False
        try:
            self.stats.requests += 1
            self.api.post_metrics(self.run_id, lines, timeout=self._request_timeout(remaining))
        except RunNotFoundError:
            self._requeue(path, steps, points)
            self.run_id = None
            return True
        except RetryableError as exc:
            self._requeue(path, steps, points)
            raise _Retry(self._failed(exc, f"{points} points kept")) from None
        except RejectedError as exc:
            self.stats.points_rejected += points
            self.problems.report(
                "rejected",
                exc.operation,
                exc.cause,
                f"{points} points not stored (counted, reported at finish)",
            )
            if path is not None:
                self.spool.sealed.popleft()
                path.rename(path.with_name(path.name + ".rejected"))
            return True
        self.healthy = True
        self.critical = self.api.critical_incidents  # one assignment: the trainer's thread reads it
        if path is None:
            self.answered += len(steps)
        self.answer.set()
        self.stats.points_sent += points
        if path is not None:
            self.spool.sealed.popleft()
            path.unlink(missing_ok=True)
        return True

    def _requeue(self, path, steps: list[tuple[bytes, int]], points: int) -> None:
        if path is None:
            with self._lock:
                self._mem_steps.extendleft(reversed(steps))
                self._mem_points += points

    def _send_batch(self, remaining: float | None) -> bool:
        path = None
        if self.spool.batch_files:
            path = self.spool.batch_files[0]
            try:
                payload = [path.read_bytes()]
            except OSError as exc:
                self.problems.report("spool", f"read spooled batch {path}", _os_cause(exc), "skipping it")
                self.spool.batch_files.popleft()
                return True
        else:
            with self._lock:
                if not self._mem_batches:
                    return False
                payload = self._mem_batches.popleft()
                self._mem_batch_bytes -= _size(payload)
        try:
            self.stats.requests += 1
            self.api.post_batch(self.run_id, payload, timeout=self._request_timeout(remaining))
        except RunNotFoundError:
            self._requeue_batch(path, payload)
            self.run_id = None
            return True
        except RetryableError as exc:
            self._requeue_batch(path, payload)
            raise _Retry(self._failed(exc, "tensor batch kept")) from None
        except RejectedError as exc:
            self.stats.batches_rejected += 1
            self.problems.report(
                "rejected-batch", exc.operation, exc.cause, "this tensor batch is not stored (counted)"
            )
            if path is not None:
                self.spool.batch_files.popleft()
                path.rename(path.with_name(path.name + ".rejected"))
            return True
        self.healthy = True
        self.stats.batches_sent += 1
        if path is not None:
            self.spool.batch_files.popleft()
            path.unlink(missing_ok=True)
        return True

    def _requeue_batch(self, path, payload: list[bytes]) -> None:
        if path is None:
            with self._lock:
                self._mem_batches.appendleft(payload)
                self._mem_batch_bytes += _size(payload)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """Drain, send until done or ``timeout`` seconds pass, then spool whatever is left."""
        start = time.monotonic()
        self._deadline = start + max(0.0, timeout)
        self._closing.set()
        self.wake.set()
        self._pump.join(max(1.0, timeout))
        if self._sender is not None:
            self._send_wake.set()
            self._sender.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        self._stop.set()
        self._send_wake.set()
        if self._sender is not None:
            self._sender.join(2.0)
        self._spill_memory()
        with self._lock:  # the spool refused these too (disk full): they end with this process
            lost_points, lost_batches = self._mem_points, len(self._mem_batches)
            self._mem_steps.clear()
            self._mem_batches.clear()
            self._mem_points = self._mem_batch_bytes = 0
        if lost_points or lost_batches:
            self.stats.points_dropped += lost_points
            self.stats.batches_dropped += lost_batches
            self.problems.report(
                "spool",
                f"write spool {self.spool.directory}",
                "no space left at finish",
                f"{lost_points} points and {lost_batches} batches dropped (counted)",
            )
        self.spool.close()
        if self.api is not None:
            self.api.close()

    def memory_pending(self) -> tuple[int, int]:
        return self._mem_points, len(self._mem_batches)


class _Retry(Exception):
    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def _size(payload: list[bytes]) -> int:
    return sum(len(chunk) for chunk in payload)


def _os_cause(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}" if isinstance(exc, OSError) else repr(exc)
