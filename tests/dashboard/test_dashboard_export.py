"""The run page's download links: the browser saves the API's CSV/Parquet export, with the saved API
key when there is one (a plain link cannot send the Authorization header)."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow.parquet as pq


def _run(api) -> int:
    run_id = api.create_run("export-page", project="dash")
    api.log(
        run_id, [{"step": s, "metrics": {"actor/ppo_kl": 0.01 * s, "actor/entropy": 1.0}} for s in range(30)]
    )
    return run_id


def _download(tab, link: str):
    with tab.page.expect_download(timeout=15_000) as info:
        tab.page.click(link)
    download = info.value
    return download.suggested_filename, Path(download.path()).read_bytes()


def test_the_run_page_downloads_csv_and_parquet(api, tab):
    run_id = _run(api)
    tab.open(f"/runs/{run_id}", ready="window.RLV && RLV.timing.allCharts")
    name, body = _download(tab, "#export-csv")
    assert name == f"dash-export-page-{run_id}.csv"
    lines = body.decode().splitlines()
    assert lines[0] == "step,actor/entropy,actor/ppo_kl" and len(lines) == 31
    name, body = _download(tab, "#export-parquet")
    assert name.endswith(".parquet")
    assert pq.read_table(io.BytesIO(body)).num_rows == 30
    tab.assert_clean()


def test_with_a_saved_key_the_download_sends_it(api, tab):
    run_id = _run(api)
    sent = []
    tab.page.on(
        "request", lambda r: sent.append(r.headers.get("authorization")) if "/export" in r.url else None
    )
    tab.page.add_init_script("window.localStorage.setItem('rlvitals.apiKey', 'rlv_export_key')")
    tab.open(f"/runs/{run_id}", ready="window.RLV && RLV.timing.allCharts")
    name, body = _download(tab, "#export-csv")
    assert name == f"dash-export-page-{run_id}.csv" and body.startswith(b"step,")
    assert sent == ["Bearer rlv_export_key"]
    tab.assert_clean()
