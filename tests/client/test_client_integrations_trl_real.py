"""The TRL integration on the real ``trl.GRPOTrainer`` (TRL 1.16.0, CPU, a tiny offline model).

The side environment is built on demand (``tests/support/sideenv.py``, cached by stamp); the training
scripts live in ``tests/support/trl_tiny.py`` and run there with this checkout's rlvitals on PYTHONPATH:

- *exactness*: every ``loss_type`` and every option that changes TRL's loss (``VARIANTS``), each
  micro-batch captured by the README recipe; what ``_compute_loss`` returned (seen from outside the
  mixin) and every metric TRL logged for that micro-batch equal ``trl_loss`` on the captured tensors at
  float32 rtol 1e-5, and ``trl_audit`` agrees;
- *refusals*: a ``_compute_loss`` override below the mixin, vLLM's importance-sampling correction and
  off-policy mask, the MoE aux loss: warned once, tensors sent without reported numbers;
- *one run per job*: the recipe against a real ``rlvitals serve``, combined four ways (README recipe
  with ``GRPOConfig.run_name``, an explicit ``rlvitals_run=``, ``RLVITALS_RUN_NAME``, the callback
  alone): one run each, the GRPOConfig as its config, audits of TRL's returned loss that agree, the
  run started before the first loss call, and sampled positions that rotate and see clipping.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import start_server
from tests.support.sideenv import TRL, ensure, rlvitals_path
from tests.support.trl_tiny import VARIANTS

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "trl_tiny.py"
RTOL = 1e-5
# The first test pays for building the side env (once per stamp) and for the 18 training runs of the
# exactness fixture: minutes on a busy 2-core box, past the suite's 300 s per-test default.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def trl_python() -> Path:
    return ensure("trl", TRL)


def run_script(python: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 1200) -> None:
    full = {
        **os.environ,
        "PYTHONPATH": str(rlvitals_path()),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",  # a 2-core CI box: one torch thread trains faster than two fighting
        **(env or {}),
    }
    proc = subprocess.run(
        [str(python), str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def exact_results(trl_python, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trl") / "exact.json"
    run_script(trl_python, "exact", str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_recomputation_reproduces_what_real_trl_returned_and_logged(exact_results, variant):
    result = exact_results[variant]
    assert result["batches"] >= 4  # every micro-batch of every step
    assert "loss" in result["keys"]  # the returned loss itself is audited, not only the clip share
    assert result["worst_rel_err"] <= RTOL, result
    assert result["audits_ok"], result["explanations"]
    # every variant updates on reused rollouts, so some batches are off-policy (ratio != 1)
    assert result["off_policy_batches"] >= 1, result


def test_clip_metrics_are_checked_for_every_clipped_loss_type(exact_results):
    for variant, result in exact_results.items():
        kind = VARIANTS[variant].get("loss_type", "dapo")
        if kind in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            assert {"clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"} <= set(
                result["keys"]
            )
        if kind == "cispo":
            assert "cispo_clip_ratio" in result["keys"]
    assert sum(r["clipped_batches"] for r in exact_results.values()) >= 10  # the audits saw real clipping


def _wait_audits(api: httpx.Client, run_id: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        audits = api.get(f"/api/v1/runs/{run_id}/audits").json()["data"]
        if (audits and all(a["status"] != "pending" for a in audits)) or time.monotonic() > deadline:
            return audits
        time.sleep(0.2)


@pytest.fixture(scope="module")
def recipe_server(trl_python, tmp_path_factory):
    work = tmp_path_factory.mktemp("trl-recipe")
    server = start_server(database_url=f"sqlite:///{work / 'db.sqlite'}", workdir=work)
    try:
        out = work / "recipe.json"
        run_script(trl_python, "recipe", str(out), env={"RLVITALS_URL": server.url})
        with httpx.Client(base_url=server.url, timeout=10) as api:
            runs = {
                r["name"]: r for r in api.get("/api/v1/runs", params={"include": "config"}).json()["data"]
            }
            audits = {name: _wait_audits(api, r["id"]) if name != "callback-only" else
                      api.get(f"/api/v1/runs/{r['id']}/audits").json()["data"] for name, r in runs.items()}  # fmt: skip
        yield runs, audits, json.loads(out.read_text())
    finally:
        server.stop()


def test_each_training_job_is_one_run_with_the_grpo_config(recipe_server):
    runs, _, seen = recipe_server
    assert set(runs) == {"recipe-run-name", "explicit-run", "env-run", "callback-only"}
    for run in runs.values():
        assert run["config"]["num_iterations"] == 2 and run["config"]["loss_type"] == "dapo"
        assert run["last_step"] == 4
    assert seen["explicit_is_shared"]
    assert all(seen["started_before_first_loss"].values())  # started in on_train_begin, not lazily


def test_audits_check_the_loss_trl_returned_and_agree(recipe_server):
    _, audits, _ = recipe_server
    assert audits["callback-only"] == []  # no mixin, no tensors
    for name in ("recipe-run-name", "explicit-run", "env-run"):
        done = audits[name]
        assert len(done) == 3, name
        for audit in done:
            assert audit["status"] == "done" and audit["ok"], audit["explanation"]
            assert "loss" in audit["verdicts"] and "clip_ratio/region_mean" in audit["verdicts"]
            assert "TRL 1.16" in audit["explanation"]


def test_sampled_positions_rotate_through_the_update_and_see_clipping(recipe_server):
    _, audits, _ = recipe_server
    # gradient_accumulation_steps=2, num_iterations=2: a cycle of 4 micro-batches over 2 optimizer steps
    # (odd steps hold positions 0-1, even steps 2-3); batch_every=1 targets 0, 1, 2, ... in turn, each at
    # the first step that holds it
    done = sorted(audits["recipe-run-name"], key=lambda a: a["step"])
    assert [(a["step"], a["micro_batch"]) for a in done] == [(1, 0), (3, 1), (4, 2)]
    assert (
        done[0]["reported"]["clip_ratio/region_mean"] == 0.0
    )  # first micro-batch after a generation: ratio 1
    assert done[2]["reported"]["clip_ratio/region_mean"] > 0  # after an update on the same generation


def test_losses_that_cannot_be_reproduced_are_refused_not_claimed(trl_python, tmp_path):
    out = tmp_path / "refuse.json"
    run_script(trl_python, "refuse", str(out))
    seen = json.loads(out.read_text())
    assert len(seen["warnings"]) == 1 and "Custom overrides GRPOTrainer._compute_loss" in seen["warnings"][0]
    assert len(seen["batches"]) == 2  # the tensors still go (histograms, on-policy gap)
    for batch in seen["batches"]:
        assert batch["reported"] == {} and "overrides" in batch["config"]["unaudited"]
    assert seen["plain"] is None
    assert "vllm_importance_sampling_correction" in seen["vllm_is"]
    assert "off_policy_mask_threshold" in seen["vllm_off_policy"]
    assert "router_aux_loss_coef" in seen["aux_loss"]


def test_a_run_that_collapses_on_purpose_is_halted_within_one_step_of_its_critical_incident(
    trl_python, tmp_path
):
    server = start_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", workdir=tmp_path)
    try:
        out = tmp_path / "halt.json"
        run_script(trl_python, "halt", str(out), env={"RLVITALS_URL": server.url})
        result = json.loads(out.read_text())
        with httpx.Client(base_url=server.url, timeout=10) as api:
            (run,) = [r for r in api.get("/api/v1/runs").json()["data"] if r["name"] == "halt-on-collapse"]
            incidents = api.get(f"/api/v1/runs/{run['id']}/incidents").json()["data"]
    finally:
        server.stop()
    halted = result["halted"]
    assert halted and halted["id"] in {i["id"] for i in incidents}
    incident = next(i for i in incidents if i["id"] == halted["id"])
    assert incident["severity"] == "critical" and incident["cause"] == halted["cause"]
    # the step whose metrics made the incident critical; the trainer stops at the next step boundary
    critical_at = min(f["step"] for f in incident["findings"] if f["severity"] == "critical")
    print(
        f"\nhalt: incident {incident['id']} ({incident['cause']}) critical at step {critical_at}; training "
        f"stopped at step {result['global_step']} of {result['max_steps']} after {result['seconds']:.1f} s"
    )
    assert result["global_step"] < result["max_steps"]
    assert critical_at <= result["global_step"] <= critical_at + 1, (critical_at, result)
    assert any(str(halted["id"]) in line and halted["cause"] in line for line in result["log"]), result["log"]
    assert result["checkpoints"] == [f"checkpoint-{result['global_step']}"]  # saved first, as asked
