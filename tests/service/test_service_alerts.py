"""Alerts on synthetic streams: fire, stay one per (run, rule), resolve, survive a restart; rule
settings from the server, a rules file and the run's config. On SQLite and PostgreSQL."""

from __future__ import annotations

import json

import pytest


def _nan_steps(start, stop):
    return [
        {"step": s, "metrics": {"actor/pg_loss": "NaN", "actor/ppo_kl": 0.001}} for s in range(start, stop)
    ]


def _clean_steps(start, stop):
    return [{"step": s, "metrics": {"actor/pg_loss": 0.1, "actor/ppo_kl": 0.001}} for s in range(start, stop)]


def _alerts(api, run_id, **params):
    response = api.get(f"/api/v1/runs/{run_id}/alerts", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_non_finite_alert_fires_then_resolves(api):
    run_id = api.create_run()
    for batch in (_clean_steps(0, 5), _nan_steps(5, 6)):
        assert api.log(run_id, batch).status_code == 200
    alerts = _alerts(api, run_id)
    assert alerts["count"] == 1
    alert = alerts["data"][0]
    assert alert["rule"] == "non_finite" and alert["state"] == "firing" and alert["severity"] == "critical"
    assert alert["first_step"] == 5 and alert["run_id"] == run_id
    assert alert["message"] and alert["advice"]
    assert api.get(f"/api/v1/runs/{run_id}").json()["status"] == "critical"
    for step in range(6, 30):  # one request per step, like a trainer
        api.log(run_id, _clean_steps(step, step + 1))
    alert = _alerts(api, run_id)["data"][0]
    assert alert["state"] == "resolved" and alert["last_step"] > alert["first_step"]
    assert alert["resolved_at"] is not None
    assert api.get(f"/api/v1/runs/{run_id}").json()["status"] == "healthy"


def test_a_persisting_problem_is_one_alert_not_a_storm(api):
    run_id = api.create_run()
    for step in range(40):
        api.log(run_id, _nan_steps(step, step + 1))
    alerts = _alerts(api, run_id)
    assert alerts["count"] == 1
    assert alerts["data"][0]["state"] == "firing"
    assert alerts["data"][0]["first_step"] == 0 and alerts["data"][0]["last_step"] == 39


def test_a_second_episode_is_a_second_alert(api):
    run_id = api.create_run()
    api.log(run_id, _nan_steps(0, 1))
    api.log(run_id, _clean_steps(1, 20))
    api.log(run_id, _nan_steps(20, 21))
    states = [a["state"] for a in _alerts(api, run_id)["data"]]
    assert sorted(states) == ["firing", "resolved"]


def test_global_firing_filter(api):
    bad = api.create_run("bad")
    good = api.create_run("good")
    api.log(bad, _nan_steps(0, 1))
    api.log(good, _clean_steps(0, 3))
    firing = api.get("/api/v1/alerts", params={"state": "firing"}).json()
    assert firing["count"] == 1 and firing["data"][0]["run_id"] == bad
    assert api.get("/api/v1/alerts", params={"state": "resolved"}).json()["count"] == 0
    assert api.get("/api/v1/alerts").json()["count"] == 1


def test_resending_steps_does_not_feed_the_rules_twice(api):
    run_id = api.create_run(config={"rlvitals": {"rules": {"non_finite": {"fire_after": 2}}}})
    api.log(run_id, _nan_steps(0, 1))
    api.log(run_id, _nan_steps(0, 1))  # the same step again (a client retry)
    assert _alerts(api, run_id)["count"] == 0
    api.log(run_id, _nan_steps(1, 2))
    assert _alerts(api, run_id)["count"] == 1


def test_detector_state_survives_a_restart(app_client, database_url):
    api = app_client(database_url, rules={"non_finite": {"fire_after": 3}})
    run_id = api.create_run()
    api.log(run_id, _nan_steps(0, 2))  # a streak of 2: not yet firing
    assert _alerts(api, run_id)["count"] == 0
    api.restart()
    api.log(run_id, _nan_steps(2, 3))  # the third in a row fires only if the streak was kept
    alerts = _alerts(api, run_id)["data"]
    assert len(alerts) == 1 and alerts[0]["first_step"] == 0 and alerts[0]["state"] == "firing"
    api.restart()
    api.log(run_id, _clean_steps(3, 20))  # the open episode was kept too: it resolves
    assert _alerts(api, run_id)["data"][0]["state"] == "resolved"


def test_server_rules_setting_disables_a_rule(app_client, database_url):
    api = app_client(database_url, rules={"non_finite": {"enabled": False}})
    run_id = api.create_run()
    api.log(run_id, _nan_steps(0, 3))
    assert _alerts(api, run_id)["count"] == 0


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_rules_file_is_applied_and_run_config_overrides_it(app_client, sqlite_url, tmp_path, suffix):
    path = tmp_path / f"rules{suffix}"
    rules = {"non_finite": {"enabled": False}}
    if suffix == ".json":
        path.write_text(json.dumps(rules))
    else:
        path.write_text("non_finite:\n  enabled: false\n")
    api = app_client(sqlite_url, rules_file=path)
    quiet = api.create_run("quiet")
    loud = api.create_run("loud", config={"rlvitals": {"rules": {"non_finite": {"enabled": True}}}})
    api.log(quiet, _nan_steps(0, 2))
    api.log(loud, _nan_steps(0, 2))
    assert _alerts(api, quiet)["count"] == 0
    assert _alerts(api, loud)["count"] == 1


def test_a_bad_rules_file_stops_the_server_at_start(tmp_path):
    from rlvitals.service.app import create_app
    from rlvitals.service.health import RulesFileError
    from rlvitals.service.settings import Settings

    path = tmp_path / "rules.json"
    path.write_text("{oops")
    with pytest.raises(RulesFileError, match="not valid"):
        create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db", rules_file=path))
    path.write_text(json.dumps({"no_such_rule": {}}))
    with pytest.raises(ValueError, match="no_such_rule"):
        create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db", rules_file=path))


def test_clipfrac_out_of_band_fires_on_a_real_signal_stream(api):
    run_id = api.create_run()
    steps = [{"step": s, "metrics": {"actor/pg_clipfrac": 0.2, "actor/ppo_kl": 0.002}} for s in range(30)]
    steps += [
        {"step": s, "metrics": {"actor/pg_clipfrac": 0.6, "actor/ppo_kl": 0.002}} for s in range(30, 80)
    ]
    api.log(run_id, steps)
    rules = {a["rule"] for a in _alerts(api, run_id, state="firing")["data"]}
    assert "pg_clipfrac_range" in rules


def test_a_step_logged_in_several_requests_is_checked_whole(api):
    run_id = api.create_run()
    api.log(run_id, _clean_steps(0, 5))
    api.log(run_id, [{"step": 5, "metrics": {"actor/pg_loss": 0.1}}])
    api.log(run_id, [{"step": 5, "metrics": {"actor/entropy": "NaN"}}])  # same step, another call
    alerts = _alerts(api, run_id)["data"]
    assert [(a["rule"], a["first_step"]) for a in alerts] == [("non_finite", 5)]
    api.log(run_id, [{"step": 5, "metrics": {"actor/entropy": "NaN"}}])  # resent: not counted again
    assert _alerts(api, run_id)["count"] == 1
