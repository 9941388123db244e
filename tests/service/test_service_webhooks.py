"""Webhooks: generic JSON and Slack-compatible deliveries reach a real local HTTP listener, in the
background, retried with backoff while the listener is down; every attempt is recorded."""

from __future__ import annotations

import time

from rlvitals.service.storage import repository as repo
from rlvitals.service.webhooks import backoff_delay

from tests.support.servers import free_port


def _nan(run_id, api, step):
    return api.log(run_id, [{"step": step, "metrics": {"actor/pg_loss": "NaN"}}])


def test_generic_and_slack_payloads_for_firing_and_resolved(app_client, database_url, hooks):
    hook = hooks()
    api = app_client(
        database_url, webhook_urls=[hook.url("/generic")], slack_webhook_urls=[hook.url("/slack")]
    )
    run_id = api.create_run("grpo", project="lab")
    _nan(run_id, api, 0)
    got = hook.wait_for(2)
    generic = next(r["body"] for r in got if r["path"] == "/generic")
    slack = next(r["body"] for r in got if r["path"] == "/slack")
    assert generic["event"] == "alert.firing"
    assert generic["alert"]["rule"] == "non_finite" and generic["alert"]["state"] == "firing"
    assert generic["alert"]["value"] == "NaN"  # non-finite spelled out, valid JSON
    assert generic["run"] == {"id": run_id, "name": "grpo", "project": "lab"}
    assert set(slack) == {"text"} and "non_finite" in slack["text"] and "lab/grpo" in slack["text"]
    api.log(run_id, [{"step": s, "metrics": {"actor/pg_loss": 0.1}} for s in range(1, 15)])
    got = hook.wait_for(4)
    resolved = [r["body"] for r in got if r["path"] == "/generic" and r["body"]["event"] == "alert.resolved"]
    assert len(resolved) == 1 and resolved[0]["alert"]["state"] == "resolved"


def test_a_down_listener_gets_the_alert_once_it_is_up(app_client, database_url, hooks):
    port = free_port()
    api = app_client(database_url, webhook_urls=[f"http://127.0.0.1:{port}/hook"], webhook_backoff=0.2,
                     webhook_backoff_max=0.5)  # fmt: skip
    run_id = api.create_run()
    _nan(run_id, api, 0)
    time.sleep(1.5)  # several attempts against a closed port
    hook = hooks(port=port)
    got = hook.wait_for(1, timeout=10)
    assert got[0]["body"]["event"] == "alert.firing"
    time.sleep(0.3)
    with api.services.db.read() as session:
        deliveries = repo.list_deliveries(session=session)
        assert len(deliveries) == 1 and deliveries[0]["status"] == "delivered"
        attempts = repo.list_attempts(session=session, delivery_id=deliveries[0]["id"])
    assert len(attempts) >= 3
    assert [a["ok"] for a in attempts] == [False] * (len(attempts) - 1) + [True]
    assert all(a["error"] for a in attempts[:-1]) and attempts[-1]["status_code"] == 200
    assert len(hook.received) == 1  # delivered once, not once per attempt


def test_an_erroring_endpoint_is_retried_then_marked_failed(app_client, sqlite_url, hooks):
    hook = hooks(status=500)
    api = app_client(sqlite_url, webhook_urls=[hook.url()], webhook_backoff=0.05, webhook_max_attempts=3)
    run_id = api.create_run()
    _nan(run_id, api, 0)
    hook.wait_for(3, ok_only=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with api.services.db.read() as session:
            delivery = repo.list_deliveries(session=session)[0]
        if delivery["status"] == "failed":
            break
        time.sleep(0.05)
    assert delivery["status"] == "failed" and delivery["attempts"] == 3
    assert "HTTP 500" in delivery["last_error"]
    time.sleep(0.3)
    assert len(hook.received) == 3


def test_a_slow_webhook_never_slows_ingest(app_client, sqlite_url, hooks):
    hook = hooks(delay=8.0)  # one delivery waited for in the request path would cost 8 s
    api = app_client(sqlite_url, webhook_urls=[hook.url()], webhook_timeout=20)
    runs = [api.create_run(f"r{i}") for i in range(5)]
    started = time.perf_counter()
    for run_id in runs:  # five alerts, each a delivery to the slow endpoint
        assert _nan(run_id, api, 0).status_code == 200
        for step in range(1, 10):
            assert api.log(run_id, [{"step": step, "metrics": {"actor/pg_loss": "NaN"}}]).status_code == 200
    elapsed = time.perf_counter() - started
    assert elapsed < 6.0, f"50 ingest requests took {elapsed:.2f}s while the webhook sleeps 8 s per call"
    hook.wait_for(1, timeout=30)


def test_backoff_doubles_up_to_the_cap():
    delays = [backoff_delay(n, base=0.5, cap=4.0) for n in range(1, 7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
