"""``GET /metrics``: Prometheus text exposition of the server's own counters plus, from the database,
the latest health signals per run and the firing alerts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from rlvitals.analyzers.contract.batch_rules import NAN, NEG_INF, POS_INF
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.total += 1
        self.sum += value


class Telemetry:
    """Process-local counters (each replica exposes its own; Prometheus sums them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ingest_requests = 0
        self.ingest_points = 0
        self.ingest_latency = Histogram()
        self.batches = 0
        self.batches_rejected: dict[str, int] = {}
        self.audits: dict[str, int] = {}
        self.audit_latency = Histogram()
        self.webhook_attempts: dict[str, int] = {}
        self.fast_path_defects = 0
        self.audit_worker_pid: int | None = None  # the audit worker process running now (if any)
        self.audit_worker_restarts = 0

    def audit_worker(self, *, pid: int | None, restarted: bool) -> None:
        """The audit worker process started (``pid``) or is gone (``None``; ``restarted``: it died
        and is being replaced)."""
        with self._lock:
            self.audit_worker_pid = pid
            if restarted:
                self.audit_worker_restarts += 1

    def observe_ingest(self, *, points: int, seconds: float) -> None:
        with self._lock:
            self.ingest_requests += 1
            self.ingest_points += points
            self.ingest_latency.observe(seconds)

    def count_batch(self, outcome: str = "accepted") -> None:
        with self._lock:
            if outcome == "accepted":
                self.batches += 1
            else:
                self.batches_rejected[outcome] = self.batches_rejected.get(outcome, 0) + 1

    def observe_audit(self, *, status: str, seconds: float) -> None:
        with self._lock:
            self.audits[status] = self.audits.get(status, 0) + 1
            self.audit_latency.observe(seconds)

    def count_fast_path_defect(self) -> None:
        with self._lock:
            self.fast_path_defects += 1

    def count_webhook(self, outcome: str) -> None:
        with self._lock:
            self.webhook_attempts[outcome] = self.webhook_attempts.get(outcome, 0) + 1

    def render(
        self,
        db: Database,
        *,
        sse_clients: int,
        live_signals: dict[int, dict] | None = None,
        ingest_commits: int = 0,
        ingest_queued: int = 0,
    ) -> str:
        out: list[str] = []
        _metric(
            out,
            "rlvitals_ingest_commits_total",
            "counter",
            "Transactions the ingest writer committed (requests / commits = the mean group size).",
            [({}, ingest_commits)],
        )
        _metric(
            out,
            "rlvitals_ingest_queued",
            "gauge",
            "Ingest requests waiting for the writer now.",
            [({}, ingest_queued)],
        )
        with self._lock:
            _metric(
                out,
                "rlvitals_ingest_requests_total",
                "counter",
                "POST /metrics requests handled.",
                [({}, self.ingest_requests)],
            )
            _metric(
                out,
                "rlvitals_ingest_points_total",
                "counter",
                "Metric points accepted.",
                [({}, self.ingest_points)],
            )
            _histogram(out, "rlvitals_ingest_seconds", "Server time per ingest request.", self.ingest_latency)
            _metric(
                out,
                "rlvitals_batches_total",
                "counter",
                "Tensor batches accepted for audit.",
                [({}, self.batches)],
            )
            _metric(
                out,
                "rlvitals_batches_rejected_total",
                "counter",
                "Tensor batches refused, by reason.",
                [({"reason": k}, v) for k, v in sorted(self.batches_rejected.items())],
            )
            _metric(
                out,
                "rlvitals_audits_total",
                "counter",
                "Audits finished by this process, by status.",
                [({"status": k}, v) for k, v in sorted(self.audits.items())],
            )
            _histogram(out, "rlvitals_audit_seconds", "Worker time per audit.", self.audit_latency)
            _metric(
                out,
                "rlvitals_fast_path_defects_total",
                "counter",
                "Audits whose compiled fast path disagreed with the reference path (the reference decided).",
                [({}, self.fast_path_defects)],
            )
            _metric(
                out,
                "rlvitals_audit_worker_up",
                "gauge",
                "1 while this server's audit worker process runs (it starts with the first queued audit).",
                [({}, int(self.audit_worker_pid is not None))],
            )
            _metric(
                out,
                "rlvitals_audit_worker_pid",
                "gauge",
                "The process id of this server's audit worker process (0: none running).",
                [({}, self.audit_worker_pid or 0)],
            )
            _metric(
                out,
                "rlvitals_audit_worker_restarts_total",
                "counter",
                "Times this server's audit worker process died and was started again.",
                [({}, self.audit_worker_restarts)],
            )
            _metric(
                out,
                "rlvitals_webhook_attempts_total",
                "counter",
                "Webhook delivery attempts, by outcome.",
                [({"outcome": k}, v) for k, v in sorted(self.webhook_attempts.items())],
            )
        _metric(
            out,
            "rlvitals_sse_clients",
            "gauge",
            "Live event streams open on this process.",
            [({}, sse_clients)],
        )
        with db.read() as session:
            queued = repo.audit_status_counts(session=session)
            oldest = repo.oldest_pending_audits(session=session)
            signals = repo.health_signals(session=session)
            firing = repo.firing_counts(session=session)
        _metric(
            out,
            "rlvitals_audit_jobs",
            "gauge",
            "Audit jobs in the database, by status.",
            [({"status": k}, v) for k, v in sorted(queued.items())],
        )
        now = time.time()
        _metric(
            out,
            "rlvitals_audit_oldest_pending_seconds",
            "gauge",
            "Per run with pending audits: how long its oldest pending audit has waited.",
            [
                (
                    {"run_id": r["id"], "project": r["project"], "run": r["name"]},
                    max(0.0, now - r["created_at"]),
                )
                for r in oldest
            ],
        )
        samples = []
        live = live_signals or {}
        for row in signals:
            for signal, value in sorted((live.get(row["id"]) or row["signals"] or {}).items()):
                labels = {
                    "run_id": row["id"],
                    "project": row["project"],
                    "run": row["name"],
                    "signal": signal,
                }
                samples.append((labels, value))
        _metric(
            out,
            "rlvitals_health_signal",
            "gauge",
            "Latest value of each canonical health signal per run.",
            samples,
        )
        _metric(
            out,
            "rlvitals_alert_firing",
            "gauge",
            "1 for every firing alert (run, rule, severity).",
            [
                (
                    {
                        "run_id": r["id"],
                        "project": r["project"],
                        "run": r["name"],
                        "rule": r["rule"],
                        "severity": r["severity"],
                    },
                    1,
                )
                for r in firing
            ],
        )
        return "\n".join(out) + "\n"


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: object) -> str:
    if isinstance(value, str):  # non-finite values are stored spelled out
        return {NAN: "NaN", POS_INF: "+Inf", NEG_INF: "-Inf"}.get(value, "NaN")
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(value)


def _metric(out: list[str], name: str, kind: str, help_text: str, samples) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{label_text}}} {_fmt(value)}" if label_text else f"{name} {_fmt(value)}")


def _histogram(out: list[str], name: str, help_text: str, hist: Histogram) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} histogram")
    for edge, count in zip(hist.buckets, hist.counts, strict=True):
        out.append(f'{name}_bucket{{le="{edge}"}} {count}')
    out.append(f'{name}_bucket{{le="+Inf"}} {hist.total}')
    out.append(f"{name}_sum {hist.sum!r}")
    out.append(f"{name}_count {hist.total}")
