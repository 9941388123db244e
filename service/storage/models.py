"""The tables. Alembic migrations in ``service/migrations`` create them; this module is their
single description (and the ``target_metadata`` the migrations are checked against).

Times are unix seconds (float). JSON columns hold values already passed through
``encoding.jsonable`` (non-finite floats as strings) so PostgreSQL's JSON accepts them.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY; BigInteger elsewhere.
Id = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("project", "name"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    project: Mapped[str] = mapped_column(String(200))
    name: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    last_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Bumped by every ingest: history answers are cached (and ETagged) per data_version.
    data_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)


class Point(Base):
    """One metric value: (run, name, step) is the key, so a resend is ignored, never duplicated.

    ``value`` is NULL for a null value and for NaN (SQLite cannot store NaN); ``flag`` = 1 marks NaN.
    """

    __tablename__ = "points"
    __table_args__ = ({"sqlite_with_rowid": False},)

    run_id: Mapped[int] = mapped_column(Id, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(250), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[float | None] = mapped_column(Double, nullable=True)
    flag: Mapped[int] = mapped_column(SmallInteger, default=0, server_default=text("0"))
    wall_time: Mapped[float | None] = mapped_column(Double, nullable=True)


class HealthState(Base):
    """The run's HealthMonitor.state_dict() plus the latest canonical signal values."""

    __tablename__ = "health_states"

    run_id: Mapped[int] = mapped_column(Id, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, default=0)
    # Python-json text (NaN/Infinity tokens allowed) so detector state round-trips exactly.
    state: Mapped[str] = mapped_column(Text, default="{}")
    signals: Mapped[dict] = mapped_column(JSON, default=dict)
    updated_at: Mapped[float] = mapped_column(Double)


class HealthFeed(Base):
    """One metrics write not yet seen by the health rules: its run, step range and metric names
    (a JSON list). Written in the write's transaction, deleted in the evaluation's (service/evaluator.py)."""

    __tablename__ = "health_feed"
    __table_args__ = (Index("ix_health_feed_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(Id, ForeignKey("runs.id", ondelete="CASCADE"))
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    names: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Double)


class Alert(Base):
    """One episode of one rule on one run: firing -> resolved. At most one firing per (run, rule)."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index(
            "uq_alerts_open",
            "run_id",
            "rule",
            unique=True,
            sqlite_where=text("state = 'firing'"),
            postgresql_where=text("state = 'firing'"),
        ),
        Index("ix_alerts_state", "state"),
        Index("ix_alerts_run_id", "run_id"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(Id, ForeignKey("runs.id", ondelete="CASCADE"))
    rule: Mapped[str] = mapped_column(String(100))
    severity: Mapped[str] = mapped_column(String(20))
    state: Mapped[str] = mapped_column(String(20))
    signal: Mapped[str | None] = mapped_column(String(100), nullable=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[object] = mapped_column(JSON, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    advice: Mapped[str] = mapped_column(Text, default="")
    evidence: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)
    resolved_at: Mapped[float | None] = mapped_column(Double, nullable=True)


class Incident(Base):
    """Findings of one cause and time window as one problem (rlvitals.analyzers.health.incidents): its
    cause, severity, primary rule, members and findings, and the highest severity notified so far."""

    __tablename__ = "incidents"
    __table_args__ = (
        UniqueConstraint("run_id", "number"),
        Index("ix_incidents_state", "state"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(Id, ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)  # the run's own count: 1, 2, ...
    cause: Mapped[str] = mapped_column(String(100))
    title: Mapped[str] = mapped_column(String(200))
    severity: Mapped[str] = mapped_column(String(20))
    state: Mapped[str] = mapped_column(String(20))  # open | resolved
    primary_rule: Mapped[str] = mapped_column(String(100))
    onset_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    advice: Mapped[str] = mapped_column(Text, default="")
    members: Mapped[dict] = mapped_column(JSON, default=dict)
    findings: Mapped[list] = mapped_column(JSON, default=list)
    dropped_findings: Mapped[int] = mapped_column(Integer, default=0)
    reopened: Mapped[int] = mapped_column(Integer, default=0)
    confirmed: Mapped[bool] = mapped_column(Boolean, default=False)
    notified_severity: Mapped[str | None] = mapped_column(String(20), nullable=True)
    onset_time: Mapped[float | None] = mapped_column(Double, nullable=True)  # wall time of onset_step
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)
    resolved_at: Mapped[float | None] = mapped_column(Double, nullable=True)


class Audit(Base):
    """An uploaded batch and, once a worker ran it, its audit. Also the job queue (status).

    ``record_id`` is the client's id of the upload: a resend of the same (run, record_id) finds the
    existing row instead of adding one (NULLs are distinct, so uploads without one are always new).
    """

    __tablename__ = "audits"
    __table_args__ = (
        Index("ix_audits_status_id", "status", "id"),
        Index("ix_audits_run_id_step", "run_id", "step"),
        Index("uq_audits_run_id_record_id", "run_id", "record_id", unique=True),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(Id, ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    micro_batch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(20))  # pending | running | done | error
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    reported: Mapped[dict] = mapped_column(JSON, default=dict)
    # Before migration 0004 the tensors were kept here; now always NULL (see AuditBlob).
    blob: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0)
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    claimed_by: Mapped[str | None] = mapped_column(String(100), nullable=True)
    claimed_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    created_at: Mapped[float] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    record_id: Mapped[str | None] = mapped_column(String(128), nullable=True)


class AuditBlob(Base):
    """An audit's uploaded safetensors bytes, until its audit is finished (``keep_batches``: kept).

    A table of its own, the blob its last column, so that SQLite never rewrites it: updating any
    column of a row rebuilds the whole record in memory (the audit's status changes would each cost
    two copies of the batch), and a ``zeroblob`` placeholder filled by incremental blob I/O stays
    free only as the record's last field (see storage/blobs.py)."""

    __tablename__ = "audit_blobs"

    id: Mapped[int] = mapped_column(
        Id, ForeignKey("audits.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    blob: Mapped[bytes] = mapped_column(LargeBinary)


class WebhookDelivery(Base):
    """One alert or incident transition to send to one URL (a transactional outbox row)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    alert_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("alerts.id", ondelete="SET NULL"), nullable=True
    )
    incident_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("incidents.id", ondelete="SET NULL"), nullable=True
    )
    url: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(20))  # generic | slack
    payload: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(20))  # pending | sending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Double)
    claimed_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Double)
    delivered_at: Mapped[float | None] = mapped_column(Double, nullable=True)


class WebhookAttempt(Base):
    __tablename__ = "webhook_attempts"
    __table_args__ = (Index("ix_webhook_attempts_delivery_id", "delivery_id"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(Id, ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Double)
    ok: Mapped[bool] = mapped_column(Boolean)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    duration: Mapped[float] = mapped_column(Double)


class ApiKey(Base):
    """An API key, stored as its SHA-256 (keys are 256-bit random, so no slow hash is needed)."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(20))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    last_used_at: Mapped[float | None] = mapped_column(Double, nullable=True)


class EventPayload(Base):
    """PostgreSQL NOTIFY payloads over its 8000-byte limit travel by reference through this table."""

    __tablename__ = "event_payloads"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    payload: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Double)


metadata = Base.metadata
