"""The binary history answer (``format=binary``) read by ``rlvitals.client.history``, the orjson body
parser of the metrics routes and its fallback, and the evaluator spacing setting; on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from rlvitals.client.history import MEDIA_TYPE, SeriesFormatError, decode_series, read_series


def _json_series(api, run_id, **params):
    response = api.get(f"/api/v1/runs/{run_id}/metrics", params=params)
    assert response.status_code == 200, response.text
    return response.json()["series"]


def _binary(api, run_id, **params):
    response = api.get(f"/api/v1/runs/{run_id}/metrics", params={**params, "format": "binary"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == MEDIA_TYPE
    return response, decode_series(response.content)


def _spelled(value: float | None, null: bool):
    if null:
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def test_binary_answer_holds_what_the_json_answer_holds(api):
    run_id = api.create_run()
    steps = [
        {"step": 0, "metrics": {"a": 1, "b": 0.5, "c": None}, "wall_time": 1.5},
        {"step": 1, "metrics": {"a": "NaN", "b": "Infinity", "c": "-Infinity"}},
        {"step": 7, "metrics": {"a": -0.25, "b": 1e300, "c": 3.0}, "wall_time": 9.0},
    ]
    assert api.log(run_id, steps).status_code == 200
    for params in ({}, {"wall_time": "true"}, {"names": "c,a,missing"}, {"start": 1, "end": 7}):
        expected = _json_series(api, run_id, max_points=0, **params)
        _, got = _binary(api, run_id, max_points=0, **params)
        assert list(got) == list(expected)
        for name, series in got.items():
            want = expected[name]
            assert list(series.step) == want["step"]
            nulls = series.null or bytes(len(series))
            assert [_spelled(v, bool(n)) for v, n in zip(series.value, nulls, strict=True)] == want["value"]
            if "wall_time" in want:
                assert [None if math.isnan(w) else w for w in series.wall_time] == want["wall_time"]
            else:
                assert series.wall_time is None
    # null values are marked (NaN alone is not null)
    _, got = _binary(api, run_id, max_points=0)
    assert got["c"].null == bytes([1, 0, 0])
    assert got["a"].null is None and math.isnan(got["a"].value[1])
    assert got["c"].points() == [(0, None), (1, -math.inf), (7, 3.0)]


def test_binary_columns_are_aligned_and_downsampled_like_json(api):
    run_id = api.create_run()
    n = 3000
    values = [math.sin(i / 40.0) for i in range(n)]
    values[1717] = 50.0
    api.log(run_id, [{"step": s, "metrics": {"loss": values[s], "kl": 0.1}} for s in range(n)])
    response, got = _binary(api, run_id, max_points=200)
    expected = _json_series(api, run_id, max_points=200)
    assert list(got["loss"].step) == expected["loss"]["step"]
    assert list(got["loss"].value) == expected["loss"]["value"]
    assert 50.0 in got["loss"].value
    # every column starts at a multiple of 8 bytes (numpy.frombuffer takes it without a copy)
    body = response.content
    size = int.from_bytes(body[4:8], "little")
    start = 8 + size + (-(8 + size) % 8)
    assert start % 8 == 0 and body[8 + size : start] == b"\0" * (start - 8 - size)


def test_binary_answer_has_its_own_etag_and_revalidates(api):
    run_id = api.create_run()
    api.log(run_id, [{"step": 0, "metrics": {"a": 1.0}}])
    as_json = api.get(f"/api/v1/runs/{run_id}/metrics")
    as_binary = api.get(f"/api/v1/runs/{run_id}/metrics", params={"format": "binary"})
    assert as_json.headers["etag"] != as_binary.headers["etag"]
    again = api.get(
        f"/api/v1/runs/{run_id}/metrics",
        params={"format": "binary"},
        headers={"If-None-Match": as_binary.headers["etag"]},
    )
    assert again.status_code == 304
    api.log(run_id, [{"step": 1, "metrics": {"a": 2.0}}])
    _, got = _binary(api, run_id, max_points=0)
    assert list(got["a"].value) == [1.0, 2.0]


def test_unknown_format_is_a_422(api):
    run_id = api.create_run()
    response = api.get(f"/api/v1/runs/{run_id}/metrics", params={"format": "csv"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


def test_read_series_over_http(api):
    run_id = api.create_run()
    api.log(run_id, [{"step": s, "metrics": {"x": s / 2, "y": None if s == 3 else 1.0}} for s in range(10)])

    def handler(request: httpx.Request) -> httpx.Response:  # the app itself, through its test client
        answer = api.get(request.url.raw_path.decode())
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    got = read_series("http://test", run_id, ["x", "y"], transport=httpx.MockTransport(handler))
    assert list(got["x"].value) == [s / 2 for s in range(10)]
    assert got["y"].null == bytes(1 if s == 3 else 0 for s in range(10))
    with pytest.raises(httpx.HTTPStatusError):
        read_series("http://test", 10**9, transport=httpx.MockTransport(handler))


def test_decode_refuses_what_is_not_a_binary_answer():
    with pytest.raises(SeriesFormatError):
        decode_series(b'{"series": {}}')
    head = json.dumps({"version": 1, "series": [{"name": "a", "points": 4}]}).encode()
    body = b"RLVS" + len(head).to_bytes(4, "little") + head
    with pytest.raises(SeriesFormatError):
        decode_series(body + b"\0" * 8)  # the columns are cut short


def test_metrics_body_bare_nan_tokens_and_big_ints_still_parse(api):
    """orjson refuses these; the standard library's parse (the fallback) takes them as before."""
    run_id = api.create_run()
    body = '{"steps": [{"step": 0, "metrics": {"a": NaN, "b": Infinity, "c": -Infinity}}]}'
    response = api.post(
        f"/api/v1/runs/{run_id}/metrics", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text
    series = _json_series(api, run_id, max_points=0)
    assert series["a"]["value"] == ["NaN"] and series["b"]["value"] == ["Infinity"]
    big = '{"steps": [{"step": 123456789012345678901234567890, "metrics": {"a": 1.0}}]}'
    response = api.post(
        f"/api/v1/runs/{run_id}/metrics", content=big, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422  # a step past 64 bits: refused by validation, not a 400/500
    broken = api.post(
        f"/api/v1/runs/{run_id}/metrics", content=b'{"steps": [', headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 422
    assert broken.json()["error"]["code"] == "validation_error"


def test_health_spacing_is_a_setting(app_client, database_url):
    api = app_client(database_url, health_spacing=0.7)
    assert api.services.evaluator.spacing == 0.7


@pytest.mark.parametrize("memory_points", [0, 4_000_000])
def test_binary_answer_with_and_without_the_in_memory_columns(app_client, database_url, memory_points):
    api = app_client(database_url, series_memory_points=memory_points)
    run_id = api.create_run()
    steps = [{"step": s, "metrics": {"v": [1.5, None, "NaN", "-Infinity"][s % 4]}} for s in range(40)]
    api.log(run_id, steps[:20])
    _binary(api, run_id, max_points=0)  # the columns (when on) hold the run from here
    api.log(run_id, steps[20:])  # ...and are extended by this write
    for params in ({"max_points": 0}, {"max_points": 0, "start": 5, "end": 33}, {"max_points": 10}):
        expected = _json_series(api, run_id, **params)["v"]
        _, got = _binary(api, run_id, **params)
        series = got["v"]
        nulls = series.null or bytes(len(series))
        assert list(series.step) == expected["step"]
        assert [_spelled(v, bool(n)) for v, n in zip(series.value, nulls, strict=True)] == expected["value"]
