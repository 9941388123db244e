"""Incidents on the server: stored with their evidence, served by the API (alerts one click away),
announced to webhooks once per open / escalation / resolve instead of once per alert, and reported in the
metrics-write answer while critical (what a trainer that asked to halt reads)."""

from __future__ import annotations

import random
import time

from rlvitals.service.storage import repository as repo


def _storm_steps(n: int = 400, seed: int = 0, start: int = 1):
    """One prompt per step: a noisy reward, and every 25 steps one step where every completion hits the
    length cap (reward 0, entropy tripled) that recovers the next step."""
    rng = random.Random(seed)
    steps = []
    for step in range(start, start + n):
        capped = step > 30 and step % 25 == 0
        steps.append(
            {
                "step": step,
                "metrics": {
                    "reward": 0.0 if capped else min(1.0, max(0.25, rng.gauss(0.7, 0.08))),
                    "reward_std": 0.0 if capped else 0.3,
                    "entropy": 1.6 if capped else 0.5 + rng.gauss(0, 0.02),
                    "completions/clipped_ratio": 1.0 if capped else 0.0,
                    "grad_norm": 0.3 + abs(rng.gauss(0, 0.05)),
                },
            }
        )
    return steps


def _log_all(api, run_id, steps, chunk=50):
    for i in range(0, len(steps), chunk):
        response = api.log(run_id, steps[i : i + chunk])
        assert response.status_code == 200, response.text


def test_a_storm_of_alerts_is_one_incident_and_one_notification(app_client, database_url, hooks):
    hook = hooks()
    api = app_client(database_url, webhook_urls=[hook.url("/generic")], webhook_events="incidents")
    run_id = api.create_run("storm", project="lab")
    _log_all(api, run_id, _storm_steps())
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts").json()["data"]
    collapses = [a for a in alerts if a["rule"] == "policy_collapse"]
    assert len(collapses) >= 8  # what paged once per alert before
    incidents = api.get(f"/api/v1/runs/{run_id}/incidents").json()
    paging = [i for i in incidents["data"] if i["severity"] != "info"]
    assert len(paging) == 1
    (incident,) = paging
    assert incident["cause"] == "truncation" and incident["primary_rule"] == "policy_collapse"
    assert incident["members"]["policy_collapse"]["episodes"] == len(collapses)
    assert all({"rule", "step", "value", "state"} <= set(f) for f in incident["findings"])
    detail = api.get(incident["alerts_url"]).json()
    assert {a["id"] for a in detail["alerts"]} >= {a["id"] for a in collapses}  # the findings, one click away
    got = hook.wait_for(1)
    time.sleep(0.5)  # nothing more should come
    events = [r["body"]["event"] for r in hook.received]
    assert events[0] == "incident.opened" and len(events) <= 2, events
    body = got[0]["body"]
    assert body["incident"]["id"] == incident["id"] and body["run"]["name"] == "storm"
    with api.services.db.read() as session:
        deliveries = repo.list_deliveries(session=session)
    assert deliveries and all(
        d["alert_id"] is None and d["incident_id"] == incident["id"] for d in deliveries
    )


def test_a_critical_incident_rides_on_the_write_answer_that_waits_for_the_rules(
    app_client, database_url, hooks
):
    hook = hooks()
    api = app_client(
        database_url,
        webhook_urls=[hook.url("/generic")],
        slack_webhook_urls=[hook.url("/slack")],
        webhook_events="incidents",
        incidents={"quiet_steps": 20, "quiet_points": 2},
    )
    run_id = api.create_run("nan", project="lab")
    rules = {"params": {"wait": "rules"}}  # what a trainer that halts on critical incidents sends
    healthy = api.log(run_id, [{"step": 0, "metrics": {"actor/pg_loss": 0.1}}], **rules).json()
    assert "critical_incidents" not in healthy and healthy["evaluated"] is True
    answer = api.log(run_id, [{"step": 1, "metrics": {"actor/pg_loss": "NaN"}}], **rules).json()
    (critical,) = answer["critical_incidents"]
    assert answer["evaluated"] is True
    incident = api.get(f"/api/v1/incidents/{critical['id']}").json()
    assert critical["cause"] == "non_finite" == incident["cause"] and incident["severity"] == "critical"
    slack = next(r["body"] for r in hook.wait_for(2) if r["path"] == "/slack")
    assert f"incident #{incident['number']}" in slack["text"] and "CRITICAL" in slack["text"]
    # the rule resolves after 10 clean steps; the incident after 20 more quiet ones, announced once
    answer = api.log(run_id, [{"step": s, "metrics": {"actor/pg_loss": 0.1}} for s in range(2, 20)]).json()
    assert api.get(f"/api/v1/incidents/{critical['id']}").json()["state"] == "open"
    answer = api.log(run_id, [{"step": s, "metrics": {"actor/pg_loss": 0.1}} for s in range(20, 40)], **rules)
    assert "critical_incidents" not in answer.json()
    assert api.get(f"/api/v1/runs/{run_id}/incidents?state=open").json()["count"] == 0
    everywhere = api.get("/api/v1/incidents?state=resolved").json()["data"]
    assert [i["id"] for i in everywhere] == [critical["id"]]
    generic = [r["body"]["event"] for r in hook.wait_for(4) if r["path"] == "/generic"]
    assert generic == ["incident.opened", "incident.resolved"]


def test_gpu_hours_after_onset_use_the_runs_gpu_count(api):
    run_id = api.create_run("cost", config={"rlvitals": {"gpus": 8}})
    t0 = 1_700_000_000.0
    steps = [{"step": s, "wall_time": t0 + 60 * s, "metrics": {"actor/pg_loss": 0.1}} for s in range(10)]
    steps.append({"step": 10, "wall_time": t0 + 600, "metrics": {"actor/pg_loss": "NaN"}})
    steps += [
        {"step": s, "wall_time": t0 + 60 * s, "metrics": {"actor/pg_loss": "NaN"}} for s in range(11, 70)
    ]
    assert api.log(run_id, steps).status_code == 200
    (incident,) = api.get(f"/api/v1/runs/{run_id}/incidents").json()["data"]
    spent = incident["spent_after_onset"]
    assert spent["gpus"] == 8
    assert spent["hours"] == round(59 * 60 / 3600, 4) and spent["gpu_hours"] == round(8 * 59 * 60 / 3600, 4)


def test_zero_gradients_on_tied_batches_are_an_info_incident_that_pages_nobody(
    app_client, database_url, hooks
):
    hook = hooks()
    api = app_client(database_url, webhook_urls=[hook.url("/generic")], webhook_events="incidents")
    run_id = api.create_run("grpo-small-groups")
    steps = []
    for step in range(1, 200):
        tied = 101 <= step < 113
        metrics = {"grad_norm": 0.0 if tied else 0.1, "entropy": 0.4}
        if step % 2:
            metrics |= {
                "reward": 0.0 if tied else 0.5 + 0.01 * (step % 7),
                "reward_std": 0.0 if tied else 0.3,
            }
        steps.append({"step": step, "metrics": metrics})
    _log_all(api, run_id, steps)
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts").json()["data"]
    zero = [a for a in alerts if a["rule"] == "grad_norm_zero"]
    assert zero and all(a["severity"] == "info" for a in zero)  # the rule itself reads the tie
    incidents = api.get(f"/api/v1/runs/{run_id}/incidents").json()["data"]
    assert [(i["cause"], i["severity"]) for i in incidents] == [("zero_advantage", "info")]
    time.sleep(0.5)
    assert hook.received == []


def test_a_one_point_kl_spike_is_an_incident_that_pages_nobody(app_client, database_url, hooks):
    hook = hooks()
    api = app_client(database_url, webhook_urls=[hook.url("/generic")], webhook_events="incidents")
    run_id = api.create_run("one-spike")
    rng = random.Random(0)
    steps = [
        {
            "step": step,
            "metrics": {
                "kl": 0.9 if step == 80 else 0.02 + abs(rng.gauss(0, 0.003)),
                "grad_norm": 0.3 + abs(rng.gauss(0, 0.02)),
                "reward": 0.5 + rng.gauss(0, 0.05),
                "entropy": 0.5,
            },
        }
        for step in range(1, 160)
    ]
    _log_all(api, run_id, steps)
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts").json()["data"]
    assert [(a["rule"], a["severity"]) for a in alerts] == [("kl_spike", "warning")]  # on the dashboard
    incidents = api.get(f"/api/v1/runs/{run_id}/incidents").json()["data"]
    assert [(i["cause"], i["state"], i["notified_severity"]) for i in incidents] == [
        ("kl_spike", "resolved", None)
    ]
    time.sleep(0.5)
    assert hook.received == []  # over within the hold: no page 20 steps later, no all-clear


def test_unknown_incident_and_run_are_404_in_the_error_shape(api):
    for url in ("/api/v1/incidents/999", "/api/v1/runs/999/incidents"):
        response = api.get(url)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert api.get("/api/v1/runs/1/incidents?state=bogus").status_code == 422
