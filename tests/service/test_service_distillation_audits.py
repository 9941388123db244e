"""On-policy distillation audits over HTTP (``teacher_log_probs`` + the config's ``distillation`` section),
on SQLite and PostgreSQL.

The honest ``distillation/*`` reports are verl 0.9.1's own numbers: the golden fixture made by
tests/analyzers/golden/make_golden_rollout.py from verl's ``trainer.distillation.losses.distillation_loss``
(every estimator, policy-gradient and supervised, clamped and not), so the server is checked against the
real thing. The real verl ``distillation_ppo_loss`` through the client hook is in
tests/client/test_client_integrations_verl.py.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from safetensors.torch import load_file

from tests.service.batchdata import OCTET, make_batch, wait_done

GOLDEN = Path(__file__).resolve().parents[1] / "analyzers" / "golden"
CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


@cache
def _golden() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1_rollout.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1_rollout.safetensors"))


def _cases() -> list[str]:
    meta, _ = _golden()
    return [c["id"] for c in meta["distillation_cases"] if c["dtype"] == "float32"]


def _batch(case_id: str, *, coef: float = 1.0, use_task_rewards: bool = True):
    meta, store = _golden()
    case = next(c for c in meta["distillation_cases"] if c["id"] == case_id)
    t = {k[len(case_id) + 1 :]: v for k, v in store.items() if k.startswith(case_id + ".")}
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "log_prob": t["student_log_prob"],
        "old_log_prob": t["old_log_prob"],
        "advantages": torch.randn(t["old_log_prob"].shape, generator=gen),
        "response_mask": t["response_mask"],
        "teacher_log_probs": t["teacher_log_prob"],
    }
    actor = {"loss_agg_mode": case["loss_agg_mode"]}
    config = {
        **actor,
        "distillation": {
            "enabled": True,
            "distillation_loss": {
                "loss_mode": case["loss_mode"],
                "use_policy_gradient": case["use_policy_gradient"],
                "loss_max_clamp": case["loss_max_clamp"],
                "distillation_loss_coef": coef,
                "use_task_rewards": use_task_rewards,
                "topk": 128,  # verl's other fields travel as-is and are ignored
            },
        },
    }
    ppo = recompute(LossConfig.from_verl(actor), **{k: tensors[k] for k in CORE})
    reported = {f"actor/{k}": ppo[k] for k in ("pg_loss", "pg_clipfrac", "ppo_kl")}
    reported.update(case["expected"])  # verl's distillation/* numbers
    base = ppo["policy_loss"] if use_task_rewards else 0.0
    reported["policy_loss"] = (
        base + (coef if use_task_rewards else 1.0) * case["expected"]["distillation/loss"]
    )
    return case, tensors, config, reported


def _upload(api, run_id, step, tensors, config, reported) -> dict:
    body = make_batch(step, tensors=tensors, config=config, reported=reported)
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
    assert response.status_code == 202, response.text
    return wait_done(api, response.json()["id"])


def test_verls_distillation_reports_agree_for_every_estimator(api):
    run_id = api.create_run()
    for step, case_id in enumerate(_cases()):
        case, tensors, config, reported = _batch(case_id, coef=0.5)
        audit = _upload(api, run_id, step, tensors, config, reported)
        assert audit["status"] == "done" and audit["ok"] is True, (case, audit["explanation"])
        distilled = audit["distillation"]
        assert distilled["ok"] is True and distilled["unexpected"] == []
        assert set(distilled["verdicts"]) == {*case["expected"], "policy_loss"}
        assert distilled["config"]["loss_mode"] == case["loss_mode"]
        assert "policy_loss" not in audit["verdicts"]  # PPO + distillation: the distillation step checks it


def test_a_tampered_distillation_loss_is_flagged_with_the_reason(api):
    run_id = api.create_run()
    case_id = next(c for c in _cases() if _batch(c)[0]["use_policy_gradient"])
    _case, tensors, config, reported = _batch(case_id)
    reported["distillation/loss"] = reported["distillation/loss"] * 2 + 0.1
    audit = _upload(api, run_id, 1, tensors, config, reported)
    assert audit["ok"] is False and audit["distillation"]["ok"] is False
    assert audit["distillation"]["verdicts"]["distillation/loss"]["ok"] is False
    assert "Distillation mismatch: distillation/loss reported" in audit["explanation"]
    assert all(v["ok"] for v in audit["verdicts"].values())  # the PPO metrics still agree
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts", params={"state": "firing"}).json()["data"]
    assert [a["rule"] for a in alerts] == ["audit_mismatch"]


@pytest.mark.parametrize("use_task_rewards", [True, False])
def test_a_total_loss_without_the_distillation_term_is_flagged(api, use_task_rewards):
    run_id = api.create_run()
    _case, tensors, config, reported = _batch(_cases()[0], coef=2.0, use_task_rewards=use_task_rewards)
    good = _upload(api, run_id, 1, tensors, config, reported)
    assert good["ok"] is True, good["explanation"]
    ppo = recompute(LossConfig.from_verl(config), **{k: tensors[k] for k in CORE})["policy_loss"]
    bad = _upload(api, run_id, 2, tensors, config, {**reported, "policy_loss": ppo})  # the PPO part alone
    assert bad["ok"] is False and bad["distillation"]["verdicts"]["policy_loss"]["ok"] is False
    assert "policy_loss reported" in bad["explanation"]


def test_a_supervised_report_under_a_policy_gradient_config_is_flagged(api):
    run_id = api.create_run()
    case_id = next(c for c in _cases() if not _batch(c)[0]["use_policy_gradient"])
    _case, tensors, config, reported = _batch(case_id)
    config["distillation"]["distillation_loss"]["use_policy_gradient"] = True  # config disagrees with the run
    reported.pop("policy_loss")
    audit = _upload(api, run_id, 1, tensors, config, reported)
    assert audit["ok"] is False
    assert "distillation/loss reported" in audit["explanation"]


def test_the_run_config_supplies_the_distillation_section(api):
    case, tensors, config, reported = _batch(_cases()[1])
    run_id = api.create_run(config={"distillation": config.pop("distillation")})
    audit = _upload(api, run_id, 1, tensors, config, reported)
    assert audit["ok"] is True, audit["explanation"]
    assert audit["distillation"]["config"]["loss_mode"] == case["loss_mode"]


def test_an_invalid_distillation_section_is_a_422(api):
    run_id = api.create_run()
    _, tensors, config, reported = _batch(_cases()[0])
    config["distillation"]["distillation_loss"]["loss_mode"] = "forward_kl_topk"
    body = make_batch(0, tensors=tensors, reported=reported, config=config)
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
    assert response.status_code == 422
    assert "forward_kl_topk" in response.json()["error"]["message"]
