"""The PostgreSQL per-step ingest path, counted on the wire: libpq's trace of the messages the driver
sends, where each ``Sync`` (end of an extended-protocol statement) and each simple ``Query`` is one
wait for the server. Before the combined statement a per-step request took 8: pre-ping, BEGIN, the
run's row, the points, the health state's version lock, its write, the NOTIFY, COMMIT; the health
rules now run after the write (service/evaluator.py), which leaves 4."""

from __future__ import annotations

import psycopg
import pytest
from rlvitals.service import metrics
from rlvitals.service.schemas import StepIn
from rlvitals.service.storage import repository as repo

HEALTHY = {  # the bench's workload: no rule fires, so no alert statements join the count
    "actor/pg_loss": 0.0,
    "actor/pg_clipfrac": 0.2,
    "actor/ppo_kl": 0.004,
    "actor/entropy": 1.5,
    "actor/grad_norm": 0.5,
    "actor/kl_loss": 0.01,
    "actor/pg_clipfrac_lower": 0.001,
    "actor/lr": 1e-6,
    "critic/score/mean": 0.3,
    "critic/rewards/mean": 0.3,
    "response_length/mean": 512.0,
    "timing_s/step": 30.0,
}
NAMES = list(HEALTHY)


def _step(step: int) -> list[StepIn]:
    wobble = 1.0 + 0.01 * ((step * 7) % 5 - 2)
    return [StepIn(step=step, metrics={k: v * wobble for k, v in HEALTHY.items()}, wall_time=30.0 * step)]


def _round_trips(trace: str) -> int:
    sent = [line.split("\t") for line in trace.splitlines() if "\tF\t" in line]
    return sum(1 for fields in sent if fields[3].split(" ")[0] in ("Sync", "Query"))


def test_a_per_step_request_is_four_round_trips_and_stores_everything(app_client, pg_url, tmp_path):
    api = app_client(pg_url)
    services = api.services
    run_id = api.create_run("round-trips")
    held = services.db.held_writer()
    try:
        for s in range(10):  # the monitor is built, the names known, psycopg prepares its statements
            assert metrics.ingest_many(services, [(run_id, _step(s))], write=held.write)[0]["accepted"] == 12
        trace = tmp_path / "libpq.trace"
        with trace.open("w") as out:
            pgconn = held._conn.connection.driver_connection.pgconn
            pgconn.trace(out.fileno())
            try:
                outcomes = [
                    metrics.ingest_many(services, [(run_id, _step(s))], write=held.write)
                    for s in range(10, 20)
                ]
            finally:
                pgconn.untrace()
    finally:
        held.close()
    assert all(o == [{"accepted": 12, "steps": 1}] for o in outcomes)
    # BEGIN, the combined run/points/feed statement, the NOTIFY, COMMIT
    assert _round_trips(trace.read_text()) == 4 * 10
    series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]
    assert sorted(series) == sorted(NAMES)
    assert {name: s["step"] for name, s in series.items()} == {name: list(range(20)) for name in NAMES}
    assert api.get(f"/api/v1/runs/{run_id}").json()["last_step"] == 19


def test_the_combined_statement_feeds_the_rules_without_their_lock_and_skips_an_unknown_run(
    app_client, pg_url
):
    api = app_client(pg_url)
    services = api.services
    run_id = api.create_run("locks")
    rows = [(run_id, "actor/ppo_kl", 5, 0.5, 0, 1.0)]
    with services.db.write() as session:
        fed = dict(first_step=5, last_step=5, names='["actor/ppo_kl"]', now=2.0, rows=rows)
        advanced = repo.advance_run_fed(session=session, run_id=run_id, **fed)
        assert advanced is not None and advanced[1] is not None
        with psycopg.connect(services.db.libpq_url(), autocommit=True) as other:
            # the health state stays free: the evaluator, not the write, takes it
            other.execute("SELECT version FROM health_states WHERE run_id = %s FOR UPDATE NOWAIT", (run_id,))
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("SELECT id FROM runs WHERE id = %s FOR UPDATE NOWAIT", (run_id,))
        assert repo.advance_run_fed(session=session, run_id=987_654, **fed) is None
    with services.db.read() as session:
        raw = session.connection.driver_connection
        assert raw.execute("SELECT run_id, name, step, value FROM points").fetchall() == [
            (run_id, "actor/ppo_kl", 5, 0.5)
        ]
