"""Severities end to end: info alerts are stored and shown but not sent to webhooks (unless
``webhook_info``), an info episode that escalates is updated and sent then, and the dashboard's health
snapshot carries the rules' marks and each signal's current value. On SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pytest

# four updates per batch (verl's reference runs), so a low clip fraction is the "below band" case
MULTI_UPDATE = {
    "data": {"train_batch_size": 1024},
    "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 256}},
}


@pytest.fixture
def hook(hooks):
    return hooks()


def _alerts(api, run_id):
    response = api.get(f"/api/v1/runs/{run_id}/alerts")
    assert response.status_code == 200, response.text
    return {a["rule"]: a for a in response.json()["data"]}


def _low_clipfrac(api, run_id, start, stop):
    steps = [{"step": s, "metrics": {"actor/pg_clipfrac": 0.004}} for s in range(start, stop)]
    assert api.log(run_id, steps).status_code == 200


def test_info_alert_is_shown_but_not_sent_and_leaves_the_run_healthy(app_client, database_url, hook):
    api = app_client(database_url, webhook_urls=[hook.url("/generic")])
    run_id = api.create_run("verl-ref", config=MULTI_UPDATE)
    _low_clipfrac(api, run_id, 0, 40)
    alert = _alerts(api, run_id)["pg_clipfrac_range"]
    assert (alert["severity"], alert["state"]) == ("info", "firing")
    assert api.get(f"/api/v1/runs/{run_id}").json()["status"] == "healthy"
    api.log(run_id, [{"step": 40, "metrics": {"actor/pg_loss": "NaN"}}])  # a critical one is sent
    (got,) = hook.wait_for(1)
    assert got["body"]["alert"]["rule"] == "non_finite"
    time.sleep(1.0)  # the sender had time to send anything else queued
    assert [r["body"]["alert"]["rule"] for r in hook.received] == ["non_finite"]


def test_webhook_info_routes_info_alerts_to_webhooks(app_client, database_url, hook):
    api = app_client(database_url, webhook_urls=[hook.url("/generic")], webhook_info=True)
    run_id = api.create_run("verl-ref", config=MULTI_UPDATE)
    _low_clipfrac(api, run_id, 0, 40)
    (got,) = hook.wait_for(1)
    assert got["body"]["alert"]["rule"] == "pg_clipfrac_range" and got["body"]["alert"]["severity"] == "info"


def test_per_run_opt_in_makes_the_low_side_a_warning(api):
    config = {**MULTI_UPDATE, "rlvitals": {"rules": {"pg_clipfrac_range": {"low_severity": "warning"}}}}
    run_id = api.create_run("opted-in", config=config)
    _low_clipfrac(api, run_id, 0, 40)
    assert _alerts(api, run_id)["pg_clipfrac_range"]["severity"] == "warning"
    assert api.get(f"/api/v1/runs/{run_id}").json()["status"] == "warning"


def test_an_info_episode_that_escalates_is_updated_and_sent(app_client, database_url, hook):
    api = app_client(database_url, webhook_urls=[hook.url("/generic")])
    run_id = api.create_run("collapsing")
    # entropy 0.8 -> 0.2 (25% of its early level: info), then 0.05 (6%: warning)
    levels = [0.8] * 10 + [0.2] * 20 + [0.05] * 20
    for step, entropy in enumerate(levels):
        assert api.log(run_id, [{"step": step, "metrics": {"actor/entropy": entropy}}]).status_code == 200
        if step == 29:
            alert = _alerts(api, run_id)["entropy_collapse"]
            assert alert["severity"] == "info" and alert["state"] == "firing"
    alert = _alerts(api, run_id)["entropy_collapse"]
    assert alert["severity"] == "warning" and alert["state"] == "firing" and alert["first_step"] < 20
    assert alert["evidence"]["escalated_from"] == "info" and "forecast_step" in alert["evidence"]
    (got,) = hook.wait_for(1)
    assert got["body"]["event"] == "alert.firing" and got["body"]["alert"]["severity"] == "warning"
    assert len(_alerts(api, run_id)) == 1  # still one alert for the episode


def test_health_snapshot_serves_marks_and_current_values(api):
    run_id = api.create_run("marks")
    steps = [
        {"step": s, "metrics": {"actor/ppo_kl": 0.001 + s * 1e-5, "actor/entropy": 0.7}} for s in range(30)
    ]
    api.log(run_id, steps)
    body = api.get(f"/api/v1/runs/{run_id}/health").json()
    marks = {(m["rule"], m["signal"], m.get("label")): m for m in body["marks"]}
    assert marks[("ppo_kl_drift", "ppo_kl", "ceiling")]["y"] == 0.05
    band = next(m for m in body["marks"] if m["rule"] == "pg_clipfrac_range")
    assert (band["low"], band["high"]) == (0.1, 0.3)
    assert body["signals"]["ppo_kl"] == pytest.approx(0.001 + 29e-5)
    assert body["step"] == 29
    assert api.get("/api/v1/runs/999999/health").status_code == 404
