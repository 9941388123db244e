"""The audit worker pool: uploaded batches are audited off the request path.

``submit`` stores the validated safetensors bytes in the ``audits`` table (status ``pending``), so
every replica can read them, and refuses with ``Busy`` (429 + Retry-After) once ``audit_queue_size``
jobs are waiting, so memory and disk never grow without bound, or once the run holds its fair share
of that queue (``_admit``), so one run cannot fill it for the others. Worker threads
claim jobs exactly once (``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL; SQLite serialises its
writers), run the batch contract's ``rlvitals.analyzers.verdicts.batch_audit.audit_batch`` (the loss audit, the group
diagnostics, the advantage check, the rollout correction, the distillation loss: this module only
queues and stores), store
the result, feed the run's health monitor (``audit_mismatch``, ``zero_advantage_groups``), publish an
``audit`` event, and then store the batch's histograms for the dashboard.

Idle workers wake at once when this process queues a job, on a NOTIFY from another replica, or at
worst every ``audit_poll_interval`` seconds. A job claimed by a replica that died is handed out again
after ``audit_claim_timeout`` seconds.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from rlvitals.analyzers.verdicts.entropy_dynamics import audit_points
from rlvitals.service.alerts import apply_findings
from rlvitals.service.batches import Batch
from rlvitals.service.encoding import jsonable
from rlvitals.service.errors import Busy, NotFound
from rlvitals.service.events import Event, EventBus
from rlvitals.service.fair_share import OVER_SHARE, fair_share
from rlvitals.service.health import HealthEngine
from rlvitals.service.incidents import apply_incident_updates
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database
from rlvitals.service.telemetry import Telemetry
from rlvitals.service.workers import WorkerThreads, release_memory

log = logging.getLogger("rlvitals.service.audits")


def audit_public(row: dict[str, Any]) -> dict[str, Any]:
    """The API shape of an audit row (``running`` is reported as ``pending``)."""
    result = row.get("result") or {}
    status = row["status"]
    return {
        "id": row["id"],
        "run_id": row["run_id"],
        "step": row["step"],
        "rank": row["rank"],
        "micro_batch": row["micro_batch"],
        "status": "pending" if status in ("receiving", "pending", "running") else status,
        "reported": row["reported"] or {},
        "recomputed": result.get("recomputed"),
        "verdicts": result.get("verdicts"),
        "explanation": result.get("explanation"),
        "summary": result.get("summary") or result.get("explanation"),
        "details": result.get("details") or {},
        "reported_as": _reported_as(row["reported"] or {}),
        "counterfactuals": result.get("counterfactuals"),
        "groups": result.get("groups"),
        "advantages": result.get("advantages"),
        "rollout": result.get("rollout"),
        "distillation": result.get("distillation"),
        "mismatch": result.get("mismatch"),
        "ok": result.get("ok"),
        "verdict": result.get("verdict"),
        "decided_by": result.get("decided_by"),
        "error": row.get("error"),
        "created_at": row["created_at"],
        "finished_at": row["finished_at"],
    }


def not_recomputable(exc: BaseException) -> dict[str, Any]:
    """The result of an audit the analyzers could not finish: a verdict that says why, no numbers."""
    reason = f"{type(exc).__name__}: {exc}"
    return {
        "ok": None,
        "verdict": f"not recomputable: {reason}",
        "decided_by": None,
        "explanation": f"This batch could not be recomputed ({reason}); nothing was compared.",
    }


def _reported_as(reported: dict[str, Any]) -> dict[str, str]:
    """``{audit metric: the name the trainer reported it under}`` (``pg_loss`` -> ``actor/pg_loss``),
    through the same alias table the audit used, so a page can put both on one row."""
    from rlvitals.analyzers.contract.audit_names import canonical_name

    return {canonical_name(name): name for name in reported}


def list_audits(ctx, run_id: int, *, step: int | None, limit: int, offset: int) -> dict[str, Any]:
    with ctx.db.read() as session:
        if not repo.run_exists(session=session, run_id=run_id):
            raise NotFound(f"run {run_id} does not exist")
        rows, count = repo.list_audits(session=session, run_id=run_id, step=step, limit=limit, offset=offset)
    return {"data": [audit_public(r) for r in rows], "count": count}


def get_audit(ctx, audit_id: int) -> dict[str, Any]:
    with ctx.db.read() as session:
        row = repo.get_audit(session=session, audit_id=audit_id)
    if row is None:
        raise NotFound(f"audit {audit_id} does not exist")
    return audit_public(row)


def audit_histograms(ctx, audit_id: int) -> dict[str, Any]:
    """The histograms of an audit's batch: stored with its result, else computed from its tensors
    while the server still holds them (``keep_batches``), else ``NotFound`` saying why."""
    with ctx.db.read() as session:
        row = repo.get_audit(session=session, audit_id=audit_id)
        if row is None:
            raise NotFound(f"audit {audit_id} does not exist")
        stored = (row.get("result") or {}).get("histograms")
        if stored:
            return stored
        blob = repo.get_audit_blob(session=session, audit_id=audit_id)
    if blob is None:
        raise NotFound(
            f"audit {audit_id} has no histograms and its tensors were dropped; the server stores them "
            "after each audit unless RLVITALS_AUDIT_HISTOGRAMS=false (RLVITALS_KEEP_BATCHES=true keeps "
            "the tensors themselves)"
        )
    from rlvitals.analyzers.contract.batch import AuditBatch
    from rlvitals.analyzers.verdicts.batch_audit import batch_histograms
    from rlvitals.service.batches import load_tensors

    batch = AuditBatch.stored(load_tensors(blob), config=row.get("config") or {}, reported=row["reported"])
    return jsonable(batch_histograms(batch))


class _Superseded(Exception):
    """The job was handed to another worker meanwhile (this one stalled past the claim timeout)."""


_CHUNKED_BYTES = 4 * 1024 * 1024  # SQLite: batches larger than this are written a chunk per transaction
_PROCESS = secrets.token_hex(4)  # tells this process from an earlier one with the same pid


def _alive(claimer: str) -> bool:
    """Whether the process named by a claimer's ``pid:token:thread`` (host stripped) still runs."""
    pid_text, _, rest = claimer.partition(":")
    if not pid_text.isdigit():
        return True  # not a name we wrote: leave it to the claim timeout
    pid = int(pid_text)
    if pid == os.getpid():
        return rest.partition(":")[0] == _PROCESS  # same pid, another token: a restarted container
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class AuditPool(WorkerThreads):
    thread_name = "rlvitals-audit"

    def __init__(
        self,
        settings: Settings,
        db: Database,
        bus: EventBus,
        health: HealthEngine,
        telemetry: Telemetry,
        *,
        threads_here: bool | None = None,
    ):
        self.settings = settings
        self.db = db
        self.bus = bus
        self.health = health
        self.evaluator = None  # the health evaluator (set by build_services): audits follow its work
        self.telemetry = telemetry
        super().__init__()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{_PROCESS}"
        self._filling = threading.Lock()
        # audits run in a worker process (audit_process) unless told to run here: in that process
        # itself, or with audit_process=false
        if threads_here is None:
            threads_here = not settings.audit_process
        self.child = None
        if not threads_here and settings.audit_workers:
            from rlvitals.service.audit_process import AuditProcess

            self.child = AuditProcess(
                settings,
                telemetry,
                waiting=self._waiting,
                on_frame=bus.deliver_frame,
                on_job=bus.notify_job,
            )

    # --- producer side -----------------------------------------------------------------------------
    def submit(self, *, run_id: int, batch: Batch, blob: bytes) -> tuple[int, str | None]:
        """Store and queue one upload -> (audit id, ``None``), or for a resend of an upload already
        stored (same ``record_id`` on this run) -> (its id, its current public status); a resend is
        neither stored, counted nor queued again, and never refused as ``Busy``."""
        now = time.time()
        # SQLite has one writer at a time: a large batch is written a chunk per transaction (the
        # trainers' writes pass between chunks) and joins the queue when it is whole
        chunked = self.db.is_sqlite and len(blob) > _CHUNKED_BYTES
        with self.db.write() as session:
            if not repo.run_exists(session=session, run_id=run_id):
                raise NotFound(f"run {run_id} does not exist")
            if batch.record_id is not None:
                existing = repo.audit_id_for_record(session=session, run_id=run_id, record_id=batch.record_id)
                if existing is not None:
                    return existing, self._status(session, existing)
            repo.lock_audit_queue(session=session)
            self._admit(run_id, repo.waiting_audits_by_run(session=session))
            values = {
                "run_id": run_id,
                "step": batch.step,
                "rank": batch.rank,
                "micro_batch": batch.micro_batch,
                "status": "receiving" if chunked else "pending",
                "claimed_by": self.worker_id if chunked else None,
                "config": batch.config,
                "reported": jsonable(batch.reported),
                "blob": blob,
                "nbytes": len(blob),
                "created_at": now,
            }
            if batch.record_id is None:
                audit_id = repo.insert_audit(session=session, values=values)
            else:
                audit_id, inserted = repo.insert_audit_once(
                    session=session, values={**values, "record_id": batch.record_id}
                )
                if not inserted:  # an identical upload committed meanwhile
                    return audit_id, self._status(session, audit_id)
            if not chunked:
                self.bus.stage_job(session=session, kind="audit")
        if chunked:
            self._fill(audit_id, blob)
        self.telemetry.count_batch()
        self.wake()
        return audit_id, None

    def _admit(self, run_id: int, waiting: dict[int, int]) -> None:
        """Raise ``Busy`` unless ``run_id`` may queue one more audit, given every run's waiting count.

        Each run with audits waiting has a fair share of the queue, ``max(1, audit_queue_size //
        runs with audits waiting)`` (this run counted): a run holding its share is refused, so one run
        uploading non-stop cannot take the queue from the others. The queue as a whole holds at most
        ``audit_queue_size``, except that a run under its share is still admitted while another run
        holds more than its share (it filled the queue before this run came), up to twice that."""
        size = self.settings.audit_queue_size
        decision = fair_share(size, waiting, run_id, 1)
        if decision.refused is None:
            return
        self.telemetry.count_batch("queue_full")
        if decision.refused == OVER_SHARE:
            mine, share, runs = decision.mine, decision.share, decision.parties
            raise Busy(
                f"this run holds its share of the audit queue ({mine} of its batches waiting; each of the "
                f"{runs} runs with audits waiting may hold {share} of audit_queue_size {size}); retry later",
                retry_after=1.0,
                detail={"waiting": decision.total, "limit": size, "run_waiting": mine, "run_share": share},
            )
        raise Busy(
            f"audit queue is full ({decision.total} batches waiting); retry later",
            retry_after=1.0,
            detail={"waiting": decision.total, "limit": size},
        )

    def _fill(self, audit_id: int, blob) -> None:
        """Write a ``receiving`` audit's blob chunk by chunk, then queue it; on failure remove it."""
        from rlvitals.service.storage import blobs

        try:
            with self._filling:  # one at a time: the trainers' writes wait for one upload's chunk at most
                blobs.fill_blob(self.db, repo.AUDIT_BLOBS, audit_id, blob)
            with self.db.write() as session:
                repo.received_audit(session=session, audit_id=audit_id)
                self.bus.stage_job(session=session, kind="audit")
        except BaseException:
            try:
                with self.db.write() as session:
                    repo.delete_audits(session=session, ids=[audit_id])
            except Exception as exc:  # left as 'receiving': the next start removes it
                log.warning("removing the unfinished upload of audit %s failed: %s", audit_id, exc)
            raise

    def drop_unfinished(self) -> int:
        """At start: uploads whose blob a process on this host that is gone was still writing (or,
        from any host, older than ``audit_claim_timeout``) are removed; their clients got no answer."""
        host = f"{socket.gethostname()}:"
        stale = time.time() - self.settings.audit_claim_timeout
        with self.db.write() as session:
            dead = [
                audit_id
                for audit_id, claimer, created in repo.receiving_audits(session=session)
                if created < stale
                or ((claimer or "").startswith(host) and not _alive((claimer or "")[len(host) :]))
            ]
            return repo.delete_audits(session=session, ids=dead)

    @staticmethod
    def _status(session, audit_id: int) -> str:
        return audit_public(repo.get_audit(session=session, audit_id=audit_id))["status"]

    # --- workers -------------------------------------------------------------------------------
    def _thread_count(self) -> int:
        return self.settings.audit_workers

    def _waiting(self) -> bool:
        with self.db.read() as session:
            return repo.count_waiting_audits(session=session) > 0

    def wake(self, _kind: str | None = None) -> None:
        if self.child is not None:
            self.child.wake()
        else:
            self._wake.set()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
        else:
            super().stop()

    def start(self) -> None:
        try:
            dropped = self.drop_unfinished()
        except Exception as exc:
            log.warning("removing unfinished uploads failed: %s", exc)
        else:
            if dropped:
                log.info("removed %d upload(s) left unfinished by processes that are gone", dropped)
        if self.child is not None:  # the worker process reclaims the dead's jobs when it starts
            self.child.start()
            return
        try:
            reclaimed = self.reclaim_dead()
        except Exception as exc:  # the claim timeout still hands them out
            log.warning("reclaiming audits of dead processes failed: %s", exc)
        else:
            if reclaimed:
                log.info("reclaimed %d audit job(s) claimed by processes that are gone", reclaimed)
        super().start()

    def reclaim_dead(self) -> int:
        """At start: jobs claimed on this host by a process that no longer runs (or by an earlier
        process with this pid, e.g. pid 1 in a restarted container: nothing here claimed anything
        yet) go back to the queue now, not after ``audit_claim_timeout``. Other hosts' claims wait
        for the timeout: their processes cannot be asked."""
        host = f"{socket.gethostname()}:"
        with self.db.write() as session:
            dead = [
                job_id
                for job_id, claimer in repo.running_claims(session=session, prefix=host)
                if not _alive(claimer[len(host) :])
            ]
            return repo.release_audits(session=session, ids=dead)

    def _join_timeout(self) -> float:
        return 30.0

    def _run(self) -> None:
        worker = f"{self.worker_id}:{threading.current_thread().name}"
        while not self._stop.is_set():
            try:
                job = self._claim(worker)
            except Exception as exc:  # database away: keep the worker alive
                log.warning("claiming an audit job failed: %s", exc)
                self._stop.wait(self.settings.audit_poll_interval)
                continue
            if job is None:
                if self._wake.wait(self.settings.audit_poll_interval):
                    self._wake.clear()
                continue
            self._wake.set()  # there may be more: let a sibling look too
            self.process(job, worker)
            job = None  # the batch's bytes go now, not with the next claim
            release_memory()

    def _claim(self, worker: str) -> dict[str, Any] | None:
        """Claim a job in a short write transaction, then read its blob in a read transaction (on
        SQLite, reading it under the writer lock would hold every other writer for that long)."""
        now = time.time()
        with self.db.write() as session:
            job = repo.claim_audit(
                session=session,
                worker=worker,
                now=now,
                stale_before=now - self.settings.audit_claim_timeout,
                with_blob=False,
            )
        if job is not None:
            with self.db.read() as session:
                job["blob"] = repo.get_audit_blob(session=session, audit_id=job["id"])
            if job["blob"] is None:  # finished meanwhile by a worker that had claimed it before
                return None
        return job

    def process(self, job: dict[str, Any], worker: str) -> None:
        from rlvitals.analyzers.contract.batch import AuditBatch
        from rlvitals.analyzers.verdicts.batch_audit import audit_batch
        from rlvitals.service.batches import load_tensors

        _log_token_passes()

        started = time.perf_counter()
        report = groups = batch = None
        error: str | None = None
        result, status, tensors = None, "error", None
        try:  # what fails here is the stored job, not the batch (a blob the storage lost): 'error'
            tensors = load_tensors(job["blob"])
        except Exception as exc:
            log.exception("audit %s: the stored batch cannot be read", job["id"])
            error = f"{type(exc).__name__}: {exc}"
        if tensors is not None:
            try:
                # validated at upload: only the config is parsed again (objects are not stored)
                batch = AuditBatch.stored(tensors, config=job["config"] or {}, reported=job["reported"] or {})
                result, report, groups = self._audit(job, batch, audit_batch)
            except Exception as exc:  # every accepted batch ends in a verdict, never in 'error'
                log.exception("audit %s: not recomputable", job["id"])
                result = not_recomputable(exc)
            status = "done"
        self.telemetry.observe_audit(status=status, seconds=time.perf_counter() - started)
        histograms_next = report is not None and self.settings.audit_histograms
        stored = self._store(
            job, worker, status=status, result=result, error=error, report=report, groups=groups,
            keep_blob=self.settings.keep_batches or histograms_next,
        )  # fmt: skip
        if stored and histograms_next:
            self._add_histograms(job, batch, result)

    def _audit(self, job: dict[str, Any], batch, audit_batch) -> tuple[dict, dict, Any]:
        """The batch's audit (JSON-safe result, the report, the group diagnostics); a fast-path
        defect (the reference path decided against the fast one) is counted and logged."""
        run_config = None
        if {"rollout_log_probs", "token_level_rewards", "teacher_log_probs"} & set(batch.tensors):
            with self.db.read() as session:  # the run's algorithm config, if the batch has none
                run_config = (repo.get_run(session=session, run_id=job["run_id"]) or {}).get("config")
        audited = audit_batch(batch, run_config=run_config)
        result = jsonable(audited.result)
        if result.get("fast_path_defect"):
            self.telemetry.count_fast_path_defect()
            log.warning(
                "fast-path defect in audit %s (run %s, step %s): the reference path decided; %s",
                job["id"], job["run_id"], job["step"], sorted(result["fast_path_defect"]),
            )  # fmt: skip
        return result, audited.result, audited.groups

    def _add_histograms(self, job: dict[str, Any], batch, result: dict) -> None:
        """The dashboard's ratio/advantage histograms, after the result is already visible (so they
        never delay it); then the tensors are dropped unless ``keep_batches``."""
        from rlvitals.analyzers.verdicts.batch_audit import batch_histograms

        histograms = None
        try:
            histograms = jsonable(batch_histograms(batch))
        except Exception as exc:  # histograms are an extra: the audit stands without them
            log.warning("histograms of audit %s failed: %s", job["id"], exc)
        with self.db.write() as session:
            repo.finish_histograms(
                session=session,
                audit_id=job["id"],
                result={**result, "histograms": histograms} if histograms is not None else None,
                drop_blob=not self.settings.keep_batches,
            )

    def _store(self, job, worker, *, status, result, error, report, groups, keep_blob) -> bool:
        run_id, step, now = job["run_id"], job["step"], time.time()
        events: list[Event] = []

        series = _mismatch_series(result)
        derived: list[tuple] = []

        def observe(monitor, cursor):
            findings = []
            if series:  # the mismatch series, as if logged: the trend rules read them
                findings.extend(monitor.observe(step, series))
            if report is not None:
                findings.extend(monitor.observe_audit(step, report))
            if groups is not None:
                findings.extend(monitor.observe_groups(step, groups))
            derived[:] = monitor.audit_series(step)  # rlvitals/entropy_cov, ... (stored as points)
            return findings, cursor

        if self.evaluator is not None:
            # the monitor sees the run's metrics written before this batch first, as the trainer sent them
            self.evaluator.settle(run_id)
        try:
            self._store_in_transaction(
                job, worker, status, result, error, report, observe, events, now, keep_blob, derived
            )
        except _Superseded:  # re-claimed by another worker after a stall: its result wins
            self.health.discard(run_id)
            return False
        except BaseException:
            self.health.discard(run_id)
            raise
        self.bus.flush(events)
        return True

    def _store_in_transaction(
        self, job, worker, status, result, error, report, observe, events, now, keep_blob, derived=()
    ) -> None:
        run_id = job["run_id"]
        series = _mismatch_series(result)
        with self.db.write() as session:
            observation = None
            if series:  # before the health state's lock, in the order metric ingest takes them
                _add_series(session, run_id, job["step"], series, now)
            if report is not None:
                observation = self.health.update(
                    session=session,
                    run_id=run_id,
                    run_config=lambda: (
                        (repo.get_run(session=session, run_id=run_id) or {}).get("config") or {}
                    ),
                    observe=observe,
                    now=now,
                )
            stored = repo.finish_audit(
                session=session,
                audit_id=job["id"],
                worker=worker,
                status=status,
                result=result,
                error=error,
                now=now,
                keep_blob=keep_blob,
            )
            if not stored:
                raise _Superseded
            if derived:
                repo.add_points(session=session, rows=audit_points(run_id, derived, now))
            changed = []
            incidents = []
            if observation is not None:
                changed = apply_findings(
                    session=session,
                    run_id=run_id,
                    run=lambda: repo.get_run(session=session, run_id=run_id),
                    findings=observation.findings,
                    open_episodes=False,
                    newest_step=None,
                    now=now,
                    settings=self.settings,
                )
                incidents = apply_incident_updates(
                    session=session,
                    run_id=run_id,
                    run=lambda: repo.get_run(session=session, run_id=run_id),
                    updates=observation.incident_updates,
                    now=now,
                    settings=self.settings,
                )
            row = repo.get_audit(session=session, audit_id=job["id"])
            events.append(Event(run_id, "audit", audit_public(row)))
            events.extend(Event(run_id, "alert", alert) for alert in changed)
            events.extend(Event(run_id, "incident", incident) for incident in incidents)
            self.bus.stage(session=session, events=events)
            if changed or incidents:
                self.bus.stage_job(session=session, kind="webhook")


def _mismatch_series(result: dict[str, Any] | None) -> dict[str, float]:
    """The ``rlvitals/mismatch/*`` series of an audit's mismatch report (none without one)."""
    return dict(((result or {}).get("mismatch") or {}).get("series") or {})


def _add_series(session, run_id: int, step: int, series: dict[str, float], now: float) -> None:
    """Write an audit's series to the run's metrics (insert-or-ignore: a second micro-batch of the same
    step keeps the first one's value); the data version moves so cached columns are read again."""
    if repo.advance_run(session=session, run_id=run_id, last_step=step, now=now):
        repo.add_points(
            session=session, rows=[(run_id, name, step, value, 0, None) for name, value in series.items()]
        )


_TOKEN_PASSES_LOGGED = threading.Event()


def _log_token_passes() -> None:
    """Once per process, at the first audit (the worker imports torch then, not at start): whether
    the audits run the compiled token passes or the slower torch ops, and why."""
    if not _TOKEN_PASSES_LOGGED.is_set():
        _TOKEN_PASSES_LOGGED.set()
        from rlvitals.analyzers.fast import native

        (log.info if native.module() is not None else log.warning)("audit token passes: %s", native.STATUS)
