"""The health evaluator: the rules run on what metric writes committed, after the writes answered.

A metrics write stores its points and one ``health_feed`` row (run, step range, metric names) in one
transaction, and answers. This thread (one per server process) then takes a run with feed rows and,
in one write transaction:

1. claims the run's health state: on PostgreSQL its row ``FOR UPDATE SKIP LOCKED`` (a replica that
   finds it held moves on and comes back, so two replicas never evaluate one run's points at once);
   on SQLite the write transaction itself is the claim;
2. reads the points the feed rows name and feeds them to the run's ``HealthMonitor`` from its
   persisted cursor (steps past the newest it saw, names not yet seen at that step);
3. writes the alerts, incidents, webhook deliveries and live events, the monitor's state with its
   cursor (``health_states``), and deletes the feed rows it consumed.

A crash (kill -9) anywhere before the commit leaves all of it as it was: the feed rows are still
there and the next evaluation, on this server after a restart or on another replica, does it again
from the same persisted state. After the commit nothing is left to do twice. Runs whose writes
another replica stored (or that a crash left behind) are found by a scan every ``poll`` seconds.

How far the rules got is the feed itself: a write whose feed row is gone has been evaluated.
``wait`` blocks (bounded) until the writes up to a feed row are: the metrics write with
``?wait=rules`` (a trainer that halts on critical incidents waits for its answer) and the alert and
incident reads (which so show every write that answered before them) use it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import orjson
from rlvitals.analyzers.contract.batch_rules import NON_FINITE
from rlvitals.service.alerts import apply_findings
from rlvitals.service.encoding import jsonable
from rlvitals.service.events import Event
from rlvitals.service.incidents import apply_incident_updates
from rlvitals.service.storage import repository as repo
from rlvitals.service.workers import WorkerThreads

if TYPE_CHECKING:
    from rlvitals.service.context import Services

log = logging.getLogger("rlvitals.service.evaluator")

_NAN = NON_FINITE["NaN"]
_RETRY_BUSY = 0.02  # another replica holds the run: look again this much later (seconds)
_RETRY_FAILED = 1.0  # the database failed: this much later


class HealthEvaluator(WorkerThreads):
    thread_name = "rlvitals-health"

    def __init__(self, services: Services, *, poll: float = 0.25, batch: int = 500, spacing: float = 0.1):
        super().__init__()
        self.services = services
        self.poll = poll
        self.batch = batch  # feed rows per evaluation (one transaction)
        # A run written to again within ``spacing`` seconds of its last evaluation waits for the rest of
        # it: under a steady stream of writes one evaluation takes many of them (the state is written
        # once per evaluation), while the first write after a quiet spell is evaluated at once.
        self.spacing = spacing
        self._due: dict[int, float] = {}  # run id -> monotonic time it may be evaluated again
        self._last: dict[int, float] = {}  # run id -> monotonic time of its last evaluation
        # What this process's writes stored, by feed row: the evaluation reads it from here instead
        # of the points table when every row it takes is here (else, e.g. after a restart or for
        # another replica's writes, from the table). Bounded by points; the oldest go first.
        self._offered: dict[int, tuple[dict, dict, int]] = {}
        self._offered_points = 0
        self.max_offered_points = 200_000
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._generation = 0  # evaluations committed (wakes ``wait``)
        self.evaluations = 0
        self.ahead = 0  # evaluations whose rules ran before their transaction
        self.busy = 0  # runs found claimed by another replica

    def _thread_count(self) -> int:
        return 1

    def _join_timeout(self) -> float:
        return 30.0

    # --- scheduling ------------------------------------------------------------------------------
    def wake(self, run_ids: Any = ()) -> None:  # type: ignore[override]
        """The writer committed feed rows for ``run_ids``: evaluate them now."""
        with self._lock:
            for run_id in run_ids:
                if run_id not in self._due:
                    self._due[run_id] = self._last.get(run_id, -self.spacing) + self.spacing
        self._wake.set()

    def offer(self, feed_id: int, by_step: dict, wall: dict, points: int) -> None:
        """A write committed: ``by_step`` (``{step: {name: value}}``, the first value of a (step, name)
        as the table keeps it) and ``wall`` are what feed row ``feed_id`` stands for."""
        with self._lock:
            self._offered[feed_id] = (by_step, wall, points)
            self._offered_points += points
            while self._offered_points > self.max_offered_points and self._offered:
                oldest = next(iter(self._offered))
                self._offered_points -= self._offered.pop(oldest)[2]

    def _offered_for(self, ids: list[int]) -> list[tuple[dict, dict, int]] | None:
        with self._lock:
            if not all(i in self._offered for i in ids):
                return None
            return [self._offered[i] for i in ids]

    def _forget_offered(self, ids: list[int]) -> None:
        with self._lock:
            for i in ids:
                entry = self._offered.pop(i, None)
                if entry is not None:
                    self._offered_points -= entry[2]

    def _take_due(self, now: float) -> tuple[list[int], float | None]:
        with self._lock:
            due = [run_id for run_id, at in self._due.items() if at <= now]
            for run_id in due:
                del self._due[run_id]
            later = min(self._due.values(), default=None)
        return due, later

    def _later(self, run_id: int, at: float) -> None:
        with self._lock:
            self._due[run_id] = min(self._due.get(run_id, at), at)

    def _scan(self) -> None:
        with self.services.db.read() as session:
            runs = repo.feed_runs(session=session)
        if runs:
            self.wake(runs)

    def _run(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + self.poll
                try:
                    self._scan()
                except Exception as exc:  # the database is away: the next scan retries
                    log.warning("health evaluator: looking for writes to evaluate failed: %s", exc)
            due, later = self._take_due(now)
            if not due:
                until = next_scan if later is None else min(next_scan, later)
                self._wake.wait(max(0.0, until - time.monotonic()))
                continue
            for run_id in due:
                self._evaluate_or_retry(run_id)

    def _evaluate_or_retry(self, run_id: int) -> None:
        with self._lock:
            self._last[run_id] = time.monotonic()
            if len(self._last) > 10_000:  # forget the runs evaluated longest ago
                for old in sorted(self._last, key=self._last.__getitem__)[:5_000]:
                    del self._last[old]
        try:
            outcome = self.evaluate(run_id)
        except Exception as exc:  # its feed rows stay: evaluated again later, here or on a replica
            log.warning(
                "health evaluation of run %s failed (retrying in %.0f s): %s", run_id, _RETRY_FAILED, exc
            )
            self._later(run_id, time.monotonic() + _RETRY_FAILED)
            return
        if outcome == "busy":
            self.busy += 1
            self._later(run_id, time.monotonic() + _RETRY_BUSY)
        elif outcome == "more":
            self._later(run_id, 0.0)

    def stop(self) -> None:
        """End the thread, then evaluate what is left (bounded): a server stopped after a write
        answered still raises that write's alerts."""
        super().stop()
        self.drain(timeout=10.0)

    def drain(self, timeout: float) -> bool:
        """Evaluate every run with feed rows, in the calling thread, until none is left or ``timeout``
        passes; whether none is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with self.services.db.read() as session:
                    runs = repo.feed_runs(session=session)
            except Exception as exc:
                log.warning("health evaluator: evaluating the last writes failed: %s", exc)
                return False
            if not runs:
                return True
            for run_id in runs:
                try:
                    outcome = self.evaluate(run_id)
                except Exception as exc:
                    log.warning("health evaluation of run %s failed: %s", run_id, exc)
                    return False
                if outcome == "busy":
                    time.sleep(_RETRY_BUSY)
        return False

    # --- how far it got --------------------------------------------------------------------------
    def newest(self, run_id: int | None = None) -> int | None:
        """The newest feed row (of one run, or of all) now: what a reader waits for."""
        with self.services.db.read() as session:
            return repo.feed_newest(session=session, run_id=run_id)

    def wait(self, *, through: int | None, run_id: int | None = None, timeout: float) -> bool:
        """Block until every write up to feed row ``through`` (of ``run_id``, or of any run) has been
        evaluated, at most ``timeout`` seconds; whether it was."""
        if through is None:
            return True
        with self._lock:  # someone waits: no spacing for these runs
            for waited in [run_id] if run_id is not None else list(self._due):
                if waited in self._due:
                    self._due[waited] = 0.0
        self._wake.set()
        deadline = time.monotonic() + timeout
        while True:
            with self._done:
                generation = self._generation
            with self.services.db.read() as session:
                if not repo.feed_waiting(session=session, through=through, run_id=run_id):
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._done:  # woken by a commit here; another replica's is seen by the next look
                if self._generation == generation:
                    self._done.wait(min(remaining, 0.05))

    def settle(self, run_id: int | None = None) -> bool:
        """Wait (at most ``health_wait`` seconds) until the writes stored before this call are evaluated."""
        timeout = self.services.settings.health_wait
        if not timeout:
            return True
        return self.wait(through=self.newest(run_id), run_id=run_id, timeout=timeout)

    # --- one evaluation ----------------------------------------------------------------------------
    def evaluate(self, run_id: int) -> str:
        """Evaluate the run's oldest feed rows in one transaction: ``"done"``, ``"more"`` (rows are
        left), ``"empty"`` (nothing to do) or ``"busy"`` (another replica holds the run).

        When every feed row is one of this process's own writes and the process holds the run's live
        monitor, the rules run first, outside the transaction (``_ahead``): on SQLite the write
        transaction locks the whole database, and the rules' milliseconds would stall every other
        write meanwhile. The transaction then stores the outcome if the run's stored health version
        is still the one the monitor was at (nobody else evaluated it meanwhile); otherwise the
        monitor is dropped and the rows are evaluated in the transaction, from the stored state."""
        return self._commit(run_id, self._ahead(run_id))

    def _commit(self, run_id: int, ahead: _AheadRun | None) -> str:
        """``evaluate``'s transaction, given what ran ahead of it (or ``None``)."""
        ctx = self.services
        now = time.time()
        events: list[Event] = []
        changed: list = []
        try:
            with ctx.db.write() as session:
                claimed, version = repo.claim_health(session=session, run_id=run_id)
                if not claimed:
                    return "busy"  # (an Ahead is dropped: the next evaluation reloads the stored state)
                if ahead is not None and version == ahead.state.base:
                    self.ahead += 1
                    feed = ahead.feed
                    observation = ctx.health.commit_ahead(
                        session=session, run_id=run_id, ahead=ahead.state, signals=ahead.signals, now=now
                    )
                    changed, events = self._record(session, run_id, observation, ahead.read, now)
                else:
                    feed = repo.feed_of(session=session, run_id=run_id, limit=self.batch)
                    if not feed:
                        return "empty"
                    if version is None:  # a run made before health states existed: give it one
                        repo.ensure_health_row(session=session, run_id=run_id, now=now)
                        version = 0
                    changed, events = self._apply(session, run_id, feed, version, now)
                repo.drop_feed(session=session, ids=[row[0] for row in feed])
            self._forget_offered([row[0] for row in feed])
        except BaseException:
            ctx.health.discard(run_id)  # the monitor saw points whose evaluation was not stored
            raise
        ctx.bus.flush(events)
        if changed:
            ctx.webhooks.wake()
        with self._done:
            self._generation += 1
            self._done.notify_all()
        self.evaluations += 1
        return "more" if len(feed) >= self.batch else "done"

    def _ahead(self, run_id: int) -> _AheadRun | None:
        """The rules on the run's oldest feed rows, before the transaction (see ``evaluate``); ``None``
        when they cannot run ahead (a row this process did not write, or no live monitor here)."""
        ctx = self.services
        try:
            with ctx.db.read() as session:
                feed = repo.feed_of(session=session, run_id=run_id, limit=self.batch)
        except Exception:  # the transaction's path reports the database's trouble
            return None
        if not feed:
            return None
        offered = self._offered_for([row[0] for row in feed])
        if offered is None:
            return None
        first = min(row[1] for row in feed)
        last = max(row[2] for row in feed)
        read: dict[str, Any] = {"by_step": {}, "wall": {}}

        def observe(monitor, cursor):
            lo = first if cursor["step"] is None else max(first, cursor["step"])
            if lo <= last:
                read["by_step"], read["wall"] = _merged(offered, lo)
            return observe_steps(monitor, cursor, read["by_step"])

        state = ctx.health.observe_ahead(run_id, observe)
        if state is None:
            return None
        by_step = read["by_step"]
        return _AheadRun(feed, state, read, _signals(by_step[max(by_step)]) if by_step else None)

    def _apply(self, session, run_id: int, feed: list, version: int, now: float) -> tuple[list, list[Event]]:
        ctx = self.services
        first = min(row[1] for row in feed)
        last = max(row[2] for row in feed)
        names: set[str] = set()
        for row in feed:
            names.update(orjson.loads(row[3]))
        read: dict[str, Any] = {"by_step": {}, "wall": {}}
        offered = self._offered_for([row[0] for row in feed])

        def observe(monitor, cursor):
            lo = first if cursor["step"] is None else max(first, cursor["step"])
            if lo > last:
                pass
            elif offered is not None:  # this process's own writes: what they stored, in memory
                read["by_step"], read["wall"] = _merged(offered, lo)
            else:
                read["by_step"], read["wall"] = _steps(
                    repo.points_between(
                        session=session, run_id=run_id, names=sorted(names), first=lo, last=last
                    )
                )
            return observe_steps(monitor, cursor, read["by_step"])

        run_cache: dict[str, Any] = {}

        def run_row() -> dict[str, Any]:
            if "row" not in run_cache:
                run_cache["row"] = repo.get_run(session=session, run_id=run_id)
            return run_cache["row"]

        observation = ctx.health.update(
            session=session,
            run_id=run_id,
            run_config=lambda: run_row()["config"] or {},
            observe=observe,
            now=now,
            # the canonical signals of the newest step read (known once observe has read the points)
            signals=lambda: _signals(read["by_step"][max(read["by_step"])]) if read["by_step"] else None,
            locked_version=version,
        )
        if observation is None:
            return [], []
        return self._record(session, run_id, observation, read, now, run_row)

    def _record(self, session, run_id: int, observation, read: dict[str, Any], now: float, run_row=None):
        """Store an observation's alerts, incidents, live events and webhook job (in ``session``)."""
        ctx = self.services
        if run_row is None:
            run_cache: dict[str, Any] = {}

            def run_row() -> dict[str, Any]:
                if "row" not in run_cache:
                    run_cache["row"] = repo.get_run(session=session, run_id=run_id)
                return run_cache["row"]

        by_step = read["by_step"]
        newest = max(by_step) if by_step else None
        changed = apply_findings(
            session=session,
            run_id=run_id,
            run=run_row,
            findings=observation.findings,
            open_episodes=bool(observation.firing),
            newest_step=newest,
            now=now,
            settings=ctx.settings,
        )
        incidents = []
        if observation.incident_updates:
            incidents = apply_incident_updates(
                session=session,
                run_id=run_id,
                run=run_row,
                updates=observation.incident_updates,
                wall_times=read["wall"],
                now=now,
                settings=ctx.settings,
            )
        events: list[Event] = []
        if (changed or incidents) and ctx.bus.wants(run_id):
            events.extend(Event(run_id, "alert", alert) for alert in changed)
            events.extend(Event(run_id, "incident", incident) for incident in incidents)
            ctx.bus.stage(session=session, events=events)
        if (changed or incidents) and ctx.webhooks.enabled:
            ctx.bus.stage_job(session=session, kind="webhook")
        return changed or incidents, events


class _AheadRun:
    """``HealthEvaluator._ahead``'s outcome: the feed rows it covered, the advanced monitor
    (``service.health.Ahead``), the points it read and the newest step's canonical signals."""

    __slots__ = ("feed", "read", "signals", "state")

    def __init__(self, feed, state, read, signals):
        self.feed, self.state, self.read, self.signals = feed, state, read, signals


def observe_steps(monitor, cursor: dict[str, Any], by_step: dict[int, dict[str, float | None]]):
    """Feed ``by_step`` to ``monitor`` past ``cursor``: newer steps whole; at the newest step already
    seen, only metric names not seen there yet (a trainer logging one step in several writes);
    anything older was seen. ``(findings, new cursor)``."""
    feed: list[tuple[int, dict[str, float | None]]] = []
    last, seen = cursor["step"], set(cursor["names"])
    for step in sorted(by_step):
        metrics = by_step[step]
        if last is None or step > last:
            feed.append((step, metrics))
            last, seen = step, set(metrics)
        elif step == last:
            fresh = {name: value for name, value in metrics.items() if name not in seen}
            if fresh:
                feed.append((step, fresh))
                seen.update(fresh)
    # one call for the whole batch: the same checks as one observe per step, for less per step
    return monitor.observe_many(feed), {"step": last, "names": sorted(seen)}


def _merged(offered, lo: int) -> tuple[dict, dict]:
    """The offered writes (in feed order) from step ``lo`` on, as ``_steps`` reads them from the table:
    a (step, name) written twice keeps its first value."""
    if len(offered) == 1 and min(offered[0][0], default=lo) >= lo:
        return offered[0][0], offered[0][1]
    merged: dict[int, dict] = {}
    walls: dict[int, float | None] = {}
    for by_step, wall, _ in offered:
        for step, metrics in by_step.items():
            if step < lo:
                continue
            held = merged.get(step)
            if held is None:
                merged[step] = dict(metrics)
            else:
                for name, value in metrics.items():
                    held.setdefault(name, value)
            if walls.get(step) is None:
                walls[step] = wall.get(step)
    return merged, walls


def _steps(rows) -> tuple[dict[int, dict[str, float | None]], dict[int, float | None]]:
    """Stored points ``(name, step, value, flag, wall_time)`` as ``{step: {name: value}}`` (NaN back
    from its flag) and ``{step: wall_time}``."""
    by_step: dict[int, dict[str, float | None]] = {}
    wall: dict[int, float | None] = {}
    for name, step, value, flag, wall_time in rows:
        by_step.setdefault(step, {})[name] = _NAN if value is None and flag else value
        if wall.get(step) is None:
            wall[step] = wall_time
    return by_step, wall


def _signals(metrics: dict[str, float | None]) -> dict[str, Any] | None:
    from rlvitals.analyzers import canonical_signals

    found = canonical_signals(metrics)
    return jsonable(found) if found else None
