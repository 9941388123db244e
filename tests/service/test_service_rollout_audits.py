"""Rollout-correction and advantage-estimator audits over HTTP, on SQLite and PostgreSQL.

The honest reports are verl 0.9.1's own numbers (the golden fixture made by
tests/analyzers/golden/make_golden_rollout.py from verl's rollout_corr_helper and estimators), so the
server is checked against the real thing, not against itself.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
from rlvitals.analyzers import LossConfig, compute_advantages, recompute
from safetensors.torch import load_file

from tests.service.batchdata import OCTET, make_batch, wait_done

GOLDEN = Path(__file__).resolve().parents[1] / "analyzers" / "golden"
CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


@cache
def _golden() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1_rollout.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1_rollout.safetensors"))


def _case(kind: str, pick) -> tuple[dict, dict[str, torch.Tensor]]:
    meta, store = _golden()
    case = next(c for c in meta[kind] if pick(c))
    prefix = case["id"] + "."
    return case, {k[len(prefix) :]: v for k, v in store.items() if k.startswith(prefix)}


def _rollout_batch(pick):
    """A float32 batch from a golden rollout case: verl's reported rollout_corr/* + honest loss metrics."""
    case, t = _case("rollout_cases", pick)
    old = t["old_log_prob"]
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "old_log_prob": old,
        "log_prob": old + 0.01 * torch.randn(old.shape, generator=gen, dtype=old.dtype),
        "advantages": torch.randn(old.shape, generator=gen, dtype=old.dtype),
        "response_mask": t["response_mask"],
        "rollout_log_probs": t["rollout_log_prob"],
    }
    # the actor trains on verl's mask after rejection; ppo_kl and pg_clipfrac do not depend on the IS weights
    honest = recompute(LossConfig(), **{**{k: tensors[k] for k in CORE}, "response_mask": t["expected_mask"]})
    reported = {f"actor/{k}": honest[k] for k in ("ppo_kl", "pg_clipfrac")}
    reported.update(case["metrics"])
    reported.update(case["debug_metrics"])
    config = {"algorithm": {"rollout_correction": dict(case["kwargs"])}}  # a copy: the fixture is cached
    return case, tensors, reported, config


def _upload(api, run_id, body) -> dict:
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
    assert response.status_code == 202, response.text
    return wait_done(api, response.json()["id"])


def _chained_is_and_rs(case) -> bool:
    kw = case["kwargs"]
    return (
        "metrics" in case
        and case["dtype"] == "float32"
        and kw["rollout_is"] is not None
        and kw["rollout_is_threshold"] == 2.0
        and "," in (kw["rollout_rs"] or "")
        and 0 < case["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 1
    )


def test_verl_rollout_correction_report_agrees(api):
    run_id = api.create_run()
    case, tensors, reported, config = _rollout_batch(_chained_is_and_rs)
    audit = _upload(api, run_id, make_batch(3, tensors=tensors, reported=reported, config=config))
    assert audit["status"] == "done" and audit["ok"] is True, audit["explanation"]
    rollout = audit["rollout"]
    assert rollout["ok"] is True and rollout["unexpected"] == []
    assert set(rollout["verdicts"]) == {k for k in reported if k.startswith(("rollout_corr/", "training/"))}
    assert "rollout_corr/rollout_is_eff_sample_size" in rollout["verdicts"]
    assert rollout["rejected_tokens"] > 0 and rollout["weights"]["min"] >= 0
    assert rollout["config"]["rollout_rs"] == case["kwargs"]["rollout_rs"]
    assert set(audit["verdicts"]) == {"ppo_kl", "pg_clipfrac"}  # audited on the mask after rejection


def test_a_loss_reported_on_the_mask_before_rejection_is_flagged(api):
    run_id = api.create_run()
    _, tensors, reported, config = _rollout_batch(_chained_is_and_rs)
    before = recompute(LossConfig(), **{k: tensors[k] for k in CORE})  # the trainer ignored the rejection
    reported["actor/ppo_kl"] = before["ppo_kl"]
    audit = _upload(api, run_id, make_batch(7, tensors=tensors, reported=reported, config=config))
    assert audit["ok"] is False and audit["rollout"]["ok"] is True
    assert audit["verdicts"]["ppo_kl"]["ok"] is False


def test_a_tampered_rollout_corr_value_is_flagged_with_the_reason(api):
    run_id = api.create_run()
    _, tensors, reported, config = _rollout_batch(_chained_is_and_rs)
    reported["rollout_corr/rollout_is_mean"] = reported["rollout_corr/rollout_is_mean"] * 1.5 + 0.1
    audit = _upload(api, run_id, make_batch(4, tensors=tensors, reported=reported, config=config))
    assert audit["ok"] is False and audit["rollout"]["ok"] is False
    assert audit["rollout"]["verdicts"]["rollout_corr/rollout_is_mean"]["ok"] is False
    assert "rollout_corr/rollout_is_mean reported" in audit["explanation"]
    assert audit["verdicts"] and all(v["ok"] for v in audit["verdicts"].values())  # the loss metrics agree
    alerts = api.get(f"/api/v1/runs/{run_id}/alerts", params={"state": "firing"}).json()["data"]
    assert [a["rule"] for a in alerts] == ["audit_mismatch"]


def test_a_report_from_another_rollout_correction_config_is_flagged(api):
    run_id = api.create_run()
    _, tensors, reported, config = _rollout_batch(_chained_is_and_rs)
    config["algorithm"]["rollout_correction"]["rollout_is"] = None  # the config says: no IS weights
    audit = _upload(api, run_id, make_batch(5, tensors=tensors, reported=reported, config=config))
    assert audit["ok"] is False
    assert "rollout_corr/rollout_is_mean" in audit["rollout"]["unexpected"]
    assert "not produced by this configuration" in audit["explanation"]


def test_the_run_config_supplies_the_rollout_correction_when_the_batch_has_none(api):
    case, tensors, reported, config = _rollout_batch(_chained_is_and_rs)
    run_id = api.create_run(config=config)
    good = _upload(api, run_id, make_batch(6, tensors=tensors, reported=reported))
    assert good["ok"] is True, good["explanation"]
    assert good["rollout"]["config"] == {**case["kwargs"], "bypass_mode": False, "loss_type": "ppo_clip"}


def _advantage_batch(estimator: str):
    case, t = _case(
        "advantage_cases",
        lambda c: c["estimator"] == estimator and c["dtype"] == "float32" and c["kind"] != "tied",
    )
    mask = t["response_mask"]
    uids = sorted(set(case["index"]))
    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(mask.shape, generator=gen) - 0.1
    tensors = {
        "log_prob": old,
        "old_log_prob": old.clone(),
        "advantages": t["expected_advantages"],  # verl's own advantages
        "response_mask": mask,
        "token_level_rewards": t["token_level_rewards"],
        "group_index": torch.tensor([uids.index(u) for u in case["index"]], dtype=torch.int64),
    }
    config = {"algorithm": {"adv_estimator": estimator, "norm_adv_by_std_in_grpo": case["norm_adv_by_std_in_grpo"],
                            "gamma": case["gamma"]}}  # fmt: skip
    return case, tensors, recompute(LossConfig(), **{k: tensors[k] for k in CORE}), config


def test_advantages_are_checked_against_the_configured_estimator(api):
    run_id = api.create_run()
    for estimator in ("rloo", "opo", "reinforce_plus_plus_baseline", "grpo_passk"):
        _, tensors, reported, config = _advantage_batch(estimator)
        audit = _upload(api, run_id, make_batch(0, tensors=tensors, reported=reported, config=config))
        assert audit["ok"] is True, (estimator, audit["explanation"])
        assert audit["advantages"] == {**audit["advantages"], "ok": True, "estimator": estimator}


def test_grpo_advantages_sent_for_an_rloo_run_are_flagged(api):
    run_id = api.create_run()
    case, tensors, reported, config = _advantage_batch("rloo")
    tensors["advantages"], _ = compute_advantages(
        "grpo", tensors["token_level_rewards"], tensors["response_mask"], case["index"]
    )
    audit = _upload(api, run_id, make_batch(1, tensors=tensors, reported=reported, config=config))
    assert audit["ok"] is False and audit["advantages"]["ok"] is False
    assert "RLOO advantages (adv_estimator='rloo')" in audit["explanation"]


def test_an_invalid_algorithm_section_is_a_422(api):
    run_id = api.create_run()
    _, tensors, reported, config = _rollout_batch(_chained_is_and_rs)
    config["algorithm"]["rollout_correction"]["rollout_rs"] = "token_k9"
    body = make_batch(0, tensors=tensors, reported=reported, config=config)
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
    assert response.status_code == 422
    assert "token_k9" in response.json()["error"]["message"]


def test_a_sample_of_a_reinforce_plus_plus_batch_audits_ok_and_a_tampered_one_is_flagged(api):
    """verl whitens REINFORCE++ advantages over the driver's whole batch; the run's verl config gives its
    size (data.train_batch_size x rollout.n), so a sample is checked up to that batch's statistics."""
    meta = json.loads((GOLDEN / "verl_0_9_1_batch_stats.json").read_text())
    store = load_file(str(GOLDEN / "verl_0_9_1_batch_stats.safetensors"))
    case = next(c for c in meta["cases"] if c["id"] == "reinforce_plus_plus.float32")
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:16]
    mask = store[f"{case['id']}.response_mask"][rows].bool()
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) - 0.1
    tensors = {
        "log_prob": old,
        "old_log_prob": old.clone(),
        "advantages": store[f"{case['id']}.advantages"][rows],  # verl's, from the whole batch
        "response_mask": mask,
        "token_level_rewards": store[f"{case['id']}.token_level_rewards"][rows],
    }
    reported = recompute(LossConfig(), **{k: tensors[k] for k in CORE})
    run_id = api.create_run(config={
        "data": {"train_batch_size": meta["train_batch_size"]},
        "actor_rollout_ref": {"rollout": {"n": meta["rollout_n"]}},
        "algorithm": {"adv_estimator": "reinforce_plus_plus", "gamma": case["gamma"]},
    })  # fmt: skip
    audit = _upload(api, run_id, make_batch(0, tensors=tensors, reported=reported))
    assert audit["ok"] is True, audit["explanation"]
    adv = audit["advantages"]
    assert (adv["scope"], adv["rows"], adv["batch_size"]) == ("batch_statistics", 16, 64)
    assert abs(adv["fitted"]["std"] - case["batch_stats"]["std"]) < 1e-4 * case["batch_stats"]["std"]
    tampered = tensors["advantages"].clone()
    tampered[0] = tampered[0].flip(0) * mask[0]  # one response's advantages in the wrong order
    audit = _upload(
        api, run_id, make_batch(1, tensors={**tensors, "advantages": tampered}, reported=reported)
    )
    assert audit["ok"] is False and audit["advantages"]["ok"] is False
    assert (
        "are not REINFORCE_PLUS_PLUS advantages (adv_estimator='reinforce_plus_plus') for any batch"
        in (audit["explanation"])
    )
