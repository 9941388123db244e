"""Group commit (``service.writer``) and the metrics write's answers over HTTP.

The writer is held inside its first group by a gate around the real ``ingest_many``, so the requests
queued meanwhile are known to form the next group: grouping is asserted, not hoped for.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest
from rlvitals.service import metrics
from rlvitals.service.schemas import StepIn
from rlvitals.service.storage import repository as repo


def _steps(step: int, **values) -> list[StepIn]:
    return [StepIn(step=step, metrics=values or {"actor/ppo_kl": 0.001, "actor/pg_clipfrac": 0.2})]


class Gate:
    """Wraps ``metrics.ingest_many``: the first call waits until ``open()``; records group sizes."""

    def __init__(self, monkeypatch):
        self.real = metrics.ingest_many
        self.entered = threading.Event()
        self._open = threading.Event()
        self.sizes: list[int] = []
        monkeypatch.setattr(metrics, "ingest_many", self)

    def __call__(self, ctx, items, **kwargs):
        self.sizes.append(len(items))
        if len(self.sizes) == 1:
            self.entered.set()
            assert self._open.wait(30), "the test never opened the gate"
        return self.real(ctx, items, **kwargs)

    def open(self) -> None:
        self._open.set()


async def _queued_behind_first(api, gate: Gate, first: tuple[int, list[StepIn]], rest):
    """Submit ``first`` (the writer takes it and waits at the gate), queue ``rest``, open the gate."""
    writer = api.services.writer
    head = asyncio.ensure_future(writer.submit(*first))
    while not gate.entered.is_set():
        await asyncio.sleep(0.005)
    tail = [asyncio.ensure_future(writer.submit(run_id, steps)) for run_id, steps in rest]
    await asyncio.sleep(0.05)  # every submit has queued its item
    gate.open()
    return await asyncio.gather(head, *tail, return_exceptions=True)


def test_concurrent_requests_share_one_commit_and_an_unknown_run_fails_alone(api, monkeypatch):
    runs = [api.create_run(f"trainer-{i}") for i in range(6)]
    gate = Gate(monkeypatch)
    rest = [(run_id, _steps(1)) for run_id in runs[1:]] + [(987_654, _steps(1))]
    rest.append((runs[2], _steps(2, **{"actor/ppo_kl": 0.002})))  # a second request of one run
    outcomes = api._call(_queued_behind_first(api, gate, (runs[0], _steps(1)), rest))

    assert gate.sizes == [1, len(rest)]  # everything queued behind the first went in one group
    assert outcomes[0] == {"accepted": 2, "steps": 1}
    assert all(o == {"accepted": 2, "steps": 1} for o in outcomes[1:6])
    assert type(outcomes[6]).__name__ == "NotFound" and "987654" in str(outcomes[6])
    assert outcomes[7] == {"accepted": 1, "steps": 1}
    for run_id in runs:
        series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]
        expected = [1, 2] if run_id == runs[2] else [1]
        assert series["actor/ppo_kl"]["step"] == expected
        assert api.get(f"/api/v1/runs/{run_id}").json()["last_step"] == expected[-1]


def test_a_failing_request_does_not_sink_its_group(api, monkeypatch):
    # One request's write fails inside the shared transaction: the group is rolled back and each
    # request is written alone, so only the failing one fails; its health monitor is rebuilt and the
    # run goes on normally afterwards.
    runs = [api.create_run(f"trainer-{i}") for i in range(4)]
    for run_id in runs:
        assert api.log(run_id, [{"step": 0, "metrics": {"actor/ppo_kl": 0.001}}]).status_code == 200
    broken = runs[2]
    real_add = repo.add_points

    def add_points(*, session, rows):
        if rows and rows[0][0] == broken:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return real_add(session=session, rows=rows)

    real_advance = repo.advance_run_fed

    def advance_run_fed(*, session, run_id, rows=None, **kwargs):  # PostgreSQL: points go in here
        if rows and run_id == broken:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return real_advance(session=session, run_id=run_id, rows=rows, **kwargs)

    monkeypatch.setattr(repo, "add_points", add_points)
    monkeypatch.setattr(repo, "advance_run_fed", advance_run_fed)
    gate = Gate(monkeypatch)
    rest = [(run_id, _steps(1)) for run_id in runs[1:]]
    outcomes = api._call(_queued_behind_first(api, gate, (runs[0], _steps(1)), rest))

    assert gate.sizes == [1, 3]
    assert [isinstance(o, dict) or type(o).__name__ for o in outcomes] == [
        True,
        True,
        "OperationalError",
        True,
    ]
    monkeypatch.setattr(repo, "add_points", real_add)
    monkeypatch.setattr(repo, "advance_run_fed", real_advance)
    for run_id in runs:
        series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]
        assert series["actor/ppo_kl"]["step"] == ([0] if run_id == broken else [0, 1])
    assert api.log(broken, [{"step": 1, "metrics": {"actor/ppo_kl": 0.001}}]).status_code == 200


def test_a_database_error_over_http_keeps_the_error_shape(api, monkeypatch):
    # FastAPI's handlers turn a database that is away into 503 + Retry-After in the one error shape.
    run_id = api.create_run()
    real_add = repo.add_points

    real_advance = repo.advance_run_fed

    def add_points(*, session, rows, **kwargs):  # also stands for advance_run_fed (PostgreSQL)
        raise sqlite3.OperationalError("database is locked (injected)")

    monkeypatch.setattr(repo, "add_points", add_points)
    monkeypatch.setattr(repo, "advance_run_fed", add_points)
    response = api.log(run_id, [{"step": 1, "metrics": {"a": 1.0}}])
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "unavailable" and response.headers["retry-after"] == "1"
    monkeypatch.setattr(repo, "add_points", real_add)
    monkeypatch.setattr(repo, "advance_run_fed", real_advance)
    assert api.log(run_id, [{"step": 1, "metrics": {"a": 1.0}}]).json() == {"accepted": 1, "steps": 1}


def test_stop_writes_everything_queued_and_a_later_submit_starts_again(api, monkeypatch):
    runs = [api.create_run(f"trainer-{i}") for i in range(3)]
    writer = api.services.writer
    gate = Gate(monkeypatch)

    async def scenario():
        head = asyncio.ensure_future(writer.submit(runs[0], _steps(1)))
        while not gate.entered.is_set():
            await asyncio.sleep(0.005)
        tail = [asyncio.ensure_future(writer.submit(r, _steps(1))) for r in runs[1:]]
        await asyncio.sleep(0.05)
        stopper = threading.Thread(target=writer.stop)
        stopper.start()  # stop() waits for the queue to drain
        await asyncio.sleep(0.05)
        assert stopper.is_alive()
        gate.open()
        results = await asyncio.gather(head, *tail)
        await asyncio.get_running_loop().run_in_executor(None, stopper.join, 10)
        assert not stopper.is_alive()
        assert writer._thread is None
        again = await writer.submit(runs[0], _steps(2))
        return results, again

    results, again = api._call(scenario())
    assert results == [{"accepted": 2, "steps": 1}] * 3
    assert again == {"accepted": 2, "steps": 1}


def test_a_client_that_hangs_up_still_gets_its_points_stored(api, monkeypatch):
    run_id = api.create_run()
    gate = Gate(monkeypatch)
    writer = api.services.writer

    async def scenario():
        task = asyncio.ensure_future(writer.submit(run_id, _steps(7)))
        while not gate.entered.is_set():
            await asyncio.sleep(0.005)
        task.cancel()  # the request's task is cancelled while its item is being written
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        for _ in range(200):  # the writer finishes the item, skipping the cancelled future
            if writer.requests:
                return
            await asyncio.sleep(0.01)

    api._call(scenario())
    series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]
    assert series["actor/ppo_kl"]["step"] == [7]


def test_the_metrics_route_answers_plain_streamed_refused_and_oversized_writes(app_client, sqlite_url):
    api = app_client(sqlite_url, max_request_bytes=2_000, max_steps_per_request=3)
    run_id = api.create_run()
    url = f"/api/v1/runs/{run_id}/metrics"
    body = b'{"steps": [{"step": 1, "metrics": {"a": 1.5}}]}'

    plain = api.post(url, content=body, headers={"content-type": "application/json"})
    assert plain.status_code == 200 and plain.json() == {"accepted": 1, "steps": 1}
    assert plain.headers["content-length"] == str(len(plain.content))

    async def chunked(parts):
        for part in parts:
            yield part

    parts = [body[:10], body[10:30], body[30:]]
    streamed = api.post(url, content=chunked(parts), headers={"content-type": "application/json"})
    assert streamed.status_code == 200  # a body in several messages

    missing = api.post(
        "/api/v1/runs/424242/metrics", content=body, headers={"content-type": "application/json"}
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    four = b'{"steps": [' + b",".join(b'{"step": %d, "metrics": {"a": 1.0}}' % s for s in range(5, 9)) + b"]}"
    too_many = api.post(url, content=four, headers={"content-type": "application/json"})
    assert too_many.status_code == 413  # the writer refuses
    assert too_many.json()["error"] == {
        "code": "payload_too_large",
        "message": "4 steps in one request; the limit is 3",
        "detail": {"limit": 3},
    }
    charset = api.post(url, content=four, headers={"content-type": "application/json; charset=utf-8"})
    assert charset.json() == too_many.json()

    big = b'{"steps": [{"step": 2, "metrics": {"a": 1.0}}], "pad": "' + b"x" * 3_000 + b'"}'
    declared = api.post(url, content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "payload_too_large"
    undeclared = api.post(
        url, content=chunked([big[:1_500], big[1_500:]]), headers={"content-type": "application/json"}
    )
    assert undeclared.status_code == 413 and undeclared.json()["error"]["code"] == "payload_too_large"

    series = api.get(url, params={"max_points": 0}).json()["series"]
    assert series["a"] == {"step": [1], "value": [1.5]}


def test_sqlite_writes_reuse_the_connection_that_wrote_last(tmp_path):
    # SQLite drops a connection's page cache when another connection wrote since; the write pool
    # must hand out the connection used last (LIFO), or each insert re-reads its B-tree pages. A
    # second connection exists once two writes overlapped (here: a write inside a write).
    from rlvitals.service.storage.database import Database

    db = Database(f"sqlite:///{tmp_path / 'lifo.db'}")
    try:
        db.migrate()
        with db.engine.connect() as outer:
            first = outer.connection.driver_connection
            with db.engine.connect() as inner:
                second = inner.connection.driver_connection
        assert first is not second
        seen = []
        for _ in range(4):
            with db.write() as session:
                seen.append(session.connection.driver_connection)
        assert all(conn is seen[0] for conn in seen), "writes moved between pooled connections"
    finally:
        db.dispose()


def test_held_writer_keeps_its_connection_commits_and_starts_afresh_after_a_failure(api):
    db = api.services.db
    run_id = api.create_run("held")
    held = db.held_writer()
    try:
        with held.write() as first:
            first.exec_driver_sql(f"UPDATE runs SET last_step = 7 WHERE id = {run_id}")
        with held.write() as second:
            pass
        assert second is first  # no checkout (nor pre-ping) per transaction
        with db.read() as reader:  # committed: another connection sees it
            assert reader.exec_driver_sql(f"SELECT last_step FROM runs WHERE id = {run_id}").scalar() == 7
        with pytest.raises(Exception, match="no_such_table"), held.write() as failing:
            failing.exec_driver_sql(f"UPDATE runs SET last_step = 8 WHERE id = {run_id}")
            failing.exec_driver_sql("SELECT * FROM no_such_table")
        with held.write() as after:
            assert after is not first  # the failed one was dropped
            assert after.exec_driver_sql(f"SELECT last_step FROM runs WHERE id = {run_id}").scalar() == 7
    finally:
        held.close()
