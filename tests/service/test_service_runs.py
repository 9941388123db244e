"""Runs: create, resume by (project, name), list with status, get; on SQLite and PostgreSQL."""

from __future__ import annotations


def test_create_returns_201_with_an_id(api):
    response = api.post("/api/v1/runs", json={"name": "grpo-7b", "config": {"lr": 1e-6}, "tags": ["a"]})
    assert response.status_code == 201
    run = response.json()
    assert isinstance(run["id"], int)
    assert run["name"] == "grpo-7b" and run["project"] == "default"
    assert run["config"] == {"lr": 1e-6} and run["tags"] == ["a"]
    assert run["status"] == "healthy" and run["firing_alerts"] == [] and run["last_step"] is None


def test_same_project_and_name_resumes_the_run(api):
    first = api.post("/api/v1/runs", json={"name": "r", "project": "p", "tags": ["x"]})
    again = api.post("/api/v1/runs", json={"name": "r", "project": "p", "tags": ["y"]})
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["tags"] == ["x", "y"]
    other_project = api.post("/api/v1/runs", json={"name": "r", "project": "q"})
    assert other_project.status_code == 201 and other_project.json()["id"] != first.json()["id"]


def test_list_shows_last_step_and_status(api):
    healthy = api.create_run("healthy")
    broken = api.create_run("broken")
    assert api.log(healthy, [{"step": 3, "metrics": {"loss": 1.0}}]).status_code == 200
    assert api.log(broken, [{"step": 7, "metrics": {"actor/pg_loss": "NaN"}}]).status_code == 200
    listing = api.get("/api/v1/runs").json()
    assert listing["count"] == 2
    by_name = {run["name"]: run for run in listing["data"]}
    assert by_name["healthy"]["last_step"] == 3 and by_name["healthy"]["status"] == "healthy"
    assert by_name["broken"]["last_step"] == 7 and by_name["broken"]["status"] == "critical"
    assert [a["rule"] for a in by_name["broken"]["firing_alerts"]] == ["non_finite"]


def test_list_filters_by_project_and_pages(api):
    for i in range(5):
        api.create_run(f"r{i}", project="a" if i < 3 else "b")
    page = api.get("/api/v1/runs", params={"project": "a", "limit": 2}).json()
    assert page["count"] == 3 and len(page["data"]) == 2
    assert {r["project"] for r in page["data"]} == {"a"}


def test_get_run_and_unknown_run_is_404(api):
    run_id = api.create_run("one")
    assert api.get(f"/api/v1/runs/{run_id}").json()["name"] == "one"
    missing = api.get("/api/v1/runs/424242")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


def test_resume_with_new_config_replaces_it(api):
    run_id = api.create_run("c", config={"a": 1})
    response = api.post("/api/v1/runs", json={"name": "c", "config": {"a": 2}})
    assert response.status_code == 200 and response.json()["id"] == run_id
    assert api.get(f"/api/v1/runs/{run_id}").json()["config"] == {"a": 2}


def test_a_config_over_the_size_limit_is_refused_at_the_door(app_client, database_url):
    api = app_client(database_url, max_run_config_bytes=4096)
    big = {"blob": "x" * 5000}
    response = api.post("/api/v1/runs", json={"name": "big", "config": big})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert "max_run_config_bytes" in error["message"] and error["detail"]["limit"] == 4096
    assert api.get("/api/v1/runs").json()["count"] == 0  # nothing stored
    resumed = api.create_run("ok", config={"lr": 1e-6})
    assert api.post("/api/v1/runs", json={"name": "ok", "config": big}).status_code == 422
    assert api.get(f"/api/v1/runs/{resumed}").json()["config"] == {"lr": 1e-6}
    many = api.post("/api/v1/runs", json={"name": "tags", "tags": [str(i) for i in range(101)]})
    assert many.status_code == 422 and many.json()["error"]["code"] == "validation_error"


def test_the_runs_list_leaves_configs_out_unless_asked(api):
    for n in range(3):
        api.create_run(f"r{n}", config={"n": n, "text": "y" * 1000})
    page = api.get("/api/v1/runs", params={"limit": 2})
    assert page.status_code == 200 and page.json()["count"] == 3 and len(page.json()["data"]) == 2
    assert all("config" not in run for run in page.json()["data"])
    assert len(page.content) < 2000
    rest = api.get("/api/v1/runs", params={"limit": 2, "offset": 2, "include": "config"}).json()
    assert [run["config"]["n"] for run in rest["data"]] == [0] and rest["count"] == 3
    assert api.get("/api/v1/runs", params={"include": "everything"}).status_code == 422


def test_a_huge_config_is_refused_before_its_body_is_parsed(api):
    body = b'{"name": "huge", "config": {"blob": "' + b"y" * (3 * 1024 * 1024) + b'"}}'
    response = api.post("/api/v1/runs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "max_run_config_bytes" in response.json()["error"]["message"]
    assert api.get("/api/v1/runs").json()["count"] == 0
