"""Latencies the tests only sanity-check: how soon a result is visible, on real servers over loopback.

Timed tests fail on a busy machine, not on slow code, so the tests keep a generous bound (10x or
more) and this script prints the figures. Each row is the median and the maximum of ``--repeat``
tries:

- ``audit``: a 64x4096 batch upload answered -> its audit ``done`` (``GET /api/v1/audits/{id}``),
  SQLite (and PostgreSQL with ``--pg-url``); the audit's own CPU is in bench/recompute.py;
- ``replica wake`` (``--pg-url`` only): the same, uploaded to a replica without audit workers and
  audited by another whose poll interval is 30 s: what is timed is the NOTIFY that wakes it;
- ``live point`` / ``live alert`` / ``live audit`` (needs Chromium, as the dashboard tests do): a
  point logged -> drawn on the open run page's chart; a non-finite entropy -> listed in its firing
  alerts; a batch uploaded -> its audit in the page's latest-audits list (all without a reload).

    .venv/bin/python bench/latency.py
    .venv/bin/python bench/latency.py --pg-url postgresql+psycopg://postgres@127.0.0.1:5432/test
    .venv/bin/python bench/latency.py --only audit --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.service.batchdata import OCTET, make_batch, make_tensors  # noqa: E402
from tests.support.servers import start_server  # noqa: E402

PARTS = ("audit", "replica", "live")


def _wait(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.01) -> float:
    """Seconds until ``predicate()`` holds (polled every ``interval``)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def _audit_visible(upload_url: str, read_url: str, run_id: int, step: int) -> float:
    from rlvitals.analyzers import LossConfig, recompute

    tensors = make_tensors(64, 4096, seed=step)
    body = make_batch(step, tensors=tensors, reported=recompute(LossConfig(), **tensors))
    started = time.monotonic()
    response = httpx.post(
        f"{upload_url}/api/v1/runs/{run_id}/batches", content=body, headers=OCTET, timeout=60
    )
    assert response.status_code == 202, response.text
    audit_id = response.json()["id"]
    _wait(
        lambda: httpx.get(f"{read_url}/api/v1/audits/{audit_id}").json()["status"] == "done",
        60,
        f"audit {audit_id}",
    )
    return time.monotonic() - started


def _warm(url: str, run_id: int) -> None:
    """torch is imported with a process's first batch (~1 s, once): paid before anything is timed."""
    response = httpx.post(f"{url}/api/v1/runs/{run_id}/batches", content=make_batch(0), headers=OCTET)
    audit_id = response.json()["id"]
    _wait(lambda: httpx.get(f"{url}/api/v1/audits/{audit_id}").json()["status"] != "pending", 60, "warm-up")


def audit_rows(database_url: str, workdir: Path, repeat: int) -> list[float]:
    server = start_server(database_url=database_url, workdir=workdir)
    try:
        run_id = httpx.post(f"{server.url}/api/v1/runs", json={"name": "latency-audit"}).json()["id"]
        _warm(server.url, run_id)
        return [_audit_visible(server.url, server.url, run_id, step) for step in range(1, repeat + 1)]
    finally:
        server.stop()


def replica_rows(pg_url: str, workdir: Path, repeat: int) -> list[float]:
    front = start_server(database_url=pg_url, workdir=workdir, env={"RLVITALS_AUDIT_WORKERS": "0"})
    back = start_server(
        database_url=pg_url, workdir=workdir,
        env={"RLVITALS_AUDIT_WORKERS": "1", "RLVITALS_AUDIT_POLL_INTERVAL": "30"},
    )  # fmt: skip
    try:
        run_id = httpx.post(f"{front.url}/api/v1/runs", json={"name": "latency-replica"}).json()["id"]
        _warm(front.url, run_id)
        out = []
        for step in range(1, repeat + 1):
            time.sleep(0.5)  # the back worker settles into its (long) idle wait
            out.append(_audit_visible(front.url, front.url, run_id, step))
        return out
    finally:
        front.stop()
        back.stop()


def live_rows(workdir: Path, repeat: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    from tests.dashboard.conftest import CHROMIUM, Api, Tab
    from tests.dashboard.dashdata import CONFIG, batch, reported

    server = start_server(database_url=f"sqlite:///{workdir / 'live.db'}", workdir=workdir)
    api = Api(server.url)
    out: dict[str, list[float]] = {"live point": [], "live alert": [], "live audit": []}
    try:
        warm = api.create_run("latency-live-warmup")
        tensors = batch(3)
        api.wait_audit(api.upload_batch(warm, tensors, step=0, config=CONFIG, reported=reported(tensors)))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            for attempt in range(repeat):
                context = browser.new_context(viewport={"width": 1400, "height": 900})
                tab = Tab(page=context.new_page(), base=server.url)
                run_id = api.create_run(f"latency-live-{attempt}")
                api.log_series(run_id, lambda s: {"actor/ppo_kl": 1e-3, "critic/score/mean": 0.5}, range(50))
                tab.open(f"/runs/{run_id}", ready="window.RLV && RLV.timing.allCharts")
                tab.wait("document.getElementById('live').textContent === 'live'")
                sent = time.monotonic()
                api.log(run_id, [{"step": 50, "metrics": {"actor/ppo_kl": 0.5, "critic/score/mean": 1.0}}])
                tab.wait(
                    "() => { const x = document.querySelector('.panel .plot').data[0].x; "
                    "return x[x.length - 1] === 50; }",
                    timeout=30, interval=0.01,
                )  # fmt: skip
                out["live point"].append(time.monotonic() - sent)
                sent = time.monotonic()
                api.log(run_id, [{"step": 51, "metrics": {"actor/entropy": "Infinity"}}])
                tab.wait(
                    "document.getElementById('alerts-list').textContent.includes('actor/entropy')",
                    timeout=30, interval=0.01,
                )  # fmt: skip
                out["live alert"].append(time.monotonic() - sent)
                tensors = batch(7 + attempt)
                sent = time.monotonic()
                api.upload_batch(run_id, tensors, step=50, config=CONFIG, reported=reported(tensors))
                tab.wait(
                    "document.getElementById('audits-mini-list').textContent.includes('match')",
                    timeout=30, interval=0.01,
                )  # fmt: skip
                out["live audit"].append(time.monotonic() - sent)
                context.close()
            browser.close()
    finally:
        api.client.close()
        server.stop()
    return out


def _row(name: str, where: str, seconds: list[float]) -> str:
    return (
        f"| {name} | {where} | {statistics.median(seconds) * 1000:.0f} | {max(seconds) * 1000:.0f} | "
        f"{len(seconds)} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pg-url", default=os.environ.get("RLVITALS_TEST_PG_URL"),
                    help="PostgreSQL for the audit row and the replica wake (default $RLVITALS_TEST_PG_URL)")  # fmt: skip
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"{os.cpu_count()} CPUs, load average {load:.2f} at the start")
    print("| what | where | median ms | max ms | tries |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="rlvitals-latency-") as tmp:
        work = Path(tmp)
        if "audit" in parts:
            print(_row("audit (64x4096)", "SQLite", audit_rows(f"sqlite:///{work / 'a.db'}", work, args.repeat)),
                  flush=True)  # fmt: skip
            if args.pg_url:
                print(
                    _row("audit (64x4096)", "PostgreSQL", audit_rows(args.pg_url, work, args.repeat)),
                    flush=True,
                )
        if "replica" in parts and args.pg_url:
            print(_row("replica wake + audit", "PostgreSQL, 2 servers", replica_rows(args.pg_url, work, args.repeat)),
                  flush=True)  # fmt: skip
        if "live" in parts:
            for name, seconds in live_rows(work, args.repeat).items():
                print(_row(name, "run page, Chromium", seconds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
