"""Every 4xx/5xx has one shape: {"error": {"code": str, "message": str, "detail": any}} (and no 500
on user input). One test per bad input the API promises to refuse."""

from __future__ import annotations

import pytest
import torch

from tests.service.batchdata import OCTET, make_batch, make_tensors


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "detail"}
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.fixture
def sqlite_api(app_client, sqlite_url):
    return app_client(sqlite_url, max_request_bytes=64 * 1024, max_batch_bytes=256 * 1024)


def test_unknown_path_is_404(sqlite_api):
    assert_error(sqlite_api.get("/api/v1/nothing"), 404, "not_found")


def test_wrong_method_is_405(sqlite_api):
    assert_error(sqlite_api.delete("/api/v1/runs"), 405, "method_not_allowed")
    assert_error(sqlite_api.put("/healthz"), 405, "method_not_allowed")


def test_unknown_run_is_404_everywhere(sqlite_api):
    for path in ("/api/v1/runs/777", "/api/v1/runs/777/metrics", "/api/v1/runs/777/audits",
                 "/api/v1/runs/777/alerts", "/api/v1/runs/777/events", "/api/v1/audits/777"):  # fmt: skip
        assert_error(sqlite_api.get(path), 404, "not_found")
    assert_error(sqlite_api.log(777, [{"step": 1, "metrics": {"a": 1}}]), 404, "not_found")
    assert_error(sqlite_api.post("/api/v1/runs/777/batches", content=make_batch(), headers=OCTET), 404)


def test_non_integer_run_id_is_422(sqlite_api):
    error = assert_error(sqlite_api.get("/api/v1/runs/abc"), 422, "validation_error")
    assert "run_id" in error["message"]


def test_malformed_json_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    response = sqlite_api.post(
        f"/api/v1/runs/{run_id}/metrics", content=b'{"steps": [', headers={"content-type": "application/json"}
    )
    assert_error(response, 422, "validation_error")


@pytest.mark.parametrize(
    ("steps", "where"),
    [
        ([{"step": "one", "metrics": {"a": 1}}], "step"),
        ([{"step": -1, "metrics": {"a": 1}}], "step"),
        ([{"step": 1.5, "metrics": {"a": 1}}], "step"),
        ([{"step": 1, "metrics": {"a": "1.5"}}], "metrics"),
        ([{"step": 1, "metrics": {"a": "nan"}}], "metrics"),
        ([{"step": 1, "metrics": {"a": True}}], "metrics"),
        ([{"step": 1, "metrics": {"a": [1]}}], "metrics"),
        ([{"step": 1, "metrics": {"": 1}}], "metrics"),
        ([{"step": 1, "metrics": [1, 2]}], "metrics"),
        ([{"step": 1, "metrics": {"a": 1}, "bogus": 2}], "bogus"),
        ([{"metrics": {"a": 1}}], "step"),
    ],
)
def test_wrong_types_in_metrics_are_422_naming_the_field(sqlite_api, steps, where):
    run_id = sqlite_api.create_run()
    error = assert_error(sqlite_api.log(run_id, steps), 422, "validation_error")
    assert where in error["message"], error
    assert isinstance(error["detail"], list) and error["detail"]


def test_missing_steps_key_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    assert_error(sqlite_api.post(f"/api/v1/runs/{run_id}/metrics", json={"points": []}), 422)


def test_bad_run_create_bodies_are_422(sqlite_api):
    assert_error(sqlite_api.post("/api/v1/runs", json={}), 422, "validation_error")
    assert_error(sqlite_api.post("/api/v1/runs", json={"name": ""}), 422)
    assert_error(sqlite_api.post("/api/v1/runs", json={"name": "x", "tags": "a"}), 422)
    assert_error(sqlite_api.post("/api/v1/runs", json={"name": "x", "config": []}), 422)


def test_bad_rule_overrides_in_run_config_are_422(sqlite_api):
    bad = {"rlvitals": {"rules": {"no_such_rule": {"enabled": False}}}}
    error = assert_error(
        sqlite_api.post("/api/v1/runs", json={"name": "x", "config": bad}), 422, "invalid_input"
    )
    assert "no_such_rule" in error["message"]
    wrong = {"rlvitals": {"rules": {"pg_clipfrac_range": {"low": 0.5, "high": 0.1}}}}
    assert_error(sqlite_api.post("/api/v1/runs", json={"name": "y", "config": wrong}), 422, "invalid_input")


def test_bad_query_parameters_are_422(sqlite_api):
    run_id = sqlite_api.create_run()
    assert_error(sqlite_api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": -1}), 422)
    assert_error(sqlite_api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": "x"}), 422)
    assert_error(sqlite_api.get(f"/api/v1/runs/{run_id}/metrics", params={"names": ","}), 400, "bad_request")
    assert_error(sqlite_api.get("/api/v1/alerts", params={"state": "open"}), 422)
    assert_error(sqlite_api.get("/api/v1/runs", params={"limit": 0}), 422)


def test_json_body_over_the_limit_is_413(sqlite_api):
    run_id = sqlite_api.create_run()
    steps = [{"step": s, "metrics": {f"metric_{i}": 0.5 for i in range(20)}} for s in range(200)]
    assert_error(sqlite_api.log(run_id, steps), 413, "payload_too_large")


def test_json_body_over_the_limit_without_length_is_413(sqlite_api):
    run_id = sqlite_api.create_run()

    async def chunks():
        yield b'{"steps": ['
        for s in range(3000):
            yield b'{"step": %d, "metrics": {"a": 1.0}},' % s
        yield b'{"step": 99999, "metrics": {"a": 1.0}}]}'

    response = sqlite_api.post(
        f"/api/v1/runs/{run_id}/metrics", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(response, 413, "payload_too_large")


# --- batches -------------------------------------------------------------------------------------


def _post_batch(api, run_id, body, headers=OCTET):
    return api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=headers)


def test_batch_that_is_not_safetensors_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    for body in (b"", b"hello", b"\xff" * 64, (10**9).to_bytes(8, "little") + b"{}"):
        error = assert_error(_post_batch(sqlite_api, run_id, body), 422, "invalid_input")
        assert "safetensors" in error["message"]


def test_pickle_is_refused_not_loaded(sqlite_api, tmp_path):
    run_id = sqlite_api.create_run()
    path = tmp_path / "x.pt"
    torch.save(make_tensors(), path)
    assert_error(_post_batch(sqlite_api, run_id, path.read_bytes()), 422, "invalid_input")


def test_batch_missing_a_required_tensor_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    tensors = make_tensors()
    del tensors["advantages"]
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=tensors)), 422, "invalid_input")
    assert "advantages" in error["message"]


def test_batch_with_an_unknown_tensor_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    tensors = {**make_tensors(), "values": torch.zeros(4, 16)}
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=tensors)), 422)
    assert "values" in error["message"]


def test_batch_with_mismatched_shapes_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    tensors = make_tensors()
    tensors["old_log_prob"] = tensors["old_log_prob"][:, :10]
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=tensors)), 422, "invalid_input")
    assert "old_log_prob" in error["message"] and "shape" in error["message"]


def test_batch_with_a_non_binary_mask_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    tensors = make_tensors()
    tensors["response_mask"][0, 0] = 0.5
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=tensors)), 422, "invalid_input")
    assert "response_mask" in error["message"] and "0 and 1" in error["message"]


def test_batch_with_wrong_dtypes_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    tensors = make_tensors()
    tensors["log_prob"] = tensors["log_prob"].to(torch.int32)
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=tensors)), 422)
    assert "log_prob" in error["message"] and "floating" in error["message"]
    grpo = make_tensors(grpo=True)
    grpo["group_index"] = grpo["group_index"].to(torch.int32)
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=grpo)), 422)
    assert "group_index" in error["message"] and "int64" in error["message"]


def test_batch_with_one_dimensional_tensors_is_422(sqlite_api):
    run_id = sqlite_api.create_run()
    tensors = {k: v[0] for k, v in make_tensors().items()}
    assert_error(_post_batch(sqlite_api, run_id, make_batch(tensors=tensors)), 422, "invalid_input")


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        ({"step": None}, "step"),
        ({"step": "abc"}, "step"),
        ({"step": "-3"}, "step"),
        ({"config": "{not json"}, "config"),
        ({"config": "[1, 2]"}, "config"),
        ({"config": '{"clip_ratio": 7}'}, "clip_ratio"),
        ({"config": '{"loss_agg_mode": "mean-of-everything"}'}, "loss_agg_mode"),
        ({"reported": '{"pg_loss": "high"}'}, "pg_loss"),
        ({"reported": "3"}, "reported"),
        ({"rank": "first"}, "rank"),
    ],
)
def test_batch_with_bad_metadata_is_422(sqlite_api, metadata, needle):
    run_id = sqlite_api.create_run()
    error = assert_error(_post_batch(sqlite_api, run_id, make_batch(metadata=metadata)), 422, "invalid_input")
    assert needle in error["message"], error


def test_batch_over_the_size_limit_is_413(sqlite_api):
    run_id = sqlite_api.create_run()
    body = make_batch(batch=64, length=512)  # ~0.5 MB > 256 KiB
    assert_error(_post_batch(sqlite_api, run_id, body), 413, "payload_too_large")


def test_batch_sent_as_json_is_415(sqlite_api):
    run_id = sqlite_api.create_run()
    response = _post_batch(sqlite_api, run_id, b"{}", headers={"content-type": "application/json"})
    assert_error(response, 415, "unsupported_media_type")


def test_full_audit_queue_is_429_with_retry_after(app_client, sqlite_url):
    api = app_client(sqlite_url, audit_workers=0, audit_queue_size=2)
    run_id = api.create_run()
    for step in range(2):
        assert _post_batch(api, run_id, make_batch(step)).status_code == 202
    response = _post_batch(api, run_id, make_batch(2))
    error = assert_error(response, 429, "busy")
    assert int(response.headers["retry-after"]) >= 1
    assert error["detail"] == {"waiting": 2, "limit": 2}


def test_writes_without_a_key_are_401_once_keys_exist(app_client, sqlite_url):
    from rlvitals.service.auth import create_key

    api = app_client(sqlite_url)
    create_key(api.services.db, name="ci")
    api.services.auth.invalidate()
    assert_error(api.post("/api/v1/runs", json={"name": "x"}), 401, "unauthorized")
    assert_error(api.post("/api/v1/runs", json={"name": "x"}, headers={"authorization": "Bearer nope"}), 401)
    assert_error(api.post("/api/v1/runs", json={"name": "x"}, headers={"authorization": "Basic abc"}), 401)


# --- values the database cannot hold, and the database going away (both databases) --------------


def test_out_of_range_ids_are_422_not_500(api):
    assert_error(api.get(f"/api/v1/runs/{2**70}"), 422, "validation_error")
    assert_error(api.get(f"/api/v1/audits/{2**64}"), 422, "validation_error")
    assert_error(api.get("/api/v1/runs", params={"offset": 2**64}), 422, "validation_error")
    run_id = api.create_run()
    assert_error(api.log(run_id, [{"step": 2**63, "metrics": {"a": 1}}]), 422, "validation_error")


def test_nul_characters_are_422_not_500(api):
    assert_error(api.post("/api/v1/runs", json={"name": "a\x00b"}), 422, "validation_error")
    run_id = api.create_run()
    assert_error(api.log(run_id, [{"step": 0, "metrics": {"a\x00": 1}}]), 422, "validation_error")
    listing = api.get("/api/v1/runs", params={"project": "x\x00y"})
    assert listing.status_code in (200, 422)
    if listing.status_code == 422:
        assert_error(listing, 422, "invalid_input")
    series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"names": "a\x00"})
    assert series.status_code in (200, 422)


def test_database_unreachable_is_503_with_retry_after_then_recovers(app_client, pg_url):
    from tests.conftest import _pg_connect

    api = app_client(pg_url)
    run_id = api.create_run()
    dbname = pg_url.rsplit("/", 1)[1]
    with _pg_connect() as admin:
        admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
    try:
        response = api.log(run_id, [{"step": 0, "metrics": {"a": 1.0}}])
        error = assert_error(response, 503, "unavailable")
        assert response.headers["retry-after"] == "1" and "retry" in error["message"]
        assert_error(api.get("/healthz"), 503, "unavailable")
    finally:
        with _pg_connect() as admin:
            admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')
    assert api.log(run_id, [{"step": 0, "metrics": {"a": 1.0}}]).status_code == 200
