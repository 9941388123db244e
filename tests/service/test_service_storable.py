"""Nothing a write accepts may make a later read fail (issue 13, item 1).

Every write route gets input that cannot be stored and read back — lone surrogates (what JSON's
``\\ud800`` escape decodes to) in names, tags, configs, metric names and safetensors metadata, JSON
nested past ``max_json_depth`` or past Python's recursion limit, NUL in a config — and must refuse
it with a 4xx in the one error shape whose body itself encodes. Then every read route (API,
dashboard pages and data, /metrics) must answer, on SQLite and PostgreSQL. Before the fix one
surrogate in a config was committed and then broke ``GET /api/v1/runs`` for everyone.
"""

from __future__ import annotations

import json
import struct

import pytest

from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done

JSON = {"content-type": "application/json"}
SURROGATE = "\\ud800"  # the JSON escape, as a client's json.dumps writes it


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def run_bodies() -> list[tuple[str, str]]:
    return [
        ("surrogate name", f'{{"name": "{SURROGATE}"}}'),
        ("surrogate project", f'{{"name": "p", "project": "x{SURROGATE}"}}'),
        ("surrogate tag", f'{{"name": "t", "tags": ["{SURROGATE}"]}}'),
        ("surrogate config value", f'{{"name": "cv", "config": {{"k": "{SURROGATE}"}}}}'),
        ("surrogate config key", f'{{"name": "ck", "config": {{"{SURROGATE}": 1}}}}'),
        ("surrogate deep in config", f'{{"name": "cd", "config": {{"a": [{{"b": ["{SURROGATE}"]}}]}}}}'),
        ("NUL in config", '{"name": "nul", "config": {"k": "a\\u0000b"}}'),
        ("config 65 deep", f'{{"name": "d65", "config": {{"k": {nested(64)}}}}}'),
        ("config 476 deep", f'{{"name": "d476", "config": {{"k": {nested(475)}}}}}'),
        ("config 100k deep", f'{{"name": "d100k", "config": {{"k": {nested(100_000)}}}}}'),
        ("surrogate name, too long", f'{{"name": "{SURROGATE * 300}"}}'),
    ]


def metric_bodies() -> list[tuple[str, str]]:
    return [
        ("surrogate metric name", f'{{"steps": [{{"step": 1, "metrics": {{"{SURROGATE}": 1.0}}}}]}}'),
        (
            "surrogate in long name",
            f'{{"steps": [{{"step": 1, "metrics": {{"{"x" * 300}{SURROGATE}": 1}}}}]}}',
        ),
        ("body 100k deep", f'{{"steps": {nested(100_000)}}}'),
    ]


def raw_safetensors(header: str) -> bytes:
    data = header.encode()
    return struct.pack("<Q", len(data)) + data


def batch_bodies() -> list[tuple[str, bytes]]:
    deep = nested(1_000)
    return [
        ("surrogate in config", make_batch(1, metadata={"config": f'{{"k": "{SURROGATE}"}}'})),
        ("surrogate config key", make_batch(1, metadata={"config": f'{{"{SURROGATE}": 1}}'})),
        ("surrogate reported key", make_batch(1, metadata={"reported": f'{{"{SURROGATE}": 0.1}}'})),
        ("config 65 deep", make_batch(1, metadata={"config": f'{{"k": {nested(64)}}}'})),
        ("config 1000 deep", make_batch(1, metadata={"config": f'{{"k": {deep}}}'})),
        ("reported 1000 deep", make_batch(1, metadata={"reported": f'{{"k": {deep}}}'})),
        ("header 100k deep", raw_safetensors(f'{{"__metadata__": {{"step": "1"}}, "x": {nested(100_000)}}}')),
    ]


def assert_refused(response, what: str) -> None:
    assert 400 <= response.status_code < 500, (what, response.status_code, response.text[:300])
    body = json.loads(response.content.decode("utf-8"))  # the echo of the input encodes
    assert set(body["error"]) == {"code", "message", "detail"}, (what, body)


def read_routes(run_id: int, audit_id: int) -> list[str]:
    return [
        "/healthz",
        "/metrics",
        "/api/v1/runs",
        f"/api/v1/runs/{run_id}",
        f"/api/v1/runs/{run_id}/metrics",
        f"/api/v1/runs/{run_id}/metrics?max_points=0",
        f"/api/v1/runs/{run_id}/alerts",
        "/api/v1/alerts",
        f"/api/v1/runs/{run_id}/audits",
        f"/api/v1/audits/{audit_id}",
        "/",
        f"/runs/{run_id}",
        f"/runs/{run_id}/audits",
        "/alerts",
        "/compare",
        f"/api/v1/runs/{run_id}/metric-names",
        f"/api/v1/runs/{run_id}/metrics?wall_time=true",
        f"/api/v1/audits/{audit_id}/histograms",
    ]


def test_unstorable_input_is_refused_and_every_read_still_answers(api):
    # What is allowed at the edge is stored and read back unchanged.
    edge_config = {"k": json.loads(nested(63)), "emoji": "🙂 ü"}
    run_id = api.create_run("edge 🙂", tags=["ok", "ü"], config=edge_config)
    assert api.log(run_id, [{"step": 0, "metrics": {"loss 🙂": 1.0}}]).status_code == 200

    for what, body in run_bodies():
        assert_refused(api.post("/api/v1/runs", content=body, headers=JSON), f"runs: {what}")
    for what, body in metric_bodies():
        assert_refused(api.post(f"/api/v1/runs/{run_id}/metrics", content=body, headers=JSON), what)
    for what, body in batch_bodies():
        assert_refused(api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET), what)

    accepted = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(2), headers=OCTET)
    assert accepted.status_code == 202, accepted.text
    audit_id = accepted.json()["id"]
    wait_done(api, audit_id)

    for path in read_routes(run_id, audit_id):
        response = api.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
    runs = api.get("/api/v1/runs", params={"include": "config"}).json()  # configs only when asked
    assert runs["count"] == 1, [r["name"] for r in runs["data"]]
    assert runs["data"][0]["config"] == edge_config
    assert runs["data"][0]["tags"] == ["ok", "ü"]
    assert "loss 🙂" in api.get(f"/api/v1/runs/{run_id}/metrics").json()["series"]


def test_json_depth_limit_is_a_setting(app_client, tmp_path):
    api = app_client(f"sqlite:///{tmp_path}/depth.db", max_json_depth=8)
    shallow = api.post("/api/v1/runs", json={"name": "a", "config": {"k": [[[[[[]]]]]]}})  # 7 levels
    assert shallow.status_code == 201, shallow.text
    deep = api.post("/api/v1/runs", json={"name": "b", "config": {"k": [[[[[[[[]]]]]]]]}})  # 9 levels
    assert deep.status_code == 422
    assert "limit of 8 levels" in deep.json()["error"]["message"]
    run_id = shallow.json()["id"]
    batch = make_batch(0, tensors=make_tensors(), metadata={"config": json.dumps({"k": [[[[[[[[]]]]]]]]})})
    refused = api.post(f"/api/v1/runs/{run_id}/batches", content=batch, headers=OCTET)
    assert refused.status_code == 422 and "limit of 8 levels" in refused.json()["error"]["message"]


@pytest.mark.parametrize("depth", [10, 5_000])
def test_jsonable_refuses_instead_of_exhausting_the_stack(depth):
    from rlvitals.service.encoding import JSONABLE_DEPTH, jsonable

    value: list = []
    for _ in range(depth):
        value = [value]
    if depth < JSONABLE_DEPTH:
        assert jsonable(value) == value
    else:
        with pytest.raises(ValueError, match="nested deeper"):
            jsonable(value)
