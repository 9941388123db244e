"""Every query the server runs, as keyword-only functions over the transaction's ``session`` (a
SQLAlchemy Core ``Connection`` from ``Database.write()`` / ``Database.read()``).

Routes and workers never build SQL themselves. Functions return plain dicts (or tuples for bulk
data) so callers do not hold ORM objects across transactions. Bulk paths (points) use Core
``executemany`` with dialect-specific ``ON CONFLICT DO NOTHING``: no ORM object per point.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any

from rlvitals.analyzers.contract.batch_rules import spell
from rlvitals.service.storage import blobs
from rlvitals.service.storage.models import (
    Alert,
    ApiKey,
    Audit,
    AuditBlob,
    EventPayload,
    HealthFeed,
    HealthState,
    Incident,
    Point,
    Run,
    WebhookAttempt,
    WebhookDelivery,
)
from sqlalchemy import and_, delete, func, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection as Session

RUNS, POINTS, ALERTS, AUDITS = Run.__table__, Point.__table__, Alert.__table__, Audit.__table__
AUDIT_BLOBS = AuditBlob.__table__  # an audit's tensors (storage/blobs.py)
HEALTH, DELIVERIES, ATTEMPTS, KEYS = (
    HealthState.__table__,
    WebhookDelivery.__table__,
    WebhookAttempt.__table__,
    ApiKey.__table__,
)
EVENTS = EventPayload.__table__
FEED = HealthFeed.__table__
INCIDENTS = Incident.__table__

# Audit columns a reader needs (never the blob).
_AUDIT_COLUMNS = [c for c in AUDITS.c if c.name != "blob"]


def _dialect_insert(session: Session, table):
    name = session.dialect.name
    return (postgresql.insert if name == "postgresql" else sqlite.insert)(table)


def _row(row) -> dict[str, Any] | None:
    return dict(row._mapping) if row is not None else None


# --- runs -------------------------------------------------------------------------------------


def find_run(*, session: Session, project: str, name: str) -> dict | None:
    return _row(session.execute(select(RUNS).where(RUNS.c.project == project, RUNS.c.name == name)).first())


def insert_run(
    *, session: Session, project: str, name: str, config: dict, tags: list, now: float
) -> int | None:
    """Insert a run; ``None`` when (project, name) already exists (a concurrent create won)."""
    stmt = (
        _dialect_insert(session, RUNS)
        .values(project=project, name=name, config=config, tags=tags, created_at=now, updated_at=now)
        .on_conflict_do_nothing(index_elements=["project", "name"])
        .returning(RUNS.c.id)
    )
    return session.execute(stmt).scalar()


def update_run(
    *, session: Session, run_id: int, now: float, config: dict | None = None, tags: list | None = None
):
    values: dict[str, Any] = {"updated_at": now}
    if config is not None:
        values["config"] = config
    if tags is not None:
        values["tags"] = tags
    session.execute(update(RUNS).where(RUNS.c.id == run_id).values(**values))


def get_run(*, session: Session, run_id: int) -> dict | None:
    return _row(session.execute(select(RUNS).where(RUNS.c.id == run_id)).first())


def data_version(*, session: Session, run_id: int) -> int | None:
    """The run's data version (``None``: no such run). Read it *before* the data it stands for."""
    raw, style = _driver(session)
    cur = raw.cursor()
    try:
        cur.execute(f"SELECT data_version FROM runs WHERE id = {style}", (run_id,))
        row = cur.fetchone()
        return None if row is None else row[0]
    finally:
        cur.close()


def run_exists(*, session: Session, run_id: int) -> bool:
    raw, style = _driver(session)
    cur = raw.cursor()
    try:
        cur.execute(f"SELECT 1 FROM runs WHERE id = {style}", (run_id,))
        return cur.fetchone() is not None
    finally:
        cur.close()


def list_runs(
    *, session: Session, project: str | None = None, limit: int = 100, offset: int = 0, config: bool = True
) -> tuple[list[dict], int]:
    """A page of runs, most recently updated first; without their ``config`` column unless asked."""
    where = [RUNS.c.project == project] if project is not None else []
    columns = list(RUNS.c) if config else [c for c in RUNS.c if c.name != "config"]
    rows = session.execute(
        select(*columns)
        .where(*where)
        .order_by(RUNS.c.updated_at.desc(), RUNS.c.id.desc())
        .limit(limit)
        .offset(offset)
    ).all()
    count = session.execute(select(func.count()).select_from(RUNS).where(*where)).scalar_one()
    return [dict(r._mapping) for r in rows], count


def advance_run(*, session: Session, run_id: int, last_step: int | None, now: float) -> bool:
    """Record ingest (``last_step`` only ever grows); ``False`` when the run does not exist.

    Hot path: one statement on the driver connection, inside the session's transaction.
    """
    raw, style = _driver(session)
    sql = (
        f"UPDATE runs SET last_step = CASE WHEN last_step IS NULL OR last_step < {style} THEN {style} "
        f"ELSE last_step END, updated_at = {style}, data_version = data_version + 1 WHERE id = {style}"
    )
    cur = raw.cursor()
    try:
        cur.execute(sql, (last_step, last_step, now, run_id))
        return cur.rowcount == 1
    finally:
        cur.close()


# PostgreSQL, several possible writers: the run's row update, its points and the health feed's row in
# one statement (one round trip instead of three). The inserts read ``r``, so they run only for an
# existing run.
_ADVANCE_PG = (
    "WITH r AS (UPDATE runs SET last_step = CASE WHEN last_step IS NULL OR last_step < %(step)s "
    "THEN %(step)s ELSE last_step END, updated_at = %(now)s, data_version = data_version + 1 "
    "WHERE id = %(run)s RETURNING id, data_version){points}, "
    "f AS (INSERT INTO health_feed (run_id, first_step, last_step, names, created_at) "
    "SELECT r.id, %(first)s, %(step)s, %(names)s, %(now)s FROM r RETURNING id) "
    "SELECT r.data_version, f.id FROM r, f"
)
_ADVANCE_POINTS_PG = (
    ", p AS (INSERT INTO points (run_id, name, step, value, flag, wall_time) "
    "SELECT u.* FROM unnest(%(c0)s::bigint[], %(c1)s::varchar[], %(c2)s::bigint[], %(c3)s::float8[], "
    "%(c4)s::smallint[], %(c5)s::float8[]) AS u WHERE EXISTS (SELECT 1 FROM r) "
    "ON CONFLICT (run_id, name, step) DO NOTHING)"
)


def advance_run_fed(
    *,
    session: Session,
    run_id: int,
    first_step: int,
    last_step: int,
    names: str,
    now: float,
    rows: Sequence[tuple] | None = None,
) -> tuple[int, int] | None:
    """PostgreSQL: ``advance_run``, ``add_feed`` and, when ``rows`` is given, ``add_points`` in one
    statement. ``None`` when the run does not exist (nothing written); else ``(data_version, feed id)``."""
    raw = session.connection.driver_connection
    params: dict[str, Any] = {
        "step": last_step,
        "first": first_step,
        "names": names,
        "now": now,
        "run": run_id,
    }
    points = ""
    if rows:
        points = _ADVANCE_POINTS_PG
        params.update({f"c{i}": list(column) for i, column in enumerate(zip(*rows, strict=True))})
    cur = raw.cursor()
    try:
        cur.execute(_ADVANCE_PG.format(points=points), params)
        row = cur.fetchone()
        return None if row is None else (row[0], row[1])
    finally:
        cur.close()


def _driver(session: Session):
    """The DB-API connection under the session's transaction and its parameter style."""
    return session.connection.driver_connection, ("?" if session.dialect.name == "sqlite" else "%s")


# --- points -----------------------------------------------------------------------------------


_INSERT_POINTS = (
    "INSERT INTO points (run_id, name, step, value, flag, wall_time) VALUES ({p}, {p}, {p}, {p}, {p}, {p}) "
    "ON CONFLICT (run_id, name, step) DO NOTHING"
)


# PostgreSQL: one statement over six arrays instead of one bound statement per row (psycopg's
# executemany spends ~15 us of client CPU per row; this, ~5). unnest keeps the arrays' order, so
# within one request the first of two values for a (name, step) wins, as with executemany.
_INSERT_POINTS_PG = (
    "INSERT INTO points (run_id, name, step, value, flag, wall_time) "
    "SELECT * FROM unnest(%s::bigint[], %s::varchar[], %s::bigint[], %s::float8[], %s::smallint[], "
    "%s::float8[]) ON CONFLICT (run_id, name, step) DO NOTHING"
)


def add_points(*, session: Session, rows: Sequence[tuple]) -> None:
    """Insert-or-ignore on (run_id, name, step): a resend is ignored, never duplicated.

    ``rows``: ``(run_id, name, step, value, flag, wall_time)`` tuples. One statement on the driver
    connection inside the session's transaction: no ORM object, no SQL compilation per point
    (SQLite: ``executemany``; PostgreSQL: one ``INSERT … SELECT FROM unnest`` of column arrays).
    """
    if not rows:
        return
    raw, style = _driver(session)
    cur = raw.cursor()
    try:
        if style == "?":
            cur.executemany(_INSERT_POINTS.format(p=style), rows)
        else:
            cur.execute(_INSERT_POINTS_PG, [list(column) for column in zip(*rows, strict=True)])
    finally:
        cur.close()


def metric_names(*, session: Session, run_id: int) -> list[str]:
    return list(
        session.execute(
            select(POINTS.c.name).where(POINTS.c.run_id == run_id).distinct().order_by(POINTS.c.name)
        )
        .scalars()
        .all()
    )


def series(*, session: Session, run_id: int, name: str) -> list[tuple[int, float | None, int]]:
    """All points of one metric in step order: ``[(step, value, flag), ...]`` (driver tuples: the
    history query moves tens of thousands of rows, so no Row objects)."""
    raw, style = _driver(session)
    cur = raw.cursor()
    try:
        cur.execute(
            f"SELECT step, value, flag FROM points WHERE run_id = {style} AND name = {style} ORDER BY step",
            (run_id, name),
        )
        return cur.fetchall()
    finally:
        cur.close()


_MAX_DOUBLE = "1.7976931348623157e308"
# SQLite: the API spelling is made in SQL, so the rows come out ready to encode ("NaN" for a flagged
# NULL, "Infinity"/"-Infinity" past the largest double) and no Python runs per point.
_SQLITE_COLUMNS = (
    "SELECT step, CASE WHEN value IS NULL THEN (CASE WHEN flag = 1 THEN 'NaN' END) "
    f"WHEN value > {_MAX_DOUBLE} THEN 'Infinity' WHEN value < -{_MAX_DOUBLE} THEN '-Infinity' "
    "ELSE value END FROM points WHERE run_id = ? AND name = ? ORDER BY step"
)
_SPELL = {1: "NaN", 0: None}


def series_columns(
    *, session: Session, run_id: int, names: Sequence[str], walls: dict[str, tuple[list, list]] | None = None
) -> dict[str, tuple[list, list]]:
    """Every point of each of ``names`` in step order as two columns, ``{name: (steps, values)}``,
    values spelled as the API answers them: floats, ``None`` (null), ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``. Names without points map to empty columns.

    The history read of tens of thousands of rows per metric: driver tuples only, the cyclic garbage
    collector paused while they are built (they hold no cycles; pausing saves ~15% of the read).
    Given a ``walls`` dict, the same read fills it with ``{name: (steps, wall_times)}`` too.
    """
    raw, style = _driver(session)
    sqlite_sql = _SQLITE_COLUMNS if walls is None else _SQLITE_COLUMNS.replace(" FROM", ", wall_time FROM", 1)
    pg_sql = "SELECT step, value, flag" + ("" if walls is None else ", wall_time")
    pg_sql += " FROM points WHERE run_id = %s AND name = %s ORDER BY step"
    out: dict[str, tuple[list, list]] = {}
    cur = raw.cursor()
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        for name in names:
            if style == "?":
                cur.execute(sqlite_sql, (run_id, name))
                rows = cur.fetchall()
                out[name] = (list(map(itemgetter(0), rows)), list(map(itemgetter(1), rows)))
                if walls is not None:
                    walls[name] = (out[name][0], list(map(itemgetter(2), rows)))
                continue
            cur.execute(pg_sql, (run_id, name))
            rows = cur.fetchall()
            steps = list(map(itemgetter(0), rows))
            if walls is not None:
                walls[name] = (steps, list(map(itemgetter(3), rows)))
            values = list(map(itemgetter(1), rows))
            if None in values or math.inf in values or -math.inf in values or any(v != v for v in values):
                values = [
                    _SPELL.get(flag) if value is None else (value if math.isfinite(value) else _spell(value))
                    for _, value, flag, *_ in rows
                ]
            out[name] = (steps, values)
    finally:
        cur.close()
        if paused:
            gc.enable()
    return out


def series_wall_times(
    *, session: Session, run_id: int, names: Sequence[str], start: int | None = None, end: int | None = None
) -> dict[str, tuple[list, list]]:
    """The wall time of every point of each of ``names`` within ``[start, end]`` (inclusive), in step
    order: ``{name: (steps, wall_times)}`` (``None`` where the trainer sent none). Driver tuples only,
    as ``series_columns``: a 100k-point series moves no Row objects."""
    raw, style = _driver(session)
    sql = f"SELECT step, wall_time FROM points WHERE run_id = {style} AND name = {style}"
    if start is not None:
        sql += f" AND step >= {style}"
    if end is not None:
        sql += f" AND step <= {style}"
    sql += " ORDER BY step"
    bounds = [b for b in (start, end) if b is not None]
    out: dict[str, tuple[list, list]] = {}
    cur = raw.cursor()
    try:
        for name in names:
            cur.execute(sql, (run_id, name, *bounds))
            rows = cur.fetchall()
            out[name] = (list(map(itemgetter(0), rows)), list(map(itemgetter(1), rows)))
    finally:
        cur.close()
    return out


_spell = spell  # the contract's one spelling table (finite values never reach it)


# --- health state -----------------------------------------------------------------------------


def load_health_state(*, session: Session, run_id: int, lock: bool = False) -> dict | None:
    stmt = select(HEALTH).where(HEALTH.c.run_id == run_id)
    if lock and session.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    return _row(session.execute(stmt).first())


def health_version(*, session: Session, run_id: int, lock: bool = False) -> int | None:
    """The state's version (row-locked on PostgreSQL so replicas update one run in turn)."""
    stmt = select(HEALTH.c.version).where(HEALTH.c.run_id == run_id)
    if lock and session.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    return session.execute(stmt).scalar()


def ensure_health_row(*, session: Session, run_id: int, now: float) -> None:
    session.execute(
        _dialect_insert(session, HEALTH)
        .values(run_id=run_id, version=0, state="{}", signals={}, updated_at=now)
        .on_conflict_do_nothing(index_elements=["run_id"])
    )


def save_health_state(
    *, session: Session, run_id: int, version: int, state: dict | None, signals: dict | None, now: float
) -> None:
    values: dict[str, Any] = {"version": version, "updated_at": now}
    if state is not None:
        values["state"] = state
    if signals is not None:
        values["signals"] = signals
    session.execute(update(HEALTH).where(HEALTH.c.run_id == run_id).values(**values))


def health_signals(*, session: Session) -> list[dict]:
    """Latest canonical signals for every run (for /metrics)."""
    rows = session.execute(
        select(RUNS.c.id, RUNS.c.project, RUNS.c.name, HEALTH.c.signals).join(
            HEALTH, HEALTH.c.run_id == RUNS.c.id
        )
    ).all()
    return [dict(r._mapping) for r in rows]


# --- health feed (writes the evaluator has not seen yet) ----------------------------------------


def add_feed(
    *, session: Session, run_id: int, first_step: int, last_step: int, names: str, now: float
) -> int:
    """One write's entry in the health feed (``names``: a JSON list); its id."""
    raw, style = _driver(session)
    cur = raw.cursor()
    try:
        cur.execute(
            "INSERT INTO health_feed (run_id, first_step, last_step, names, created_at) "
            f"VALUES ({style}, {style}, {style}, {style}, {style}) RETURNING id",
            (run_id, first_step, last_step, names, now),
        )
        return cur.fetchone()[0]
    finally:
        cur.close()


def feed_runs(*, session: Session, limit: int = 1000) -> list[int]:
    """Runs with writes not yet evaluated, the one waiting longest first."""
    rows = session.execute(
        select(FEED.c.run_id, func.min(FEED.c.id).label("first"))
        .group_by(FEED.c.run_id)
        .order_by(text("first"))
        .limit(limit)
    ).all()
    return [r[0] for r in rows]


def feed_of(*, session: Session, run_id: int, limit: int) -> list[tuple[int, int, int, str]]:
    """The run's oldest ``limit`` feed rows: ``(id, first_step, last_step, names JSON)``."""
    raw, style = _driver(session)
    cur = raw.cursor()
    try:
        cur.execute(
            f"SELECT id, first_step, last_step, names FROM health_feed WHERE run_id = {style} "
            f"ORDER BY id LIMIT {int(limit)}",
            (run_id,),
        )
        return cur.fetchall()
    finally:
        cur.close()


def drop_feed(*, session: Session, ids: Sequence[int]) -> None:
    if ids:
        session.execute(delete(FEED).where(FEED.c.id.in_(list(ids))))


def feed_newest(*, session: Session, run_id: int | None = None) -> int | None:
    """The newest feed row's id (of one run, or of all), ``None`` when nothing waits."""
    stmt = select(func.max(FEED.c.id))
    if run_id is not None:
        stmt = stmt.where(FEED.c.run_id == run_id)
    return session.execute(stmt).scalar()


def feed_waiting(*, session: Session, through: int, run_id: int | None = None) -> bool:
    """Whether a feed row with id ``<= through`` (of one run, or of any) is still there."""
    stmt = select(FEED.c.id).where(FEED.c.id <= through)
    if run_id is not None:
        stmt = stmt.where(FEED.c.run_id == run_id)
    return session.execute(stmt.limit(1)).first() is not None


def claim_health(*, session: Session, run_id: int) -> tuple[bool, int | None]:
    """Take the run's health state for this transaction: ``(True, version)``; ``(False, None)`` when
    another transaction holds it (PostgreSQL: ``FOR UPDATE SKIP LOCKED``; on SQLite the write
    transaction is the claim); ``(True, None)`` when the run has no health state row."""
    stmt = select(HEALTH.c.version).where(HEALTH.c.run_id == run_id)
    if session.dialect.name != "postgresql":
        return True, session.execute(stmt).scalar()
    row = session.execute(stmt.with_for_update(skip_locked=True)).first()
    if row is not None:
        return True, row[0]
    held = session.execute(select(HEALTH.c.run_id).where(HEALTH.c.run_id == run_id)).first()
    return (False, None) if held is not None else (True, None)


def points_between(
    *, session: Session, run_id: int, names: Sequence[str], first: int, last: int
) -> list[tuple[str, int, float | None, int, float | None]]:
    """The stored points of ``names`` at steps ``first..last``: ``(name, step, value, flag,
    wall_time)`` in no particular order (the primary key's (run, name, step) ranges)."""
    raw, style = _driver(session)
    out: list[tuple] = []
    cur = raw.cursor()
    try:
        if style == "%s":
            cur.execute(
                "SELECT name, step, value, flag, wall_time FROM points WHERE run_id = %s "
                "AND name = ANY(%s) AND step >= %s AND step <= %s",
                (run_id, list(names), first, last),
            )
            return cur.fetchall()
        names = list(names)
        for at in range(0, len(names), 500):
            part = names[at : at + 500]
            cur.execute(
                "SELECT name, step, value, flag, wall_time FROM points WHERE run_id = ? "
                f"AND name IN ({','.join('?' * len(part))}) AND step >= ? AND step <= ?",
                (run_id, *part, first, last),
            )
            out.extend(cur.fetchall())
    finally:
        cur.close()
    return out


# --- alerts -----------------------------------------------------------------------------------


def open_alert_id(*, session: Session, run_id: int, rule: str) -> int | None:
    return session.execute(
        select(ALERTS.c.id).where(
            ALERTS.c.run_id == run_id, ALERTS.c.rule == rule, ALERTS.c.state == "firing"
        )
    ).scalar()


def insert_alert(*, session: Session, values: dict[str, Any]) -> int:
    return session.execute(ALERTS.insert().values(**values).returning(ALERTS.c.id)).scalar_one()


def update_alert(*, session: Session, alert_id: int, values: dict[str, Any]) -> None:
    session.execute(update(ALERTS).where(ALERTS.c.id == alert_id).values(**values))


def get_alert(*, session: Session, alert_id: int) -> dict | None:
    return _row(session.execute(select(ALERTS).where(ALERTS.c.id == alert_id)).first())


def list_alerts(
    *,
    session: Session,
    run_id: int | None = None,
    run_ids: Iterable[int] | None = None,
    state: str | None = None,
    limit: int | None = 1000,
    offset: int = 0,
) -> tuple[list[dict], int]:
    where = []
    if run_id is not None:
        where.append(ALERTS.c.run_id == run_id)
    if run_ids is not None:
        where.append(ALERTS.c.run_id.in_(list(run_ids)))
    if state is not None:
        where.append(ALERTS.c.state == state)
    stmt = select(ALERTS).where(*where).order_by(ALERTS.c.id.desc()).offset(offset)
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = session.execute(stmt).all()
    count = session.execute(select(func.count()).select_from(ALERTS).where(*where)).scalar_one()
    return [dict(r._mapping) for r in rows], count


def firing_counts(*, session: Session) -> list[dict]:
    """(run, rule, severity) of every firing alert, for /metrics."""
    rows = session.execute(
        select(RUNS.c.id, RUNS.c.project, RUNS.c.name, ALERTS.c.rule, ALERTS.c.severity)
        .join(ALERTS, ALERTS.c.run_id == RUNS.c.id)
        .where(ALERTS.c.state == "firing")
    ).all()
    return [dict(r._mapping) for r in rows]


# --- audits (also the job queue) --------------------------------------------------------------


def insert_audit(*, session: Session, values: dict[str, Any]) -> int:
    """Insert an audit row; its ``blob`` (bytes or a ``SpooledBody``) goes to ``audit_blobs`` in
    chunks (storage/blobs.py). A row inserted with status ``receiving`` gets only the blob's room on
    SQLite: ``blobs.fill_blob`` writes it, then ``received_audit`` queues it."""
    blob = values.get("blob")
    values = {**values, "blob": None}
    audit_id = session.execute(AUDITS.insert().values(**values).returning(AUDITS.c.id)).scalar_one()
    if blob is not None:
        blobs.write_blob(session, AUDIT_BLOBS, audit_id, blob, fill=values.get("status") != "receiving")
    return audit_id


def received_audit(*, session: Session, audit_id: int) -> None:
    """A ``receiving`` audit's blob is written whole: it joins the queue."""
    session.execute(
        update(AUDITS)
        .where(AUDITS.c.id == audit_id)
        .values(status="pending", claimed_by=None, claimed_at=None)
    )


def receiving_audits(*, session: Session) -> list[tuple[int, str | None, float]]:
    """(id, claimed_by, created_at) of the audits whose blob is still being written."""
    rows = session.execute(
        select(AUDITS.c.id, AUDITS.c.claimed_by, AUDITS.c.created_at).where(AUDITS.c.status == "receiving")
    ).all()
    return [(int(r[0]), r[1], float(r[2])) for r in rows]


def delete_audits(*, session: Session, ids: list[int]) -> int:
    """Remove audits (and their blobs) that never joined the queue (their upload did not finish)."""
    if not ids:
        return 0
    session.execute(delete(AUDIT_BLOBS).where(AUDIT_BLOBS.c.id.in_(ids)))
    return session.execute(delete(AUDITS).where(AUDITS.c.id.in_(ids))).rowcount


def lock_audit_queue(*, session: Session) -> None:
    """PostgreSQL: replicas check the queue bound one at a time (transaction-scoped advisory lock)."""
    if session.dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": 0x726C7671})


def count_waiting_audits(*, session: Session) -> int:
    return session.execute(
        select(func.count())
        .select_from(AUDITS)
        .where(AUDITS.c.status.in_(("receiving", "pending", "running")))
    ).scalar_one()


def waiting_audits_by_run(*, session: Session) -> dict[int, int]:
    """``{run id: its audits waiting}`` (receiving, pending or running) for the runs that have any."""
    rows = session.execute(
        select(AUDITS.c.run_id, func.count())
        .where(AUDITS.c.status.in_(("receiving", "pending", "running")))
        .group_by(AUDITS.c.run_id)
    ).all()
    return {int(run_id): int(count) for run_id, count in rows}


def claim_audit(
    *, session: Session, worker: str, now: float, stale_before: float, with_blob: bool = True
) -> dict | None:
    """Claim one waiting job (pending, or running under a claimer that died) exactly once, blob
    included, fairly across runs: round robin over the runs with waiting jobs, the run served least
    recently first (its newest claim is the oldest; never served: first), its oldest job first. The
    order lives in the database, so it holds across replicas.

    PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED`` so replicas never take the same job (a job
    another replica is taking is skipped for the next run's).
    SQLite: the caller's ``BEGIN IMMEDIATE`` already serialises writers.
    """
    waiting = or_(
        AUDITS.c.status == "pending", and_(AUDITS.c.status == "running", AUDITS.c.claimed_at < stale_before)
    )
    firsts = session.execute(
        select(AUDITS.c.run_id, func.min(AUDITS.c.id)).where(waiting).group_by(AUDITS.c.run_id)
    ).all()
    if not firsts:
        return None
    runs = [r[0] for r in firsts]
    served = dict(
        session.execute(
            select(AUDITS.c.run_id, func.max(AUDITS.c.claimed_at))
            .where(AUDITS.c.run_id.in_(runs), AUDITS.c.claimed_at.is_not(None))
            .group_by(AUDITS.c.run_id)
        ).all()
    )
    order = sorted(firsts, key=lambda r: (served.get(r[0]) or float("-inf"), r[1]))
    job_id = None
    for _run_id, first in order:
        if session.dialect.name != "postgresql":
            job_id = first
            break
        stmt = (
            select(AUDITS.c.id)
            .where(AUDITS.c.run_id == _run_id, waiting)
            .order_by(AUDITS.c.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        job_id = session.execute(stmt).scalar()
        if job_id is not None:
            break
    if job_id is None:
        return None
    session.execute(
        update(AUDITS)
        .where(AUDITS.c.id == job_id)
        .values(status="running", claimed_by=worker, claimed_at=now)
    )
    job = _row(session.execute(select(*_AUDIT_COLUMNS).where(AUDITS.c.id == job_id)).first())
    if with_blob:
        job["blob"] = blobs.read_blob(
            session, AUDIT_BLOBS, job_id
        )  # a bytearray: its tensors are views of it
    return job


def oldest_pending_audits(*, session: Session) -> list[dict]:
    """Per run with pending jobs: its id, project, name and its oldest pending job's ``created_at``."""
    rows = session.execute(
        select(RUNS.c.id, RUNS.c.project, RUNS.c.name, func.min(AUDITS.c.created_at))
        .join(AUDITS, AUDITS.c.run_id == RUNS.c.id)
        .where(AUDITS.c.status == "pending")
        .group_by(RUNS.c.id, RUNS.c.project, RUNS.c.name)
    ).all()
    return [{"id": r[0], "project": r[1], "name": r[2], "created_at": r[3]} for r in rows]


def running_claims(*, session: Session, prefix: str) -> list[tuple[int, str]]:
    """(id, claimed_by) of the running jobs whose claimer name starts with ``prefix``."""
    rows = session.execute(
        select(AUDITS.c.id, AUDITS.c.claimed_by).where(
            AUDITS.c.status == "running", AUDITS.c.claimed_by.startswith(prefix, autoescape=True)
        )
    ).all()
    return [(int(r[0]), r[1]) for r in rows]


def release_audits(*, session: Session, ids: list[int]) -> int:
    """Hand running jobs back to the queue (their claimer is gone)."""
    if not ids:
        return 0
    return session.execute(
        update(AUDITS)
        .where(AUDITS.c.id.in_(ids), AUDITS.c.status == "running")
        .values(status="pending", claimed_by=None, claimed_at=None)
    ).rowcount


def finish_audit(
    *,
    session: Session,
    audit_id: int,
    worker: str,
    status: str,
    result: dict | None,
    error: str | None,
    now: float,
    keep_blob: bool,
) -> bool:
    """Store a result; ``False`` when the job was re-claimed by someone else meanwhile."""
    values: dict[str, Any] = {"status": status, "result": result, "error": error, "finished_at": now}
    res = session.execute(
        update(AUDITS)
        .where(AUDITS.c.id == audit_id, AUDITS.c.claimed_by == worker, AUDITS.c.status == "running")
        .values(**values)
    )
    if res.rowcount != 1:
        return False
    if not keep_blob:
        session.execute(delete(AUDIT_BLOBS).where(AUDIT_BLOBS.c.id == audit_id))
    return True


def finish_histograms(*, session: Session, audit_id: int, result: dict | None, drop_blob: bool) -> None:
    """Store the result with its histograms (``None``: leave it) and drop the tensors if asked."""
    if result is not None:
        session.execute(update(AUDITS).where(AUDITS.c.id == audit_id).values(result=result))
    if drop_blob:
        session.execute(delete(AUDIT_BLOBS).where(AUDIT_BLOBS.c.id == audit_id))


def get_audit(*, session: Session, audit_id: int) -> dict | None:
    return _row(session.execute(select(*_AUDIT_COLUMNS).where(AUDITS.c.id == audit_id)).first())


def list_audits(
    *, session: Session, run_id: int, step: int | None = None, limit: int = 1000, offset: int = 0
) -> tuple[list[dict], int]:
    where = [AUDITS.c.run_id == run_id]
    if step is not None:
        where.append(AUDITS.c.step == step)
    rows = session.execute(
        select(*_AUDIT_COLUMNS).where(*where).order_by(AUDITS.c.step, AUDITS.c.id).limit(limit).offset(offset)
    ).all()
    count = session.execute(select(func.count()).select_from(AUDITS).where(*where)).scalar_one()
    return [dict(r._mapping) for r in rows], count


def audit_status_counts(*, session: Session) -> dict[str, int]:
    rows = session.execute(select(AUDITS.c.status, func.count()).group_by(AUDITS.c.status)).all()
    return {status: n for status, n in rows}


# --- webhooks ---------------------------------------------------------------------------------


def add_deliveries(*, session: Session, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        session.execute(DELIVERIES.insert(), list(rows))


def claim_delivery(
    *, session: Session, now: float, stale_before: float, url: str | None = None
) -> dict | None:
    """The next due delivery (to ``url`` only, when given), marked ``sending``."""
    due = or_(
        and_(DELIVERIES.c.status == "pending", DELIVERIES.c.next_attempt_at <= now),
        and_(DELIVERIES.c.status == "sending", DELIVERIES.c.claimed_at < stale_before),
    )
    if url is not None:
        due = and_(DELIVERIES.c.url == url, due)
    stmt = select(DELIVERIES).where(due).order_by(DELIVERIES.c.next_attempt_at, DELIVERIES.c.id).limit(1)
    if session.dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    row = _row(session.execute(stmt).first())
    if row is None:
        return None
    session.execute(
        update(DELIVERIES).where(DELIVERIES.c.id == row["id"]).values(status="sending", claimed_at=now)
    )
    return row


def next_delivery_due(*, session: Session, url: str | None = None) -> float | None:
    where = [DELIVERIES.c.status == "pending"] + ([DELIVERIES.c.url == url] if url is not None else [])
    return session.execute(select(func.min(DELIVERIES.c.next_attempt_at)).where(*where)).scalar()


def pending_delivery_urls(*, session: Session) -> list[str]:
    """URLs with deliveries still to send (some may no longer be configured)."""
    stmt = select(DELIVERIES.c.url).where(DELIVERIES.c.status.in_(("pending", "sending"))).distinct()
    return list(session.execute(stmt).scalars())


def rule_notifications(*, session: Session, run_id: int, rule: str, since: float) -> tuple[int, float | None]:
    """(alert transitions of ``rule`` on the run queued for delivery since ``since``, the newest
    queue time of any of its transitions): one transition is one (alert, created_at) pair, however
    many URLs it went to."""
    joined = DELIVERIES.join(ALERTS, ALERTS.c.id == DELIVERIES.c.alert_id)
    mine = and_(ALERTS.c.run_id == run_id, ALERTS.c.rule == rule)
    recent = (
        select(DELIVERIES.c.alert_id, DELIVERIES.c.created_at)
        .select_from(joined)
        .where(mine, DELIVERIES.c.created_at > since)
        .distinct()
        .subquery()
    )
    count = session.execute(select(func.count()).select_from(recent)).scalar() or 0
    newest = session.execute(
        select(func.max(DELIVERIES.c.created_at)).select_from(joined).where(mine)
    ).scalar()
    return int(count), newest


def rule_transitions(*, session: Session, run_id: int, rule: str, after: float) -> int:
    """Alert transitions (firings and resolutions) of ``rule`` on the run strictly after ``after``."""
    mine = and_(ALERTS.c.run_id == run_id, ALERTS.c.rule == rule)
    fired = session.execute(select(func.count()).where(mine, ALERTS.c.created_at > after)).scalar() or 0
    resolved = session.execute(select(func.count()).where(mine, ALERTS.c.resolved_at > after)).scalar() or 0
    return int(fired) + int(resolved)


def lock_webhook_url(*, session: Session, url: str) -> None:
    """PostgreSQL: replicas claim one URL's deliveries one at a time (so its budget is exact)."""
    if session.dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:url))"), {"url": "rlvitals-hook:" + url})


def url_posts_since(*, session: Session, url: str, since: float) -> tuple[int, float | None]:
    """(POSTs to ``url`` started after ``since``, counting those in flight; the oldest one's time)."""
    joined = ATTEMPTS.join(DELIVERIES, DELIVERIES.c.id == ATTEMPTS.c.delivery_id)
    done, oldest = session.execute(
        select(func.count(), func.min(ATTEMPTS.c.at))
        .select_from(joined)
        .where(DELIVERIES.c.url == url, ATTEMPTS.c.at > since)
    ).one()
    sending, oldest_sending = session.execute(
        select(func.count(), func.min(DELIVERIES.c.claimed_at)).where(
            DELIVERIES.c.url == url, DELIVERIES.c.status == "sending", DELIVERIES.c.claimed_at > since
        )
    ).one()
    times = [t for t in (oldest, oldest_sending) if t is not None]
    return int(done or 0) + int(sending or 0), (min(times) if times else None)


def fold_due_deliveries(*, session: Session, url: str, kind: str, now: float) -> list[dict]:
    """Every first attempt due for ``url`` of ``kind``, marked ``digested`` (sent in one digest)."""
    due = and_(
        DELIVERIES.c.url == url,
        DELIVERIES.c.kind == kind,
        DELIVERIES.c.status == "pending",
        DELIVERIES.c.attempts == 0,
        DELIVERIES.c.next_attempt_at <= now,
    )
    stmt = select(DELIVERIES).where(due).order_by(DELIVERIES.c.id)
    if session.dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    rows = [dict(r._mapping) for r in session.execute(stmt).all()]
    if rows:
        session.execute(
            update(DELIVERIES)
            .where(DELIVERIES.c.id.in_([r["id"] for r in rows]))
            .values(status="digested", claimed_at=now)
        )
    return rows


def set_deliveries(*, session: Session, ids: list[int], values: dict[str, Any]) -> None:
    if ids:
        session.execute(update(DELIVERIES).where(DELIVERIES.c.id.in_(ids)).values(**values))


def insert_delivery(*, session: Session, values: dict[str, Any]) -> int:
    return session.execute(DELIVERIES.insert().values(**values).returning(DELIVERIES.c.id)).scalar_one()


def latest_alert(*, session: Session, run_id: int, rule: str) -> dict | None:
    """The newest alert of ``rule`` on the run (its current episode or the last one closed)."""
    stmt = select(ALERTS).where(ALERTS.c.run_id == run_id, ALERTS.c.rule == rule).order_by(ALERTS.c.id.desc())
    return _row(session.execute(stmt.limit(1)).first())


def deferred_delivery_pending(*, session: Session, run_id: int, rule: str) -> bool:
    """Whether a catch-up notification (queued for later: due after it was created) of ``rule`` on
    the run still waits to be sent."""
    joined = DELIVERIES.join(ALERTS, ALERTS.c.id == DELIVERIES.c.alert_id)
    stmt = (
        select(DELIVERIES.c.id)
        .select_from(joined)
        .where(
            ALERTS.c.run_id == run_id,
            ALERTS.c.rule == rule,
            DELIVERIES.c.status == "pending",
            DELIVERIES.c.attempts == 0,
            DELIVERIES.c.next_attempt_at > DELIVERIES.c.created_at,
        )
        .limit(1)
    )
    return session.execute(stmt).first() is not None


def oldest_rule_notification(*, session: Session, run_id: int, rule: str, since: float) -> float | None:
    joined = DELIVERIES.join(ALERTS, ALERTS.c.id == DELIVERIES.c.alert_id)
    return session.execute(
        select(func.min(DELIVERIES.c.created_at))
        .select_from(joined)
        .where(ALERTS.c.run_id == run_id, ALERTS.c.rule == rule, DELIVERIES.c.created_at > since)
    ).scalar()


def newest_rule_notification_before(
    *, session: Session, run_id: int, rule: str, before: float
) -> float | None:
    """When the newest notification of ``rule`` on the run queued before ``before`` was sent (or
    queued, while unsent): it said the state of that moment."""
    joined = DELIVERIES.join(ALERTS, ALERTS.c.id == DELIVERIES.c.alert_id)
    return session.execute(
        select(func.max(func.coalesce(DELIVERIES.c.delivered_at, DELIVERIES.c.created_at)))
        .select_from(joined)
        .where(ALERTS.c.run_id == run_id, ALERTS.c.rule == rule, DELIVERIES.c.created_at < before)
    ).scalar()


def record_attempt(
    *, session: Session, delivery_id: int, attempt: dict[str, Any], delivery: dict[str, Any]
) -> None:
    session.execute(ATTEMPTS.insert().values(delivery_id=delivery_id, **attempt))
    session.execute(update(DELIVERIES).where(DELIVERIES.c.id == delivery_id).values(**delivery))


def list_deliveries(*, session: Session, alert_id: int | None = None) -> list[dict]:
    where = [DELIVERIES.c.alert_id == alert_id] if alert_id is not None else []
    rows = session.execute(select(DELIVERIES).where(*where).order_by(DELIVERIES.c.id)).all()
    return [dict(r._mapping) for r in rows]


def list_attempts(*, session: Session, delivery_id: int) -> list[dict]:
    rows = session.execute(
        select(ATTEMPTS).where(ATTEMPTS.c.delivery_id == delivery_id).order_by(ATTEMPTS.c.attempt)
    ).all()
    return [dict(r._mapping) for r in rows]


# --- API keys ---------------------------------------------------------------------------------


def insert_key(*, session: Session, name: str, prefix: str, key_hash: str, now: float) -> int:
    return session.execute(
        KEYS.insert().values(name=name, prefix=prefix, key_hash=key_hash, created_at=now).returning(KEYS.c.id)
    ).scalar_one()


def list_keys(*, session: Session) -> list[dict]:
    rows = session.execute(select(*[c for c in KEYS.c if c.name != "key_hash"]).order_by(KEYS.c.id)).all()
    return [dict(r._mapping) for r in rows]


def revoke_key(*, session: Session, key_id: int | None = None, prefix: str | None = None, now: float) -> int:
    cond = KEYS.c.id == key_id if key_id is not None else KEYS.c.prefix == prefix
    return session.execute(
        update(KEYS).where(cond, KEYS.c.revoked_at.is_(None)).values(revoked_at=now)
    ).rowcount


def any_active_key(*, session: Session) -> bool:
    return session.execute(select(KEYS.c.id).where(KEYS.c.revoked_at.is_(None)).limit(1)).first() is not None


def any_key(*, session: Session) -> bool:
    """Whether a key was ever created (revoked ones count: revoking the last key must not reopen writes)."""
    return session.execute(select(KEYS.c.id).limit(1)).first() is not None


def delete_revoked_keys(*, session: Session) -> int:
    return session.execute(delete(KEYS).where(KEYS.c.revoked_at.is_not(None))).rowcount


def active_key_id(*, session: Session, key_hash: str) -> int | None:
    return session.execute(
        select(KEYS.c.id).where(KEYS.c.key_hash == key_hash, KEYS.c.revoked_at.is_(None))
    ).scalar()


# --- events (PostgreSQL NOTIFY) ---------------------------------------------------------------


def notify(*, session: Session, channel: str, payload: str) -> None:
    """``pg_notify`` inside the caller's transaction: delivered to listeners only on commit."""
    session.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": channel, "payload": payload})


def store_event_payload(*, session: Session, payload: str, now: float) -> int:
    return session.execute(
        EVENTS.insert().values(payload=payload, created_at=now).returning(EVENTS.c.id)
    ).scalar_one()


def load_event_payload(*, session: Session, payload_id: int) -> str | None:
    return session.execute(select(EVENTS.c.payload).where(EVENTS.c.id == payload_id)).scalar()


def prune_event_payloads(*, session: Session, before: float) -> None:
    session.execute(delete(EVENTS).where(EVENTS.c.created_at < before))


def touch_firing_alerts(*, session: Session, run_id: int, step: int, now: float) -> None:
    """Keep ``last_step`` of the run's open alerts at the newest step seen (hot path: raw SQL)."""
    raw, p = _driver(session)
    cur = raw.cursor()
    try:
        cur.execute(
            f"UPDATE alerts SET last_step = {p}, updated_at = {p} "
            f"WHERE run_id = {p} AND state = 'firing' AND last_step < {p}",
            (step, now, run_id, step),
        )
    finally:
        cur.close()


def last_event_payload_id(*, session: Session) -> int:
    return session.execute(select(func.coalesce(func.max(EVENTS.c.id), 0))).scalar_one()


def event_payloads_after(*, session: Session, after_id: int, limit: int = 1000) -> list[tuple[int, str]]:
    rows = session.execute(
        select(EVENTS.c.id, EVENTS.c.payload).where(EVENTS.c.id > after_id).order_by(EVENTS.c.id).limit(limit)
    ).all()
    return [(r[0], r[1]) for r in rows]


def get_audit_blob(*, session: Session, audit_id: int) -> bytes | None:
    """The uploaded safetensors bytes of an audit (``None`` once dropped; see ``keep_batches``)."""
    return blobs.read_blob(session, AUDIT_BLOBS, audit_id)


# --- idempotent batch uploads -----------------------------------------------------------------


def audit_id_for_record(*, session: Session, run_id: int, record_id: str) -> int | None:
    """The audit already stored for the client's upload ``record_id`` on this run, if any."""
    return session.execute(
        select(AUDITS.c.id).where(AUDITS.c.run_id == run_id, AUDITS.c.record_id == record_id)
    ).scalar()


def insert_audit_once(*, session: Session, values: dict[str, Any]) -> tuple[int, bool]:
    """Insert an audit unless (run_id, record_id) exists -> (its id, whether this call inserted it).

    ``INSERT ... ON CONFLICT DO NOTHING`` then a select: of two concurrent identical uploads one
    inserts, the other waits for it (PostgreSQL's unique index; SQLite's single writer) and finds its
    row, so both answer the same id. A NULL ``record_id`` never conflicts: always a new row.
    """
    blob = values.get("blob")
    values = {**values, "blob": None}
    audit_id = session.execute(
        _dialect_insert(session, AUDITS).values(**values).on_conflict_do_nothing().returning(AUDITS.c.id)
    ).scalar()
    if audit_id is not None:
        if blob is not None:
            blobs.write_blob(session, AUDIT_BLOBS, audit_id, blob, fill=values.get("status") != "receiving")
        return audit_id, True
    existing = audit_id_for_record(session=session, run_id=values["run_id"], record_id=values["record_id"])
    if existing is None:  # a conflict on anything but (run_id, record_id): not an idempotent resend
        raise RuntimeError(f"audit insert for record {values['record_id']!r} conflicted but no row matches")
    return existing, False


# --- incidents --------------------------------------------------------------------------------


def get_incident_by_number(*, session: Session, run_id: int, number: int) -> dict | None:
    query = select(INCIDENTS).where(INCIDENTS.c.run_id == run_id, INCIDENTS.c.number == number)
    return _row(session.execute(query).first())


def get_incident(*, session: Session, incident_id: int) -> dict | None:
    return _row(session.execute(select(INCIDENTS).where(INCIDENTS.c.id == incident_id)).first())


def insert_incident(*, session: Session, values: dict[str, Any]) -> int:
    return session.execute(INCIDENTS.insert().values(**values).returning(INCIDENTS.c.id)).scalar_one()


def update_incident(*, session: Session, incident_id: int, values: dict[str, Any]) -> None:
    session.execute(update(INCIDENTS).where(INCIDENTS.c.id == incident_id).values(**values))


def list_incidents(
    *,
    session: Session,
    run_id: int | None = None,
    state: str | None = None,
    limit: int = 1000,
    offset: int = 0,
) -> tuple[list[dict], int]:
    where = []
    if run_id is not None:
        where.append(INCIDENTS.c.run_id == run_id)
    if state is not None:
        where.append(INCIDENTS.c.state == state)
    count = session.execute(select(func.count()).select_from(INCIDENTS).where(*where)).scalar() or 0
    rows = session.execute(
        select(INCIDENTS).where(*where).order_by(INCIDENTS.c.id.desc()).limit(limit).offset(offset)
    ).all()
    return [dict(r._mapping) for r in rows], int(count)


def open_incidents(*, session: Session, run_id: int, severity: str | None = None) -> list[dict]:
    """The run's open incidents (of ``severity`` only, when given), oldest first."""
    where = [INCIDENTS.c.run_id == run_id, INCIDENTS.c.state == "open"]
    if severity is not None:
        where.append(INCIDENTS.c.severity == severity)
    rows = session.execute(select(INCIDENTS).where(*where).order_by(INCIDENTS.c.id)).all()
    return [dict(r._mapping) for r in rows]


def incident_alerts(
    *, session: Session, run_id: int, rules: Iterable[str], start: int, end: int | None
) -> list[dict]:
    """The alerts behind an incident: its members' rules, episodes that began in ``[start, end]``."""
    where = [ALERTS.c.run_id == run_id, ALERTS.c.rule.in_(list(rules)), ALERTS.c.first_step >= start]
    if end is not None:
        where.append(ALERTS.c.first_step <= end)
    rows = session.execute(select(ALERTS).where(*where).order_by(ALERTS.c.first_step, ALERTS.c.id)).all()
    return [dict(r._mapping) for r in rows]


def wall_time_at(*, session: Session, run_id: int, step: int) -> float | None:
    """The earliest wall time the trainer sent at or after ``step`` (None: it sent none)."""
    return session.execute(
        select(func.min(POINTS.c.wall_time)).where(POINTS.c.run_id == run_id, POINTS.c.step >= step)
    ).scalar()


def last_wall_time(*, session: Session, run_id: int) -> float | None:
    """The newest wall time the trainer sent for the run."""
    return session.execute(select(func.max(POINTS.c.wall_time)).where(POINTS.c.run_id == run_id)).scalar()
