"""CSV and Parquet export of a run's series, on SQLite and PostgreSQL: every point, one column per
metric named as in the API's series, non-finite values kept, read back by the stdlib csv module and
by pyarrow (the Parquet reader people use)."""

from __future__ import annotations

import csv
import io
import math

import pyarrow.parquet as pq

STEPS = [
    {"step": 0, "metrics": {"actor/ppo_kl": 0.1, "actor/pg_clipfrac": 0.25, 'weird, "name"': 1.0}},
    {"step": 1, "metrics": {"actor/ppo_kl": "NaN", "actor/pg_clipfrac": None}},
    {"step": 2, "metrics": {"actor/ppo_kl": "Infinity", "actor/pg_clipfrac": "-Infinity"}},
    {"step": 5, "metrics": {"actor/ppo_kl": 1e-300, "actor/pg_clipfrac": 0.1 + 0.2}},
]


def _run(api) -> int:
    run_id = api.create_run("export me/π", project="demo")
    assert api.log(run_id, STEPS).status_code == 200
    return run_id


def _api_series(api, run_id) -> dict:
    return api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]


def test_csv_has_a_step_column_and_one_column_per_api_series(api):
    run_id = _run(api)
    resp = api.get(f"/api/v1/runs/{run_id}/export", params={"format": "csv"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/csv")
    assert resp.headers["content-disposition"] == f'attachment; filename="demo-export_me-{run_id}.csv"'
    rows = list(csv.reader(io.StringIO(resp.text)))
    assert rows[0][0] == "step" and sorted(rows[0][1:]) == sorted(_api_series(api, run_id))
    table = {name: [row[i] for row in rows[1:]] for i, name in enumerate(rows[0])}
    assert table["step"] == ["0", "1", "2", "5"]
    assert table["actor/ppo_kl"] == ["0.1", "NaN", "Infinity", "1e-300"]
    assert table["actor/pg_clipfrac"] == ["0.25", "", "-Infinity", repr(0.1 + 0.2)]  # null: empty
    assert table['weird, "name"'] == ["1.0", "", "", ""]  # no point at those steps: empty
    assert float(table["actor/pg_clipfrac"][3]) == 0.1 + 0.2  # exact round trip


def test_parquet_reads_back_with_the_same_columns_and_ieee_values(api):
    run_id = _run(api)
    resp = api.get(f"/api/v1/runs/{run_id}/export", params={"format": "parquet"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-disposition"].endswith(f'-{run_id}.parquet"')
    table = pq.read_table(io.BytesIO(resp.content)).to_pydict()
    assert list(table) == ["step", *_api_series(api, run_id)]
    assert table["step"] == [0, 1, 2, 5]
    kl = table["actor/ppo_kl"]
    assert kl[0] == 0.1 and math.isnan(kl[1]) and kl[2] == math.inf and kl[3] == 1e-300
    assert table["actor/pg_clipfrac"][:3] == [0.25, None, -math.inf]
    assert table['weird, "name"'] == [1.0, None, None, None]


def test_names_and_step_range_cut_the_export(api):
    run_id = _run(api)
    resp = api.get(f"/api/v1/runs/{run_id}/export", params={"names": "actor/ppo_kl", "start": 1, "end": 2})
    assert resp.text.splitlines() == ["step,actor/ppo_kl", "1,NaN", "2,Infinity"]


def test_bad_requests_get_the_one_error_shape(api):
    run_id = _run(api)
    for params, status in (
        ({"format": "xlsx"}, 422),
        ({"start": 5, "end": 1}, 400),
        ({"names": " , "}, 400),
    ):
        resp = api.get(f"/api/v1/runs/{run_id}/export", params=params)
        assert resp.status_code == status, (params, resp.text)
        assert set(resp.json()["error"]) >= {"code", "message"}
    missing = api.get("/api/v1/runs/999999/export")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_an_empty_run_exports_a_header(api):
    run_id = api.create_run("empty")
    assert api.get(f"/api/v1/runs/{run_id}/export").text == "step\n"
    table = pq.read_table(io.BytesIO(api.get(f"/api/v1/runs/{run_id}/export?format=parquet").content))
    assert table.column_names == ["step"] and table.num_rows == 0


def test_csv_escapes_formula_names_but_keeps_negative_numbers_numbers(api):
    """OWASP's CSV-injection rule: a text cell starting with = + - @ tab or CR gets a leading quote;
    values (numbers, and the API's non-finite spellings) are left as they are."""
    names = ["=1+1", "@SUM(A1)", "+cmd", "-x", "\tTAB", "\rCR", "plain-name"]
    run_id = api.create_run("formulas")
    steps = [{"step": 0, "metrics": {name: -1.5 for name in names}}]
    steps.append({"step": 1, "metrics": {"=1+1": "-Infinity", "-x": -0.25}})
    assert api.log(run_id, steps).status_code == 200
    resp = api.get(f"/api/v1/runs/{run_id}/export", params={"format": "csv"})
    rows = list(csv.reader(io.StringIO(resp.text, newline="")))
    header = rows[0][1:]
    assert sorted(header) == sorted(["'" + n for n in names[:-1]] + ["plain-name"])
    table = {name: [row[i] for row in rows[1:]] for i, name in enumerate(rows[0])}
    assert table["'=1+1"] == ["-1.5", "-Infinity"] and table["'-x"] == ["-1.5", "-0.25"]
    assert float(table["plain-name"][0]) == -1.5
