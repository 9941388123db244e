"""Audits of non-vanilla verl loss modes over HTTP: an honest GSPO / CISPO / clip_cov batch agrees, a
tampered report is flagged with the reason; on SQLite and PostgreSQL."""

from __future__ import annotations

import torch
from rlvitals.analyzers import LossConfig, recompute

from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done

CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


def _audit(api, run_id, step, tensors, config, reported):
    body = make_batch(step, tensors=tensors, config=config, reported=reported)
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
    assert response.status_code == 202, response.text
    return wait_done(api, response.json()["id"])


def _honest(config: LossConfig, tensors) -> dict[str, float]:
    return {f"actor/{k}": v for k, v in recompute(config, **tensors).items()}


def test_gspo_batch_agrees_and_a_tampered_clip_fraction_is_flagged(api):
    run_id = api.create_run()
    tensors = {k: v for k, v in make_tensors(8, 64, seed=3).items() if k in CORE}
    gen = torch.Generator().manual_seed(3)
    tensors["old_log_prob"] = tensors["log_prob"] + 0.4 * torch.randn(
        8, 64, generator=gen
    )  # clipping happens
    # verl's own config shape: loss_mode lives in actor.policy_loss
    verl_config = {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": {"loss_mode": "gspo"}}
    config = LossConfig.from_verl(verl_config)
    honest = _honest(config, tensors)
    assert set(honest) == {
        f"actor/{k}" for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "policy_loss")
    }
    good = _audit(api, run_id, 1, tensors, verl_config, honest)
    assert good["status"] == "done" and good["ok"] is True, good["explanation"]
    assert set(good["verdicts"]) == {"pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "policy_loss"}
    assert set(good["counterfactuals"]["by_loss_mode"]) >= {"vanilla", "gspo", "cispo", "clip_cov"}
    # the trainer reported vanilla's per-token clip fraction, not GSPO's sequence-level one
    vanilla = recompute(LossConfig(loss_agg_mode="seq-mean-token-mean"), **tensors)
    tampered = {**honest, "actor/pg_clipfrac": vanilla["pg_clipfrac"]}
    assert vanilla["pg_clipfrac"] != honest["actor/pg_clipfrac"]
    bad = _audit(api, run_id, 2, tensors, verl_config, tampered)
    assert bad["ok"] is False and [k for k, v in bad["verdicts"].items() if not v["ok"]] == ["pg_clipfrac"]
    assert "pg_clipfrac: reported" in bad["explanation"]
    assert "loss_mode vanilla; config says loss_mode gspo" in bad["explanation"]
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts", params={"state": "firing"}).json()["data"]
    assert [a["rule"] for a in alerts] == ["audit_mismatch"]


def test_cispo_with_rollout_is_weights_agrees_and_unweighted_loss_is_flagged(api):
    run_id = api.create_run()
    tensors = {k: v for k, v in make_tensors(6, 48, seed=4).items() if k in CORE}
    gen = torch.Generator().manual_seed(5)
    tensors["rollout_is_weights"] = torch.rand(6, 48, generator=gen) + 0.5
    config = LossConfig(loss_mode="cispo", clip_ratio_high=0.28)
    honest = _honest(config, tensors)
    good = _audit(api, run_id, 1, tensors, config.to_dict(), honest)
    assert good["ok"] is True, good["explanation"]
    unweighted = _honest(config, {k: v for k, v in tensors.items() if k != "rollout_is_weights"})
    bad = _audit(
        api, run_id, 2, tensors, config.to_dict(), {**honest, "actor/pg_loss": unweighted["actor/pg_loss"]}
    )
    assert bad["ok"] is False and bad["verdicts"]["pg_loss"]["ok"] is False
    assert "pg_loss: reported" in bad["explanation"] and "verl 0.9.1 gives" in bad["explanation"]


def test_clip_cov_pg_loss_is_audited_as_a_range(api):
    run_id = api.create_run()
    gen = torch.Generator().manual_seed(6)
    log_prob = -torch.rand(6, 40, generator=gen) * 6
    tensors = {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(6, 40, generator=gen) * 0.05,
        "advantages": (torch.randn(6, 1, generator=gen) * 3).expand(6, 40).contiguous(),
        "response_mask": (torch.rand(6, 40, generator=gen) < 0.8).float(),
    }
    config = LossConfig(loss_mode="clip_cov", clip_cov_ratio=0.2)
    torch.manual_seed(11)
    honest = _honest(config, tensors)
    good = _audit(api, run_id, 1, tensors, config.to_dict(), honest)
    assert good["ok"] is True, good["explanation"]
    low, high = good["verdicts"]["pg_loss"]["range"]
    assert low <= honest["actor/pg_loss"] <= high and low < high
    assert "torch.randperm" in good["explanation"]
    bad = _audit(api, run_id, 2, tensors, config.to_dict(), {**honest, "actor/pg_loss": high + 1.0})
    assert bad["ok"] is False and "outside [" in bad["explanation"]
