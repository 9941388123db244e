"""The health rules run after the write has answered (service/evaluator.py): never on the request
path, on what was committed, exactly once per point across a crash before the commit, kill -9 and a
restart, and across two replicas on one PostgreSQL. Each run's alerts and incidents are compared
with a reference server that evaluated the same writes undisturbed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from rlvitals.analyzers import HealthMonitor
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database

HEALTHY = {
    "actor/pg_loss": 0.1,
    "actor/pg_clipfrac": 0.2,
    "actor/ppo_kl": 0.004,
    "actor/entropy": 1.5,
    "actor/grad_norm": 0.5,
    "critic/score/mean": 0.3,
    "response_length/mean": 512.0,
}


def _step(s: int) -> dict:
    """A healthy run with a NaN burst every 60 steps (non_finite fires, resolves, fires again: alert
    episodes and incidents) and a grad-norm spike every 45."""
    wobble = 1.0 + 0.01 * ((s * 7) % 5 - 2)
    metrics: dict = {k: v * wobble for k, v in HEALTHY.items()}
    if s % 60 in (30, 31, 32):
        metrics["actor/pg_loss"] = "NaN"
    if s % 45 == 40:
        metrics["actor/grad_norm"] = 500.0
    return {"step": s, "metrics": metrics, "wall_time": 1_000.0 + 10.0 * s}


def _writes(steps: int, per_request: int) -> list[list[dict]]:
    return [
        [_step(s) for s in range(lo, min(lo + per_request, steps))] for lo in range(0, steps, per_request)
    ]


def _outcome(get) -> dict:
    """The run's alert episodes and incidents, without times (``get(path) -> JSON``)."""
    alerts = get("alerts?limit=10000")["data"]
    incidents = get("incidents?limit=10000")["data"]
    return {
        "alerts": sorted((a["rule"], a["state"], a["first_step"], a["last_step"]) for a in alerts),
        "incidents": sorted(
            (i["number"], i["cause"], i["severity"], i["state"], i["onset_step"], i["primary_rule"])
            for i in incidents
        ),
    }


def _reference(app_client, tmp_path, writes: list[list[dict]]) -> dict:
    api = app_client(f"sqlite:///{tmp_path / 'reference.db'}")
    run_id = api.create_run("reference")
    for steps in writes:
        assert api.log(run_id, steps).status_code == 200
    expected = _outcome(lambda path: api.get(f"/api/v1/runs/{run_id}/{path}").json())
    assert expected["alerts"] and expected["incidents"]  # the workload does raise both
    return expected


def _over_http(url: str, run_id: int):
    return lambda path: httpx.get(f"{url}/api/v1/runs/{run_id}/{path}", timeout=60).json()


def test_no_rule_runs_inside_a_write_and_the_alerts_still_come(app_client, database_url, monkeypatch):
    threads: list[str] = []
    real_observe_many = HealthMonitor.observe_many

    def observe_many(self, steps):
        steps = list(steps)
        threads.extend(threading.current_thread().name for _ in steps)
        return real_observe_many(self, steps)

    monkeypatch.setattr(HealthMonitor, "observe_many", observe_many)
    api = app_client(database_url)
    run_id = api.create_run("off-the-path")
    for steps in _writes(120, 10):
        answer = api.log(run_id, steps)
        assert answer.status_code == 200 and "critical_incidents" not in answer.json()
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts").json()["data"]  # waits for the rules to catch up
    assert {a["rule"] for a in alerts} >= {"non_finite"}
    assert len(threads) == 120  # every step seen once, all of them by the evaluator's thread
    assert {name.rsplit("-", 1)[0] for name in threads} == {"rlvitals-health"}


def test_a_write_that_asks_waits_for_its_rules_and_says_how_far_they_got(app_client, database_url):
    api = app_client(database_url)
    run_id = api.create_run("waits")
    answer = api.log(run_id, [_step(s) for s in range(30, 33)], params={"wait": "rules"}).json()
    assert answer["evaluated"] is True
    assert [i["cause"] for i in answer["critical_incidents"]] == ["non_finite"]
    with api.services.db.read() as session:
        assert repo.feed_newest(session=session, run_id=run_id) is None  # nothing left to evaluate
    refused = api.log(run_id, [_step(40)], params={"wait": "everything"})
    assert refused.status_code == 422


def test_an_evaluation_that_dies_before_its_commit_is_done_again_exactly_once(
    app_client, database_url, tmp_path, monkeypatch
):
    writes = _writes(300, 50)
    expected = _reference(app_client, tmp_path, writes)
    real_drop = repo.drop_feed
    died = []

    def drop_feed(*, session, ids):  # everything is written, the commit has not happened
        if not died:
            died.append(list(ids))
            raise RuntimeError("the evaluator died here (injected)")
        return real_drop(session=session, ids=ids)

    monkeypatch.setattr(repo, "drop_feed", drop_feed)
    api = app_client(database_url)
    run_id = api.create_run("dies")
    for steps in writes:
        assert api.log(run_id, steps).status_code == 200
    api.restart()  # and a restart on top: the persisted cursor and the feed carry everything
    assert died
    assert _outcome(lambda path: api.get(f"/api/v1/runs/{run_id}/{path}").json()) == expected


@pytest.mark.heavy
def test_kill_9_mid_evaluation_neither_loses_nor_duplicates_alerts(serve, app_client, database_url, tmp_path):
    writes = _writes(2400, 400)
    expected = _reference(app_client, tmp_path, writes)
    server = serve(database_url=database_url, env={"RLVITALS_HEALTH_WAIT": "60"})
    run_id = httpx.post(f"{server.url}/api/v1/runs", json={"name": "killed"}).json()["id"]
    with httpx.Client(timeout=60) as http:
        for steps in writes:
            assert (
                http.post(f"{server.url}/api/v1/runs/{run_id}/metrics", json={"steps": steps}).status_code
                == 200
            )
    server.kill()  # the writes answered; their rules were still running
    db = Database(database_url)
    with db.read() as session:
        left = repo.feed_of(session=session, run_id=run_id, limit=100)
    db.dispose()
    assert left  # killed mid-evaluation: writes the rules had not finished
    server.start()
    assert _outcome(_over_http(server.url, run_id)) == expected


@pytest.mark.heavy
@pytest.mark.parametrize("replicas", [2])
def test_two_replicas_evaluate_each_point_once(serve, app_client, pg_url, tmp_path, replicas):
    writes = _writes(1200, 20)
    expected = _reference(app_client, tmp_path, writes)
    servers = [serve(database_url=pg_url, env={"RLVITALS_HEALTH_WAIT": "60"}) for _ in range(replicas)]
    run_ids = [
        httpx.post(f"{servers[0].url}/api/v1/runs", json={"name": f"r{i}"}).json()["id"] for i in range(3)
    ]

    def trainer(run_id: int, offset: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i, steps in enumerate(writes):  # every write to the other replica than the one before
                url = servers[(i + offset) % replicas].url
                assert (
                    http.post(f"{url}/api/v1/runs/{run_id}/metrics", json={"steps": steps}).status_code == 200
                )

    started = time.monotonic()
    threads = [threading.Thread(target=trainer, args=(run_id, i)) for i, run_id in enumerate(run_ids)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert time.monotonic() - started < 120
    for run_id in run_ids:
        for server in servers:
            assert _outcome(_over_http(server.url, run_id)) == expected
    api = app_client(pg_url)
    with api.services.db.read() as session:
        for run_id in run_ids:
            assert repo.feed_newest(session=session, run_id=run_id) is None


def test_rules_run_ahead_of_the_write_transaction_and_a_stale_run_ahead_is_redone(
    app_client, database_url, tmp_path
):
    """The rules run on this process's own writes before the evaluation's transaction (no database
    lock held meanwhile); when the run was evaluated by someone else in between (its stored health
    version moved), what ran ahead is dropped and the rows are evaluated from the stored state:
    the alerts and incidents are the reference's, each point counted once."""
    writes = _writes(300, 50)
    expected = _reference(app_client, tmp_path, writes)
    api = app_client(database_url)
    ev = api.services.evaluator
    run_id = api.create_run("ahead")
    assert api.log(run_id, writes[0]).status_code == 200
    api.get(f"/api/v1/runs/{run_id}/alerts")  # waits: evaluated, the live monitor is cached
    ev.stop()  # from here the test evaluates, step by step, in its own thread
    assert api.log(run_id, writes[1]).status_code == 200
    stale = ev._ahead(run_id)  # the rules ran on writes[1] ...
    assert stale is not None and stale.feed
    assert ev._commit(run_id, None) == "done"  # ... but "another evaluator" stored them first
    for steps in writes[2:4]:
        assert api.log(run_id, steps).status_code == 200
    before = ev.ahead
    assert ev._commit(run_id, stale) == "done"  # stale: dropped, writes[2:4] evaluated from the state
    assert ev.ahead == before
    for steps in writes[4:]:
        assert api.log(run_id, steps).status_code == 200
        assert ev.evaluate(run_id) == "done"  # the live monitor is back: these ran ahead
    assert ev.ahead >= before + len(writes[4:])
    with api.services.db.read() as session:
        assert repo.feed_newest(session=session, run_id=run_id) is None
    assert _outcome(lambda path: api.get(f"/api/v1/runs/{run_id}/{path}").json()) == expected
