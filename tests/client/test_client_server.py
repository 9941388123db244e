"""The client against a real ``rlvitals serve`` process: scalars, tensor batches, resume, auth, sync."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import httpx
import pytest
import torch
from rlvitals.client import ClientSettings, ClientWarning
from rlvitals.client.sync import sync_spool

import rlvitals


def series(url: str, run_id: str) -> dict:
    body = httpx.get(f"{url}/api/v1/runs/{run_id}/metrics", params={"max_points": 0}, timeout=10).json()
    return {name: dict(zip(s["step"], s["value"], strict=True)) for name, s in body["series"].items()}


def test_scalars_round_trip_with_non_finite_values(serve, tmp_path):
    server = serve()
    with rlvitals.init(url=server.url, project="p", name="round-trip", spool_dir=tmp_path) as run:
        for step in range(300):
            run.log({"actor/pg_loss": step / 8, "reward": torch.tensor(float(step))}, step=step)
        run.log({"nan": math.nan, "inf": math.inf, "ninf": -math.inf}, step=300)
    got = series(server.url, run.run_id)
    assert got["actor/pg_loss"] == {s: s / 8 for s in range(300)}
    assert got["reward"] == {s: float(s) for s in range(300)}
    assert (got["nan"], got["inf"], got["ninf"]) == ({300: "NaN"}, {300: "Infinity"}, {300: "-Infinity"})


@pytest.mark.heavy
def test_same_project_and_name_resumes_the_run(serve, tmp_path):
    server = serve()
    first = rlvitals.init(url=server.url, project="p", name="resume", spool_dir=tmp_path)
    first.log({"x": 1.0}, step=0)
    first.finish(timeout=10)
    second = rlvitals.init(url=server.url, project="p", name="resume", spool_dir=tmp_path)
    second.log({"x": 2.0}, step=1)
    second.finish(timeout=10)
    assert first.run_id == second.run_id
    assert series(server.url, first.run_id)["x"] == {0: 1.0, 1: 2.0}


@pytest.mark.heavy
def test_tensor_batch_is_stored_and_audited(serve, tmp_path):
    from rlvitals.analyzers import LossConfig, recompute

    server = serve()
    gen = torch.Generator().manual_seed(0)
    log_prob = torch.randn(8, 32, generator=gen) * 0.1 - 1.0
    old_log_prob = log_prob + torch.randn(8, 32, generator=gen) * 0.05
    advantages = torch.randn(8, 32, generator=gen)
    mask = (torch.rand(8, 32, generator=gen) > 0.2).float()
    config = LossConfig()
    reported = recompute(
        config, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=mask
    )
    run = rlvitals.init(url=server.url, project="p", name="audit", spool_dir=tmp_path, batch_every=1)
    assert run.log_batch(
        0, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=mask,
        config=config, reported=reported,
    )  # fmt: skip
    report = run.finish(timeout=10)
    assert report.batches_sent == 1 and report.complete
    deadline = time.monotonic() + 20
    while True:
        audits = httpx.get(f"{server.url}/api/v1/runs/{run.run_id}/audits", timeout=10).json()
        if (audits["count"] and audits["data"][0]["status"] != "pending") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    audit = audits["data"][0]
    assert audit["step"] == 0 and audit["rank"] == 0 and audit["micro_batch"] == 0
    assert audit["reported"]["pg_loss"] == pytest.approx(reported["pg_loss"])


@pytest.mark.heavy
def test_api_key_is_sent_and_a_wrong_key_keeps_records_for_sync(serve, tmp_path):
    server = serve()
    db = server.database_url
    created = subprocess.run(
        [sys.executable, "-m", "rlvitals.cli", "keys", "--database-url", db, "create", "--name", "t"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    key = created.stdout.strip().split()[-1]
    with rlvitals.init(url=server.url, project="p", name="auth", api_key=key, spool_dir=tmp_path) as run:
        run.log({"x": 1.0}, step=0)
    assert series(server.url, run.run_id)["x"] == {0: 1.0}

    settings = ClientSettings(init_timeout=1.0)
    with pytest.warns(ClientWarning) as caught:
        bad = rlvitals.init(
            url=server.url,
            project="p",
            name="auth-bad",
            api_key="wrong",
            spool_dir=tmp_path,
            settings=settings,
        )
        bad.log({"y": 2.0}, step=5)
        report = bad.finish(timeout=1.0)
    assert report.points_pending == 1
    assert "HTTP 401" in str(caught[0].message) and "rlvitals sync" in str(caught[-1].message)
    result = sync_spool(tmp_path, url=server.url, api_key=key)
    assert result.ok and result.points_sent == 1, result
    runs = httpx.get(f"{server.url}/api/v1/runs", timeout=10).json()["data"]
    bad_id = next(r["id"] for r in runs if r["name"] == "auth-bad")
    assert series(server.url, str(bad_id))["y"] == {5: 2.0}


@pytest.mark.heavy
def test_offline_run_synced_to_a_real_server(serve, tmp_path):
    server = serve()
    run = rlvitals.init(project="p", name="offline", mode="offline", spool_dir=tmp_path, batch_every=1)
    for step in range(1500):
        run.log({"x": float(step)}, step=step)
    tensors = {k: torch.zeros(2, 4) for k in ("log_prob", "old_log_prob", "advantages")}
    run.log_batch(0, **tensors, response_mask=torch.ones(2, 4))
    report = run.finish(timeout=5)
    assert report.points_pending == 1500 and report.batches_pending == 1
    result = sync_spool(run.spool_dir, url=server.url)
    assert result.ok and (result.points_sent, result.batches_sent) == (1500, 1), result
    runs = httpx.get(f"{server.url}/api/v1/runs", timeout=10).json()["data"]
    run_id = str(next(r["id"] for r in runs if r["name"] == "offline"))
    assert series(server.url, run_id)["x"] == {s: float(s) for s in range(1500)}
    assert not list(run.spool_dir.glob("seg-*")) and not list(run.spool_dir.glob("batch-*"))
