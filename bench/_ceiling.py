"""The ceiling and the breakdown beside the servers' ingest rates (bench/ingest.py).

``sqlite_ceiling``: SQLite itself, with nothing around it: the same rows (run, name, step, value,
flag, wall time) into a table of the same schema (``WITHOUT ROWID``, primary key (run, name, step),
WAL, ``synchronous=NORMAL``, as the server opens it), one ``executemany`` and one commit per request,
in this process. No server can store a request faster than that.

``breakdown``: where one request's time goes inside rlvitals, timed in this process on its own
SQLite file with the server's code: the JSON parse and validation (the route's, on the event loop),
the whole ``metrics.ingest_many`` (what the writer thread does: one transaction) and inside it the
insert (the ceiling above); the rest of ``ingest_many`` is the run's row, the health feed's row and
the commit. The health rules (a ``HealthMonitor`` fed the same steps alone, a request's steps in
one ``observe_many`` as the evaluator feeds them) run after the answer, in
the evaluator thread. HTTP (uvicorn's parsing, FastAPI's routing, the hand-off to the writer thread
and back) is the server's CPU per request minus all of these.
"""

from __future__ import annotations

import sqlite3
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

Step = tuple[int, dict[str, float], float]

_SCHEMA = (
    "CREATE TABLE points (run_id INTEGER NOT NULL, name VARCHAR(250) NOT NULL, step BIGINT NOT NULL, "
    "value FLOAT, flag SMALLINT DEFAULT 0, wall_time FLOAT, PRIMARY KEY (run_id, name, step)) WITHOUT ROWID"
)
_INSERT = (
    "INSERT INTO points (run_id, name, step, value, flag, wall_time) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, name, step) DO NOTHING"
)


def _requests(steps: Sequence[Step], batch: int) -> list[Sequence[Step]]:
    return [steps[i : i + batch] for i in range(0, len(steps), batch)]


def sqlite_ceiling(steps: Sequence[Step], batch: int) -> dict[str, float]:
    """Median seconds (wall and CPU) per request and points/s of SQLite's own executemany + commit."""
    with tempfile.TemporaryDirectory(prefix="rlvitals-ceiling-") as tmp:
        con = sqlite3.connect(Path(tmp) / "ceiling.db", isolation_level=None)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute(_SCHEMA)
            times, cpu = [], []
            points = 0
            for request in _requests(steps, batch):
                rows = [
                    (1, name, s, value, 0, wall)
                    for s, metrics, wall in request
                    for name, value in metrics.items()
                ]
                points = len(rows)
                t0, c0 = time.perf_counter(), time.thread_time()
                con.execute("BEGIN IMMEDIATE")
                con.executemany(_INSERT, rows)
                con.execute("COMMIT")
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
        finally:
            con.close()
    median = statistics.median(times)
    return {
        "seconds_per_request": median,
        "cpu_seconds_per_request": statistics.median(cpu),
        "points_per_s": points / median,
        "points_per_request": points,
    }


def breakdown(steps: Sequence[Step], batch: int, run_config: dict | None = None) -> dict[str, float]:
    """Median CPU milliseconds per request of each part (see the module docstring): this thread's
    CPU time, like the servers' CPU column, so other load on the machine does not inflate it."""
    import orjson
    from rlvitals.analyzers import HealthMonitor
    from rlvitals.service import metrics
    from rlvitals.service import runs as runs_mod
    from rlvitals.service.app import build_services
    from rlvitals.service.schemas import MetricsIn, RunCreate
    from rlvitals.service.settings import Settings

    config = run_config or {"algorithm": "grpo"}
    requests = _requests(steps, batch)
    bodies = [
        orjson.dumps({"steps": [{"step": s, "metrics": m, "wall_time": w} for s, m, w in request]})
        for request in requests
    ]
    parse, ingest = [], []
    with tempfile.TemporaryDirectory(prefix="rlvitals-breakdown-") as tmp:
        services = build_services(Settings(database_url=f"sqlite:///{tmp}/b.db", data_dir=tmp))
        try:
            services.db.migrate()
            run, _ = runs_mod.create_or_resume(
                services, RunCreate(name="breakdown", project="bench", config=config)
            )
            held = services.db.held_writer()
            try:
                for body in bodies:
                    t0 = time.thread_time()
                    parsed = MetricsIn.model_validate(orjson.loads(body))
                    t1 = time.thread_time()
                    outcome = metrics.ingest_many(services, [(run["id"], parsed.steps)], write=held.write)[0]
                    t2 = time.thread_time()
                    if not isinstance(outcome, dict):
                        raise RuntimeError(f"breakdown ingest failed: {outcome!r}")
                    parse.append(t1 - t0)
                    ingest.append(t2 - t1)
            finally:
                held.close()
        finally:
            services.db.dispose()
    monitor = HealthMonitor(run_config=config)
    rules = []
    for request in requests:
        t0 = time.thread_time()
        monitor.observe_many([(s, m) for s, m, _ in request])  # as the server's evaluator feeds them
        rules.append(time.thread_time() - t0)
    insert = sqlite_ceiling(steps, batch)["cpu_seconds_per_request"]
    ms = {
        "parse_validate": statistics.median(parse) * 1e3,
        "ingest_many": statistics.median(ingest) * 1e3,
        "health_rules": statistics.median(rules) * 1e3,
        "sqlite_insert_commit": insert * 1e3,
    }
    # the rules run after the answer (service/evaluator.py), so ingest_many no longer holds them
    ms["rest_of_ingest"] = max(0.0, ms["ingest_many"] - ms["sqlite_insert_commit"])
    return ms
