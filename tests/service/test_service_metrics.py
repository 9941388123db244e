"""Metric ingest and queries: non-finite values stored, idempotent resends, spike-preserving
downsampling; on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math

from rlvitals.service.metrics import downsample


def _series(api, run_id, **params):
    response = api.get(f"/api/v1/runs/{run_id}/metrics", params=params)
    assert response.status_code == 200, response.text
    return response.json()["series"]


def test_ingest_stores_numbers_null_and_non_finite_spellings(api):
    run_id = api.create_run()
    steps = [
        {"step": 0, "metrics": {"a": 1, "b": 0.5, "c": None}, "wall_time": 1.5},
        {"step": 1, "metrics": {"a": "NaN", "b": "Infinity", "c": "-Infinity"}},
    ]
    response = api.log(run_id, steps)
    assert response.status_code == 200
    assert response.json() == {"accepted": 6, "steps": 2}
    series = _series(api, run_id, max_points=0)
    assert series["a"] == {"step": [0, 1], "value": [1.0, "NaN"]}
    assert series["b"] == {"step": [0, 1], "value": [0.5, "Infinity"]}
    assert series["c"] == {"step": [0, 1], "value": [None, "-Infinity"]}


def test_resending_points_never_duplicates_them(api):
    run_id = api.create_run()
    steps = [{"step": s, "metrics": {"loss": float(s), "kl": 0.1}} for s in range(50)]
    assert api.log(run_id, steps).status_code == 200
    assert api.log(run_id, steps).status_code == 200
    assert api.log(run_id, steps[10:20]).status_code == 200
    series = _series(api, run_id, max_points=0)
    assert series["loss"]["step"] == list(range(50))
    assert series["loss"]["value"] == [float(s) for s in range(50)]
    assert len(series["kl"]["step"]) == 50


def test_names_select_series_and_unknown_names_are_empty(api):
    run_id = api.create_run()
    api.log(run_id, [{"step": 0, "metrics": {"a": 1.0, "b": 2.0, "c": 3.0}}])
    series = _series(api, run_id, names="a, c,missing")
    assert set(series) == {"a", "c", "missing"}
    assert series["missing"] == {"step": [], "value": []}


def test_downsampling_keeps_spikes_and_respects_max_points(api):
    run_id = api.create_run()
    n = 5000
    values = [math.sin(i / 50.0) for i in range(n)]
    values[1234] = 100.0  # a one-step spike
    values[4321] = -55.0
    for start in range(0, n, 1000):
        chunk = [{"step": s, "metrics": {"loss": values[s]}} for s in range(start, start + 1000)]
        assert api.log(run_id, chunk).status_code == 200
    series = _series(api, run_id, max_points=200)["loss"]
    assert 100 <= len(series["step"]) <= 200
    assert series["step"] == sorted(series["step"])
    assert 1234 in series["step"] and 4321 in series["step"]
    assert max(series["value"]) == 100.0 and min(series["value"]) == -55.0
    everything = _series(api, run_id, max_points=0)["loss"]
    assert everything["step"] == list(range(n))


def test_downsampling_keeps_non_finite_values():
    points = [(i, float(i % 7), 0) for i in range(1000)]
    points[500] = (500, None, 1)  # NaN
    points[800] = (800, math.inf, 0)
    kept = downsample(points, 50)
    assert len(kept) <= 50
    steps = [p[0] for p in kept]
    assert 500 in steps and 800 in steps


def test_downsampling_short_series_is_untouched(api):
    run_id = api.create_run()
    api.log(run_id, [{"step": s, "metrics": {"x": s}} for s in range(10)])
    assert _series(api, run_id, max_points=2000)["x"]["step"] == list(range(10))


def test_last_step_only_grows(api):
    run_id = api.create_run()
    api.log(run_id, [{"step": 10, "metrics": {"x": 1}}])
    api.log(run_id, [{"step": 3, "metrics": {"x": 1}}])
    assert api.get(f"/api/v1/runs/{run_id}").json()["last_step"] == 10


def test_metrics_of_unknown_run_are_404(api):
    assert api.log(9999, [{"step": 0, "metrics": {"x": 1}}]).status_code == 404
    assert api.get("/api/v1/runs/9999/metrics").status_code == 404


def test_history_etag_is_304_until_the_run_changes(api):
    run_id = api.create_run()
    api.log(run_id, [{"step": s, "metrics": {"x": float(s)}} for s in range(5)])
    url = f"/api/v1/runs/{run_id}/metrics"
    first = api.get(url, params={"max_points": 0})
    etag = first.headers["etag"]
    again = api.get(url, params={"max_points": 0}, headers={"if-none-match": etag})
    assert again.status_code == 304 and again.content == b""
    other_query = api.get(url, params={"max_points": 3}, headers={"if-none-match": etag})
    assert other_query.status_code == 200  # another query, another tag
    api.log(run_id, [{"step": 2, "metrics": {"late": 1.0}}])  # even a late point changes the data
    changed = api.get(url, params={"max_points": 0}, headers={"if-none-match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert changed.json()["series"]["late"] == {"step": [2], "value": [1.0]}


def test_cached_history_is_never_stale(api):
    run_id = api.create_run()
    url = f"/api/v1/runs/{run_id}/metrics"
    for step in range(20):
        api.log(run_id, [{"step": step, "metrics": {"x": float(step)}}])
        series = api.get(url, params={"names": "x", "max_points": 0}).json()["series"]["x"]
        assert series["step"] == list(range(step + 1))
    assert api.services.series_cache.misses >= 20
    api.get(url, params={"names": "x", "max_points": 0})
    assert api.services.series_cache.hits >= 1


def test_the_sqlite_wal_is_checkpointed_in_the_background(app_client, sqlite_url):
    import os
    import time

    api = app_client(sqlite_url, health_flush_interval=0.1)
    run_id = api.create_run()
    wal = sqlite_url.removeprefix("sqlite:///") + "-wal"
    sizes = []
    for start in range(0, 4000, 400):  # writers never checkpoint (wal_autocheckpoint=0) ...
        steps = [{"step": s, "metrics": {f"m{i}": 0.5 for i in range(12)}} for s in range(start, start + 400)]
        assert api.log(run_id, steps).status_code == 200
        sizes.append(os.path.getsize(wal))
        time.sleep(0.4)  # ... the housekeeper does, so the WAL is reused instead of growing
    assert sizes[-1] < 4 * sizes[0], sizes


def test_history_round_trips_extreme_and_non_finite_values_whole_and_downsampled(api):
    # The history read spells non-finite values in SQL (SQLite) or per row (PostgreSQL) and encodes
    # with orjson: every float must come back bit-exact and every spelling must survive downsampling.
    run_id = api.create_run()
    specials = [
        5e-324,
        1e300,
        -1.7976931348623157e308,
        0.1 + 0.2,
        1e-5,
        "NaN",
        "Infinity",
        "-Infinity",
        None,
    ]
    values = [specials[s % len(specials)] if s % 3 == 0 else s * 0.001 for s in range(600)]
    assert (
        api.log(run_id, [{"step": s, "metrics": {"x": v}} for s, v in enumerate(values)]).status_code == 200
    )
    whole = _series(api, run_id, max_points=0)["x"]
    assert whole["step"] == list(range(600))
    assert [repr(v) for v in whole["value"]] == [repr(float(v) if isinstance(v, int) else v) for v in values]
    reference = [
        (s, None if v is None else (math.nan if v == "NaN" else float(v)), 1 if v == "NaN" else 0)
        for s, v in enumerate(values)
    ]
    kept = downsample([(s, None if v != v else v, f) for s, v, f in reference], 40)
    spelled = [
        ("NaN" if f else None)
        if v is None
        else ("Infinity" if v == math.inf else "-Infinity" if v == -math.inf else v)
        for _, v, f in kept
    ]
    assert _series(api, run_id, max_points=40)["x"] == {"step": [s for s, _, _ in kept], "value": spelled}


def test_a_lone_nan_survives_downsampling_as_nan_not_null(api):
    # Only finite values and one NaN: no null or infinity forces the careful encoding path, and a
    # NaN compares false with everything, so it must be found explicitly (orjson writes NaN as null).
    run_id = api.create_run()
    steps = [{"step": s, "metrics": {"x": "NaN" if s == 500 else math.sin(s / 10)}} for s in range(1000)]
    assert api.log(run_id, steps).status_code == 200
    for _ in range(2):  # the first read comes from the table, the second from the in-memory columns
        series = _series(api, run_id, max_points=100)["x"]
        assert "NaN" in series["value"] and None not in series["value"]
        assert series["value"][series["step"].index(500)] == "NaN"


def test_ingest_authenticates_stores_and_answers_every_spelling_alike(app_client, sqlite_url):
    # content-type parameters, padded and odd ids, bare NaN tokens, bad bodies, keys
    from rlvitals.service.auth import create_key

    api = app_client(sqlite_url)
    run_id = api.create_run()
    body = b'{"steps": [{"step": 1, "metrics": {"a": 1, "b": "NaN"}}]}'
    for content_type in ("application/json", "application/json; charset=utf-8"):
        response = api.post(
            f"/api/v1/runs/{run_id}/metrics", content=body, headers={"content-type": content_type}
        )
        assert response.status_code == 200, response.text
        assert response.json() == {"accepted": 2, "steps": 1}
        assert response.headers["content-type"] == "application/json"
    padded = api.post(
        f"/api/v1/runs/00{run_id}/metrics", content=body, headers={"content-type": "application/json"}
    )
    assert padded.status_code == 200, padded.text
    for bad_id in ("-1", str(2**63), "x1", "١"):
        response = api.post(
            f"/api/v1/runs/{bad_id}/metrics", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code in (404, 422), (bad_id, response.text)
        assert "error" in response.json()
    # a bare NaN token: not strict JSON, accepted as before
    tokens = b'{"steps": [{"step": 2, "metrics": {"a": NaN, "b": 1e5}}]}'
    response = api.post(
        f"/api/v1/runs/{run_id}/metrics", content=tokens, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    missing = api.post(
        "/api/v1/runs/987654/metrics", content=body, headers={"content-type": "application/json"}
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert _series(api, run_id, max_points=0)["b"] == {"step": [1, 2], "value": ["NaN", 100000.0]}
    assert _series(api, run_id, max_points=0)["a"] == {"step": [1, 2], "value": [1.0, "NaN"]}

    _, key = create_key(api.services.db, name="ci")
    api.services.auth.invalidate()
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic abc"}):
        headers = {"content-type": "application/json", **headers}
        response = api.post(f"/api/v1/runs/{run_id}/metrics", content=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    assert api.post(f"/api/v1/runs/{run_id}/metrics", content=body, headers=headers).status_code == 200
    bad = api.post(f"/api/v1/runs/{run_id}/metrics", content=b'{"steps": [{"step": 1.5}]}', headers=headers)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"
    assert api.post(f"/api/v1/runs/{run_id}/metrics", content=b"", headers=headers).status_code == 422


def test_history_columns_in_memory_always_match_the_database(app_client, database_url):
    # Two server apps on one database, both keeping history columns in memory, and a third reading
    # the points table every time. Whatever order the writes come in (new steps, resends with other
    # values, steps out of order, another writer, non-finite and signed-zero values), all three answer
    # the same.
    first, second = app_client(database_url), app_client(database_url)
    plain = app_client(database_url, series_memory_points=0, query_cache_bytes=0)
    assert first.services.columns is not None and plain.services.columns is None
    run_id = first.create_run()

    def answers(**params):
        out = [_series(api, run_id, max_points=0, **params) for api in (first, second, plain)]
        assert out[0] == out[1] == out[2]
        assert [[repr(v) for v in s["value"]] for s in out[0].values()] == [
            [repr(v) for v in s["value"]] for s in out[2].values()
        ]
        return out[0]

    def log(api, steps):
        assert api.log(run_id, [{"step": s, "metrics": m} for s, m in steps]).status_code == 200

    log(first, [(s, {"a": s * 0.5, "b": "NaN" if s == 3 else -0.0}) for s in range(10)])
    answers(names="a,b")
    log(first, [(s, {"a": s * 0.25}) for s in range(10, 15)])  # extends first's columns
    log(first, [(12, {"a": 99.0}), (15, {"a": "Infinity", "b": None})])  # resend keeps 12's old value
    answers(names="a,b")
    log(second, [(16, {"a": 1.0})])  # the other writer: first must re-read
    log(first, [(17, {"a": 2.0, "c": "-Infinity"})])
    log(first, [(5, {"c": 3.0}), (18, {"c": 4.0})])  # c out of order
    log(first, [(20, {"a": 5.0}), (19, {"a": 6.0})])  # out of order within one request
    got = answers(names="a,b,c")
    assert got["a"]["step"] == [*range(18), 19, 20] and got["a"]["value"][12] == 3.0
    assert got["c"] == {"step": [5, 17, 18], "value": [3.0, "-Infinity", 4.0]}
    assert answers(names="a,b,c,d")["d"] == {"step": [], "value": []}
    log(second, [(21, {"d": 7.0})])
    log(first, [(22, {"d": 8.0})])
    assert answers(names="d")["d"] == {"step": [21, 22], "value": [7.0, 8.0]}
    whole = answers()
    assert sorted(whole) == ["a", "b", "c", "d"]
    ranged = answers(names="a,c", start=5, end=17)  # a step range, from memory and from the table
    assert ranged["a"]["step"] == list(range(5, 18)) and ranged["c"]["step"] == [5, 17]
    assert first.services.columns.hits > 0


def test_a_step_range_is_cut_before_downsampling(api):
    run_id = api.create_run()
    steps = [{"step": s, "metrics": {"a": 10.0 if s == 500 else 0.001 * s, "b": 1.0}} for s in range(1000)]
    assert api.log(run_id, steps).status_code == 200
    every = _series(api, run_id, names="a", start=400, end=599, max_points=0)["a"]
    assert every["step"] == list(range(400, 600))
    small = _series(api, run_id, names="a,b", start=400, end=599, max_points=20)
    assert len(small["a"]["step"]) <= 20 and 10.0 in small["a"]["value"]  # the spike survives
    assert all(400 <= s <= 599 for s in small["a"]["step"] + small["b"]["step"])
    assert _series(api, run_id, names="a", start=990, max_points=0)["a"]["step"] == list(range(990, 1000))
    assert _series(api, run_id, names="a", end=2, max_points=0)["a"] == {
        "step": [0, 1, 2],
        "value": [0.0, 0.001, 0.002],
    }
    assert _series(api, run_id, names="a", start=5000)["a"] == {"step": [], "value": []}
    assert _series(api, run_id, names="a", start=7, end=7)["a"]["step"] == [7]

    bad = api.get(f"/api/v1/runs/{run_id}/metrics", params={"start": 10, "end": 9})
    assert (
        bad.status_code == 400 and "end (9) must not be before start (10)" in bad.json()["error"]["message"]
    )
    negative = api.get(f"/api/v1/runs/{run_id}/metrics", params={"start": -1})
    assert negative.status_code == 422 and negative.json()["error"]["code"] == "validation_error"

    # the ETag names the range: another range is another answer, the same range is 304
    url = f"/api/v1/runs/{run_id}/metrics"
    first = api.get(url, params={"names": "a", "start": 0, "end": 9})
    other = api.get(url, params={"names": "a", "start": 0, "end": 10})
    assert first.headers["etag"] != other.headers["etag"]
    again = api.get(
        url, params={"names": "a", "start": 0, "end": 9}, headers={"if-none-match": first.headers["etag"]}
    )
    assert again.status_code == 304


def test_history_columns_stay_within_their_point_budget():
    from rlvitals.service.columns import SeriesColumns

    columns = SeriesColumns(max_points=100)
    columns.put(1, 5, {"a": (list(range(20)), [0.0] * 20)})
    columns.put(2, 7, {"a": (list(range(30)), [1.0] * 30)})  # too big for a quarter: not kept
    assert columns.get(2, 7, ["a"]) == {}
    held = columns.get(1, 5, ["a", "b"])
    assert held == {"a": (list(range(20)), [0.0] * 20)}
    held["a"][0].append(99)  # a copy: the store is untouched
    assert columns.get(1, 6, ["a"]) == {}  # another version: nothing
    columns.extend(1, 6, [("a", 20, 2.0), ("a", 20, 3.0), ("b", 1, 1.0)])
    assert columns.get(1, 6, ["a", "b"]) == {"a": ([*range(21)], [0.0] * 20 + [2.0])}
    columns.extend(1, 8, [("a", 21, 2.0)])  # a write it did not see: the run is dropped
    assert columns.get(1, 8, ["a"]) == {} and columns.get(1, 6, ["a"]) == {}
    for run in range(10, 20):
        columns.put(run, 1, {"x": (list(range(25)), [0.5] * 25)})
    assert columns._points <= 100
    assert columns.get(19, 1, ["x"]) and not columns.get(10, 1, ["x"])  # least recently used went first


def test_history_columns_give_back_every_spelling_they_were_given():
    import math

    from rlvitals.service.columns import SeriesColumns

    columns = SeriesColumns(max_points=100)
    values = [1.5, None, "NaN", "Infinity", -0.0, 2.5, "-Infinity"]
    columns.put(1, 5, {"a": (list(range(7)), list(values))})
    columns.extend(1, 6, [("a", 7, "NaN"), ("a", 8, -0.0), ("a", 9, 3.25)])
    steps, got = columns.get(1, 6, ["a"])["a"]
    assert steps == list(range(10))
    assert got == [*values, "NaN", -0.0, 3.25]
    assert math.copysign(1.0, got[4]) == -1.0 and math.copysign(1.0, got[8]) == -1.0
    assert [type(v) for v in got] == [type(v) for v in [*values, "NaN", -0.0, 3.25]]


def test_a_history_answer_is_one_json_object_with_each_name_once(app_client, sqlite_url):
    api = app_client(sqlite_url)
    run_id = api.create_run()
    api.log(run_id, [{"step": s, "metrics": {"a": s / 2, "b": "NaN" if s == 3 else 1.0}} for s in range(6)])
    raw = api.get(f"/api/v1/runs/{run_id}/metrics", params={"names": "b,a,b", "max_points": 0}).content
    assert raw.count(b'"b":') == 1 and raw.index(b'"b":') < raw.index(b'"a":')
    assert json.loads(raw) == {
        "series": {
            "b": {"step": list(range(6)), "value": [1.0, 1.0, 1.0, "NaN", 1.0, 1.0]},
            "a": {"step": list(range(6)), "value": [s / 2 for s in range(6)]},
        }
    }
