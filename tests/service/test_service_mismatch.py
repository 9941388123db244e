"""Rollout-vs-training mismatch end to end, on SQLite and PostgreSQL: real mismatches from a tiny
PyTorch LM (tests/support/mismatch_runs.py: a bf16 sampler, a sampler whose weight sync stops, and
a matched float32 one) sent with ``log_batch(..., rollout_log_probs=...)`` to a real server; the
audit records, the series, the API and the alerts read back over HTTP."""

from __future__ import annotations

import time
from functools import cache

import httpx
import pytest
import torch

import rlvitals
from tests.support.mismatch_runs import run as train

SYNC_UNTIL = 5
LR = 1e-3


@cache
def _steps(kind: str) -> tuple:
    """One training per kind, shared by both databases (the batches are deterministic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster than several on a shared machine
    try:
        return tuple(train(kind, sync_until=SYNC_UNTIL, lr=LR))
    finally:
        torch.set_num_threads(threads)


def _send(url: str, kind: str, spool) -> int:
    run = rlvitals.init(url=url, project="mismatch", name=kind, batch_every=1, spool_dir=str(spool))
    for s in _steps(kind):
        run.log({"actor/lr": LR, "actor/grad_norm": 1.0, "critic/score/mean": s.reward}, step=s.step)
        assert run.log_batch(s.step, **s.tensors)
    report = run.finish(timeout=60)
    assert report.complete, report
    return int(report.run_id)


def _audits(client: httpx.Client, run_id: int, count: int, timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = client.get(f"/api/v1/runs/{run_id}/audits").json()["data"]
        if len(data) == count and all(a["status"] == "done" for a in data):
            return data
        time.sleep(0.2)
    raise AssertionError(f"audits of run {run_id} not done in {timeout}s: {data}")


@pytest.fixture
def server(serve, database_url):
    return serve(database_url=database_url, env={"RLVITALS_AUDIT_WORKERS": "1"})


@pytest.mark.heavy
def test_real_mismatches_are_found_located_and_alerted_once(server, tmp_path):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        _check(server.url, client, tmp_path)


def _check(url: str, client: httpx.Client, tmp_path) -> None:
    ids = {kind: _send(url, kind, tmp_path / kind) for kind in ("matched", "bf16", "stale")}
    gaps = {}
    for kind, run_id in ids.items():
        audits = _audits(client, run_id, len(_steps(kind)))
        one = client.get(f"/api/v1/audits/{audits[-1]['id']}").json()
        report = one["mismatch"]  # the pinned contract
        assert report["token_mult_prob_error"] >= 1.0
        assert isinstance(report["by_position"], list) and len(report["by_position"]) >= 2
        assert report["tokens"] == _steps(kind)[-1].tensors["response_mask"].numel()
        gaps[kind] = [a["mismatch"]["abs_gap"]["mean"] for a in sorted(audits, key=lambda a: a["step"])]

    # found: the matched sampler agrees to float32 rounding (one token at a time vs the whole response),
    # the bf16 one does not
    assert max(gaps["matched"]) < 1e-5
    assert min(gaps["bf16"]) > 1e-3
    # grows when it should: 0 while the weights are synced, then rising once the sync stops
    stale = gaps["stale"]
    assert max(stale[:SYNC_UNTIL]) < 1e-5
    assert stale[SYNC_UNTIL] > 1e-3 and max(stale[-4:]) > 3 * stale[SYNC_UNTIL]

    # the series the trend rule reads are the run's metrics, and the API serves them with the reports
    view = client.get(f"/api/v1/runs/{ids['stale']}/mismatch").json()
    series = view["series"]["rlvitals/mismatch/abs_gap_mean"]
    assert series["steps"] == list(range(len(stale)))
    assert series["values"] == pytest.approx(stale)
    assert view["selected"]["step"] == len(stale) - 1 and view["selected"]["mismatch"]["worst"]
    chosen = view["audits"][SYNC_UNTIL]["id"]
    picked = client.get(f"/api/v1/runs/{ids['stale']}/mismatch", params={"audit_id": chosen}).json()
    assert picked["selected"]["step"] == SYNC_UNTIL
    assert (
        client.get(f"/api/v1/runs/{ids['matched']}/mismatch", params={"audit_id": chosen}).status_code == 404
    )

    # alerted once each, naming the cause; the matched run stays quiet
    alerts = {
        kind: client.get(f"/api/v1/runs/{run_id}/alerts").json()["data"] for kind, run_id in ids.items()
    }
    assert alerts["matched"] == []
    [bf16] = alerts["bf16"]
    assert bf16["rule"] == "mismatch_trend" and bf16["evidence"]["cause"] == "precision"
    assert "precision" in bf16["message"]
    [stale_alert] = alerts["stale"]
    assert stale_alert["rule"] == "mismatch_trend"
    assert stale_alert["evidence"]["cause"] in ("weight_sync", "stale_weights")
    assert "weight sync" in stale_alert["message"] and stale_alert["first_step"] >= SYNC_UNTIL
    # and one incident each, of the rollout-mismatch cause; none for the matched run
    incidents = {
        kind: client.get(f"/api/v1/runs/{run_id}/incidents").json()["data"] for kind, run_id in ids.items()
    }
    assert incidents["matched"] == []
    for kind in ("bf16", "stale"):
        [incident] = incidents[kind]
        assert incident["cause"] == "rollout_mismatch" and incident["primary_rule"] == "mismatch_trend", (
            incident
        )


@pytest.mark.parametrize(
    ("config", "bounds"),
    [
        # verl: IcePop bounds from algorithm.rollout_correction
        (
            {
                "algorithm": {
                    "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.8_1.25"}
                }
            },
            [0.8, 1.25],
        ),
        # verl in bypass mode: the trainer's side is log_prob
        ({"algorithm": {"rollout_correction": {"rollout_is": "token", "bypass_mode": True}}}, [0.5, 2.0]),
        ({"trainer": "trl", "loss_type": "grpo"}, [0.5, 2.0]),  # TRL: verl's default bounds
    ],
    ids=["verl-icepop", "verl-bypass", "trl"],
)
def test_verl_and_trl_shaped_batches_carry_the_report(api, config, bounds):
    from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done

    tensors = make_tensors(batch=4, length=16, seed=3)
    gen = torch.Generator().manual_seed(5)
    tensors["rollout_log_probs"] = tensors["old_log_prob"] + 0.3 * torch.randn(4, 16, generator=gen)
    run_id = api.create_run()
    response = api.post(
        f"/api/v1/runs/{run_id}/batches", content=make_batch(2, tensors=tensors, config=config), headers=OCTET
    )
    assert response.status_code == 202, response.text
    audit = wait_done(api, response.json()["id"])
    report = audit["mismatch"]
    assert [report["bounds"]["lower"], report["bounds"]["upper"]] == pytest.approx(bounds)
    trainer = tensors["log_prob" if "bypass" in str(config) else "old_log_prob"]
    valid = tensors["response_mask"].bool()
    gaps = (trainer.double() - tensors["rollout_log_probs"].double())[valid]
    assert report["token_mult_prob_error"] == pytest.approx(float(gaps.abs().exp().mean()))
    assert len(report["by_position"]) == 8
    names = api.get(f"/api/v1/runs/{run_id}/metric-names").json()
    assert "rlvitals/mismatch/token_mult_prob_error" in str(names)
