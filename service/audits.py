"""The audit worker pool: uploaded batches are audited off the request path.

``submit`` stores the validated safetensors bytes in the ``audits`` table (status ``pending``), so
every replica can read them, and refuses with ``Busy`` (429 + Retry-After) once
``audit_queue_size`` jobs are waiting, so memory and disk never grow without bound. Worker threads
claim jobs exactly once (``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL; SQLite serialises its
writers), run ``rlvitals.analyzers.audit`` (+ ``group_diagnostics``, the advantages of
``algorithm.adv_estimator`` when ``token_level_rewards`` came along, and the rollout correction when
``rollout_log_probs`` did), store the result, feed the run's health
monitor (``audit_mismatch``, ``zero_advantage_groups``) and publish an ``audit`` event.

Idle workers wake at once when this process queues a job, on a NOTIFY from another replica, or at
worst every ``audit_poll_interval`` seconds. A job claimed by a replica that died is handed out again
after ``audit_claim_timeout`` seconds.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from rlvitals.service.alerts import apply_findings
from rlvitals.service.batches import Batch
from rlvitals.service.encoding import jsonable
from rlvitals.service.errors import Busy, NotFound
from rlvitals.service.events import Event, EventBus
from rlvitals.service.health import HealthEngine
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database
from rlvitals.service.telemetry import Telemetry
from rlvitals.service.workers import WorkerThreads

if TYPE_CHECKING:  # torch is imported with the first audit: a scalar-only server never loads it
    import torch

log = logging.getLogger("rlvitals.service.audits")

_SPELLED = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


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
        "status": "pending" if status in ("pending", "running") else status,
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
        "ok": result.get("ok"),
        "error": row.get("error"),
        "created_at": row["created_at"],
        "finished_at": row["finished_at"],
    }


def _reported_as(reported: dict[str, Any]) -> dict[str, str]:
    """``{audit metric: the name the trainer reported it under}`` (``pg_loss`` -> ``actor/pg_loss``),
    through the same alias table the audit used, so a page can put both on one row."""
    from rlvitals.analyzers.audit_names import canonical_name

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


def _decode_reported(reported: dict[str, Any]) -> dict[str, float | None]:
    return {k: (_SPELLED[v] if isinstance(v, str) else v) for k, v in (reported or {}).items()}


def run_audit(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    reported: dict[str, Any],
    run_config: dict[str, Any] | None = None,
):
    """Audit one batch -> (JSON-safe result, the result as the monitor reads it, group diagnostics).

    ``rlvitals.analyzers.audit`` checks the reported loss metrics. The ``algorithm`` section of the batch
    config (else of the run config: verl's ``algorithm.*``) drives two more checks, each of which fails
    the audit on a mismatch: with ``token_level_rewards`` (+ ``group_index``) the advantages are
    recomputed with ``adv_estimator``; with ``rollout_log_probs`` the rollout correction is recomputed
    and the reported ``rollout_corr/*`` values checked (``result["rollout"]``).
    """
    from rlvitals.analyzers import LossConfig, audit, group_diagnostics
    from rlvitals.analyzers.algorithm import AlgorithmConfig, audit_rollout, check_advantages
    from rlvitals.analyzers.trl import TrlLossConfig, is_trl_config

    decoded = _decode_reported(reported)
    algorithm = AlgorithmConfig.from_verl(config)
    if not algorithm.present and run_config:
        algorithm = AlgorithmConfig.from_verl(run_config)
    rollout = audit_rollout(algorithm, tensors, decoded)
    loss_tensors = tensors
    if rollout is not None and rollout["ok"] is not None and not rollout["config"]["bypass_mode"]:
        # verl's actor trains on the mask after rejection, its loss weighted by the IS weights (when the
        # trainer did not send the weights it applied, the loss is audited with the recomputed ones)
        loss_tensors = {**tensors, "response_mask": rollout["_mask"]}
        if rollout["_weights"] is not None and "rollout_is_weights" not in tensors:
            loss_tensors["rollout_is_weights"] = rollout["_weights"]
    if is_trl_config(config):  # a TRL GRPOTrainer batch: TRL's own loss, not verl's
        from rlvitals.analyzers.trl_audit import trl_audit

        report = trl_audit(TrlLossConfig.from_dict(config), loss_tensors, decoded)
    else:
        report = audit(LossConfig.from_verl(config), loss_tensors, decoded)
    result = report.to_dict()
    groups = None
    extra: list[str] = []
    if "token_level_rewards" in tensors and "group_index" in tensors:
        groups = group_diagnostics(
            tensors["token_level_rewards"], tensors["response_mask"], tensors["group_index"]
        ).to_dict()
        result["groups"] = groups
    if "token_level_rewards" in tensors and ("group_index" in tensors or algorithm.adv_estimator is not None):
        advantages = check_advantages(algorithm, tensors)
        result["advantages"] = advantages
        if advantages["ok"] is False:
            name = advantages["estimator"]
            extra.append(
                f"The sent advantages differ from {name.upper()} advantages (adv_estimator={name!r}) recomputed "
                f"from token_level_rewards and group_index by up to {advantages['max_abs_err']:.3g} "
                f"(norm_adv_by_std_in_grpo={advantages['norm_adv_by_std_in_grpo']}, gamma={advantages['gamma']})."
            )
    if rollout is not None:
        rollout.pop("_mask", None)
        rollout.pop("_weights", None)
        result["rollout"] = rollout
        if rollout["ok"] is False:
            extra.append(rollout["explanation"])
    if extra:
        # the summary (what the audit_mismatch alert says) names these findings too
        summary = str(result.get("summary") or "") if result["ok"] is False else ""
        summary = " ".join(part for part in (summary, extra[0]) if part)
        if len(extra) > 1:
            summary += f" (and {len(extra) - 1} more finding(s): see the explanation)"
        result["summary"] = summary
        result["ok"] = False
        result["explanation"] = " ".join([result["explanation"], *extra]).strip()
    return jsonable(result), result, groups


class _Superseded(Exception):
    """The job was handed to another worker meanwhile (this one stalled past the claim timeout)."""


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
    ):
        self.settings = settings
        self.db = db
        self.bus = bus
        self.health = health
        self.telemetry = telemetry
        super().__init__()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{_PROCESS}"

    # --- producer side -----------------------------------------------------------------------------
    def submit(self, *, run_id: int, batch: Batch, blob: bytes) -> tuple[int, str | None]:
        """Store and queue one upload -> (audit id, ``None``), or for a resend of an upload already
        stored (same ``record_id`` on this run) -> (its id, its current public status); a resend is
        neither stored, counted nor queued again, and never refused as ``Busy``."""
        now = time.time()
        with self.db.write() as session:
            if not repo.run_exists(session=session, run_id=run_id):
                raise NotFound(f"run {run_id} does not exist")
            if batch.record_id is not None:
                existing = repo.audit_id_for_record(session=session, run_id=run_id, record_id=batch.record_id)
                if existing is not None:
                    return existing, self._status(session, existing)
            repo.lock_audit_queue(session=session)
            waiting = repo.count_waiting_audits(session=session)
            if waiting >= self.settings.audit_queue_size:
                self.telemetry.count_batch("queue_full")
                raise Busy(
                    f"audit queue is full ({waiting} batches waiting); retry later",
                    retry_after=1.0,
                    detail={"waiting": waiting, "limit": self.settings.audit_queue_size},
                )
            values = {
                "run_id": run_id,
                "step": batch.step,
                "rank": batch.rank,
                "micro_batch": batch.micro_batch,
                "status": "pending",
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
            self.bus.stage_job(session=session, kind="audit")
        self.telemetry.count_batch()
        self._wake.set()
        return audit_id, None

    @staticmethod
    def _status(session, audit_id: int) -> str:
        return audit_public(repo.get_audit(session=session, audit_id=audit_id))["status"]

    # --- workers -------------------------------------------------------------------------------
    def _thread_count(self) -> int:
        return self.settings.audit_workers

    def start(self) -> None:
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

    def _claim(self, worker: str) -> dict[str, Any] | None:
        now = time.time()
        with self.db.write() as session:
            return repo.claim_audit(
                session=session, worker=worker, now=now, stale_before=now - self.settings.audit_claim_timeout
            )

    def process(self, job: dict[str, Any], worker: str) -> None:
        started = time.perf_counter()
        report = groups = None
        error: str | None = None
        try:
            from rlvitals.service.batches import load_tensors

            tensors = load_tensors(job["blob"])
            run_config = None
            if "rollout_log_probs" in tensors or "token_level_rewards" in tensors:
                with self.db.read() as session:  # the run's algorithm config, if the batch has none
                    run_config = (repo.get_run(session=session, run_id=job["run_id"]) or {}).get("config")
            result, report, groups = run_audit(
                job["config"] or {}, tensors, job["reported"] or {}, run_config=run_config
            )
            status = "done"
        except Exception as exc:  # a bad batch must not kill the worker: the audit is marked 'error'
            log.exception("audit %s failed", job["id"])
            result, status, error = None, "error", f"{type(exc).__name__}: {exc}"
        self.telemetry.observe_audit(status=status, seconds=time.perf_counter() - started)
        histograms_next = status == "done" and self.settings.audit_histograms
        stored = self._store(
            job, worker, status=status, result=result, error=error, report=report, groups=groups,
            keep_blob=self.settings.keep_batches or histograms_next,
        )  # fmt: skip
        if stored and histograms_next:
            self._add_histograms(job, tensors, result)

    def _add_histograms(self, job: dict[str, Any], tensors: dict[str, torch.Tensor], result: dict) -> None:
        """The dashboard's ratio/advantage histograms, after the result is already visible (so they
        never delay it); then the tensors are dropped unless ``keep_batches``."""
        from rlvitals.service.dashboard.histograms import batch_histograms

        histograms = None
        try:
            histograms = jsonable(batch_histograms(tensors, config=job["config"] or {}))
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

        def observe(monitor, cursor):
            findings = []
            if report is not None:
                findings.extend(monitor.observe_audit(step, report))
            if groups is not None:
                findings.extend(monitor.observe_groups(step, groups))
            return findings, cursor

        try:
            self._store_in_transaction(
                job, worker, status, result, error, report, observe, events, now, keep_blob
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
        self, job, worker, status, result, error, report, observe, events, now, keep_blob
    ) -> None:
        run_id = job["run_id"]
        with self.db.write() as session:
            observation = None
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
            changed = []
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
            row = repo.get_audit(session=session, audit_id=job["id"])
            events.append(Event(run_id, "audit", audit_public(row)))
            events.extend(Event(run_id, "alert", alert) for alert in changed)
            self.bus.stage(session=session, events=events)
            if changed:
                self.bus.stage_job(session=session, kind="webhook")
