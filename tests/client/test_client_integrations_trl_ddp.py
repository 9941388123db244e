"""A real two-process TRL job: ``accelerate launch --num_processes 2 --cpu`` (gloo) runs TRL 1.16's
``GRPOTrainer`` with the README recipe against a real ``rlvitals serve``.

One run per job (both ranks resume the run named by ``GRPOConfig.run_name``); every micro-batch of every
rank is audited with the normalisers TRL used on that rank (dapo divides by the token count of the
generation batch over both processes and by ``num_processes``), and every verdict agrees with the loss
that rank's ``_compute_loss`` returned."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port
from tests.support.sideenv import TRL, ensure, rlvitals_path
from tests.support.trl_tiny import DDP_VARIANTS

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "trl_tiny.py"
pytestmark = pytest.mark.timeout(1800)


def _launch(mode: str, work: Path, url: str) -> dict[int, dict]:
    """``accelerate launch --num_processes 2`` of ``trl_tiny.py MODE`` (CPU, gloo) against ``url``;
    each rank's JSON."""
    python = ensure("trl", TRL)
    prefix = work / mode
    env = {
        **os.environ,
        "PYTHONPATH": str(rlvitals_path()),
        "RLVITALS_URL": url,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RLVITALS_RUN_NAME", None)
    cmd = [
        str(python.parent / "accelerate"), "launch", "--num_processes", "2", "--num_machines", "1",
        "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(SCRIPT), mode, str(prefix),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {r: json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    """Run the job once against a real server; yield (server url, each rank's returned losses)."""
    from tests.support.servers import start_server

    work = tmp_path_factory.mktemp("ddp")
    server = start_server(database_url=f"sqlite:///{work / 'ddp.db'}", workdir=work)
    try:
        yield server.url, _launch("ddp", work, server.url)
    finally:
        server.stop()


def _audits(api: httpx.Client, run_id: int) -> list[dict]:
    deadline = time.monotonic() + 120
    while True:
        audits = api.get(f"/api/v1/runs/{run_id}/audits", params={"limit": 1000}).json()["data"]
        if all(a["status"] != "pending" for a in audits) or time.monotonic() > deadline:
            return audits
        time.sleep(0.2)


def test_the_processes_trained_as_one_gloo_job(ddp_job):
    _, ranks = ddp_job
    assert {r["backend"] for r in ranks.values()} == {"gloo"}
    for rank in ranks.values():  # 2 variants x 2 optimizer steps x GA 2 micro-batches each
        assert len(rank["returned"]) == 8, rank["returned"]


@pytest.mark.parametrize("variant", sorted(DDP_VARIANTS))
def test_one_run_per_job_and_every_ranks_batches_audit_exact(ddp_job, variant):
    url, ranks = ddp_job
    with httpx.Client(base_url=url, timeout=30) as api:
        runs = [
            r for r in api.get("/api/v1/runs", params={"limit": 100}).json()["data"] if r["name"] == variant
        ]
        assert len(runs) == 1, runs  # both ranks resumed one run
        run_id = runs[0]["id"]
        audits = _audits(api, run_id)
        series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"max_points": 0}).json()["series"]
    assert {a["rank"] for a in audits} == {0, 1}
    assert len(audits) == 8  # 2 ranks x 2 steps x 2 micro-batches, every one sent and audited
    for audit in audits:
        assert audit["status"] == "done", audit
        assert audit["ok"] is True, audit["explanation"]
        # TRL gathers logged metrics over the processes: only the rank's own returned loss is reported
        assert set(audit["reported"]) == {"loss"}
        returned = ranks[audit["rank"]]["returned"][f"{variant}:{audit['step']}:{audit['micro_batch']}"]
        assert audit["reported"]["loss"] == pytest.approx(returned, rel=0, abs=0)
        assert audit["verdicts"]["loss"]["ok"] is True
    # the two ranks' losses differ (their own data), yet each agrees with its own recomputation
    first = {a["rank"]: a["reported"]["loss"] for a in audits if a["step"] == 1 and a["micro_batch"] == 0}
    assert first[0] != first[1]
    assert "loss" in series or "train/loss" in series or any(k.endswith("loss") for k in series)


def test_a_job_that_collapses_on_purpose_stops_on_every_process_at_the_same_step(tmp_path):
    """Only rank 0 records the run (no run name shared by the processes) and hears of the critical
    incident; both processes stop, and save, at the same step boundary, within one step of it."""
    from tests.support.servers import start_server

    server = start_server(database_url=f"sqlite:///{tmp_path / 'halt.db'}", workdir=tmp_path)
    try:
        ranks = _launch("ddp-halt", tmp_path, server.url)
        with httpx.Client(base_url=server.url, timeout=10) as api:
            (run,) = api.get("/api/v1/runs").json()["data"]
            incidents = api.get(f"/api/v1/runs/{run['id']}/incidents").json()["data"]
    finally:
        server.stop()
    main, other = ranks[0], ranks[1]
    assert main["run"] == run["name"] and other["run"] is None  # rank 1 recorded nothing itself
    incident = next(i for i in incidents if i["id"] == main["halted"]["id"])
    assert incident["severity"] == "critical" and incident["cause"] == main["halted"]["cause"]
    critical_at = min(f["step"] for f in incident["findings"] if f["severity"] == "critical")
    assert main["global_step"] == other["global_step"] < main["max_steps"]
    assert critical_at <= main["global_step"] <= critical_at + 1, (critical_at, main)
    assert other["halted"] == {"id": incident["id"], "from_another_rank": True}
    assert main["checkpoints"] == other["checkpoints"] == [f"checkpoint-{main['global_step']}"]
