"""Large ``POST /metrics`` bodies are parsed in a worker thread in pieces (the event loop keeps
serving), refused (413) as soon as they pass ``max_steps_per_request`` / ``max_points_per_request``
(never parsed to their end), and answered as FastAPI answers the same body: the same validation
errors at the same locations.

Before: one ``json.loads`` and one pydantic call in the event loop, the whole body every time.
"""

from __future__ import annotations

import json

import pytest
from rlvitals.service.api.bodies import INLINE_BYTES

JSON = {"content-type": "application/json"}


def _steps(n: int, width: int = 20, start: int = 0) -> list[dict]:
    return [
        {"step": s, "metrics": {f"train/m{i}": 0.5 + i for i in range(width)}}
        for s in range(start, start + n)
    ]


@pytest.fixture
def api(app_client, sqlite_url):
    return app_client(sqlite_url)


def test_a_large_valid_body_is_stored_whole(api):
    run_id = api.create_run()
    body = json.dumps({"steps": _steps(3000)})
    assert len(body) > INLINE_BYTES
    response = api.post(f"/api/v1/runs/{run_id}/metrics", content=body, headers=JSON)
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] == 60_000
    series = api.get(f"/api/v1/runs/{run_id}/metrics?names=train/m7&max_points=0").json()
    assert len(series["series"]["train/m7"]["step"]) == 3000


def test_a_body_past_the_point_limit_is_refused_before_it_is_parsed_to_its_end(app_client, sqlite_url):
    api = app_client(sqlite_url, max_points_per_request=10_000)
    run_id = api.create_run()
    # valid JSON for its first 20,000 points, then garbage: only a parser that stops at the limit says 413
    body = json.dumps({"steps": _steps(1000)})[:-2] + ", {broken"
    assert len(body) > INLINE_BYTES
    response = api.post(f"/api/v1/runs/{run_id}/metrics", content=body, headers=JSON)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "payload_too_large" and "max_points_per_request" in error["message"]
    assert error["detail"] == {"limit": 10_000}


def test_a_body_past_the_step_limit_is_refused(app_client, sqlite_url):
    api = app_client(sqlite_url, max_steps_per_request=500)
    run_id = api.create_run()
    response = api.post(
        f"/api/v1/runs/{run_id}/metrics", content=json.dumps({"steps": _steps(600)}), headers=JSON
    )
    assert response.status_code == 413 and response.json()["error"]["detail"] == {"limit": 500}


def _bad(steps: list[dict], at: int) -> list[dict]:
    steps = [dict(s, metrics=dict(s["metrics"])) for s in steps]
    steps[at]["metrics"]["train/m3"] = "high"
    steps[at + 1]["step"] = -1
    return steps


@pytest.mark.parametrize("defect", ["value", "json", "extra-key", "not-a-list", "missing"])
def test_errors_in_a_large_body_are_the_ones_a_small_body_gets(api, defect):
    run_id = api.create_run()

    def body(n: int) -> str:
        steps = _steps(n)
        if defect == "value":
            return json.dumps({"steps": _bad(steps, n - 3)})
        if defect == "json":
            return json.dumps({"steps": steps})[:-2] + "}"
        if defect == "extra-key":
            return json.dumps({"steps": steps, "run": 1})
        if defect == "not-a-list":
            return json.dumps({"steps": {"0": steps}})
        return json.dumps({"stepz": steps})

    small = api.post(f"/api/v1/runs/{run_id}/metrics", content=body(10), headers=JSON)
    large = api.post(f"/api/v1/runs/{run_id}/metrics", content=body(3000), headers=JSON)
    assert small.status_code == large.status_code == 422, (small.text, large.text[:500])
    small_error, large_error = small.json()["error"], large.json()["error"]
    assert small_error["code"] == large_error["code"] == "validation_error"
    first_small, first_large = small_error["detail"][0], large_error["detail"][0]
    assert first_small["type"] == first_large["type"]
    if defect == "value":  # the same place, counted in the whole body
        assert first_small["loc"] == ["body", "steps", "7", "metrics", "train/m3", "float"]
        assert first_large["loc"] == ["body", "steps", "2997", "metrics", "train/m3", "float"]
    elif defect != "json":
        assert first_small["loc"] == first_large["loc"]
    assert api.get(f"/api/v1/runs/{run_id}/metric-names").json()["names"] == []


@pytest.mark.parametrize("limits", [{"max_points": 20_000}, {"max_steps": 1_000}])
def test_an_oversized_body_is_refused_holding_one_step_at_a_time(limits):
    """Steps and points are counted before any step is kept: a flood of oversized bodies costs the
    server each body's text, not the ~8x its size the steps before the limit would take as objects."""
    import tracemalloc

    from rlvitals.service.api.bodies import parse_large
    from rlvitals.service.errors import BodyError

    body = json.dumps({"steps": _steps(5000)}).encode()
    tracemalloc.start()
    try:
        with pytest.raises(BodyError) as refused:
            parse_large(body, **{"max_steps": 100_000, "max_points": 250_000, **limits})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status_code == 413
    # the text itself (the size of the body) and a step or two; keeping 20,000 points took ~2.5 MB more
    assert peak - len(body) < 256 * 1024, peak - len(body)
