"""Every one of verl 0.9.1's twelve registered policy losses, uploaded over HTTP: verl's own reported
numbers agree, a tampered report is flagged with the reason (SQLite and PostgreSQL); and every advantage
estimator is checked against the one the run's config names.

The batches and honest reports are the golden fixtures made from real verl 0.9.1
(tests/analyzers/golden/make_golden_modes.py: verl's ``ppo_loss`` with each ``PolicyLossConfig``, with
``rollout_is_weights`` and global-batch normalisation; make_golden_rollout.py: verl's registered
estimators), so the server is checked against verl, not against itself.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import ADV_ESTIMATORS, LossConfig, compute_advantages, recompute
from rlvitals.analyzers.reference.policy_losses import LossMode
from safetensors.torch import load_file

from tests.service.batchdata import OCTET, make_batch, wait_done

GOLDEN = Path(__file__).resolve().parents[1] / "analyzers" / "golden"
RANDOM_MODES = ("clip_cov",)  # pg_loss is checked as a range there (torch.randperm): tamper an exact metric
CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


@cache
def _fixture(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / f"{name}.json").read_text())
    return meta, load_file(str(GOLDEN / f"{name}.safetensors"))


def _tensors(store: dict[str, torch.Tensor], case_id: str) -> dict[str, torch.Tensor]:
    prefix = case_id + "."
    return {k[len(prefix) :]: v for k, v in store.items() if k.startswith(prefix)}


def _mode_cases(mode: str) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """Two non-empty cases of ``mode``: float32 with IS weights and global-batch normalisation, and
    float64 with neither (the fixture's grid has both for every mode and agg mode)."""
    meta, store = _fixture("verl_0_9_1_modes")
    out = []
    for want in ({"dtype:float32", "is:True", "global:True"}, {"dtype:float64", "is:False", "global:False"}):
        for case in meta["cases"]:
            tensors = _tensors(store, case["id"])
            if (
                case["config"]["loss_mode"] == mode
                and want <= set(case["tags"])
                and bool(tensors["response_mask"].bool().any())
                and all(math.isfinite(v) for v in case["expected"].values())
            ):
                out.append((case, tensors))
                break
    assert len(out) == 2, mode
    return out


def _upload(api, run_id, step, tensors, config, reported) -> dict:
    body = make_batch(step, tensors=tensors, config=config, reported=reported)
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)
    assert response.status_code == 202, response.text
    return wait_done(api, response.json()["id"])


def _as_verl_reports(expected: dict[str, float]) -> dict[str, float]:
    bare = ("kl_loss", "policy_loss")  # verl logs these without the actor/ prefix
    return {(k if k in bare or "/" in k else f"actor/{k}"): v for k, v in expected.items()}


@pytest.mark.parametrize("mode", [m.value for m in LossMode])
def test_every_loss_modes_batch_agrees_over_http_and_a_tampered_report_is_flagged(api, mode):
    run_id = api.create_run()
    for step, (case, tensors) in enumerate(_mode_cases(mode)):
        config = LossConfig(**case["config"]).to_dict()
        reported = _as_verl_reports(case["expected"])
        torch.manual_seed(case["seed"])
        good = _upload(api, run_id, 2 * step, tensors, config, reported)
        assert good["status"] == "done" and good["ok"] is True, (case["tags"], good["explanation"])
        policy = {k for k in case["expected"] if "/" not in k}
        assert set(good["verdicts"]) == policy, case["tags"]  # every metric verl's loss returns, no more
        target = "ppo_kl" if mode in RANDOM_MODES else "pg_loss"
        honest = case["expected"][target]
        key = next(k for k in reported if k.rsplit("/", 1)[-1] == target)
        bad = _audit_tampered(api, run_id, 2 * step + 1, tensors, config, reported, key, honest * 1.5 + 0.1)
        assert bad["ok"] is False and bad["verdicts"][target]["ok"] is False, case["tags"]
        assert f"{target}: reported" in bad["explanation"]
        assert [k for k, v in bad["verdicts"].items() if not v["ok"]] in ([target], [target, "policy_loss"])


def _audit_tampered(api, run_id, step, tensors, config, reported, key, value) -> dict:
    return _upload(api, run_id, step, tensors, config, {**reported, key: value})


def _advantage_batch(estimator: str, norm: bool):
    meta, store = _fixture("verl_0_9_1_rollout")
    case = next(
        c
        for c in meta["advantage_cases"]
        if c["estimator"] == estimator
        and c["norm_adv_by_std_in_grpo"] == norm
        and c["dtype"] == "float32"
        and c["kind"] != "tied"
    )
    t = _tensors(store, case["id"])
    uids = sorted(set(case["index"]))
    old = -torch.rand(t["response_mask"].shape, generator=torch.Generator().manual_seed(11)) - 0.1
    tensors = {
        "log_prob": old,
        "old_log_prob": old.clone(),
        "advantages": t["expected_advantages"],  # verl's own advantages
        "response_mask": t["response_mask"],
        "token_level_rewards": t["token_level_rewards"],
        "group_index": torch.tensor([uids.index(u) for u in case["index"]], dtype=torch.int64),
    }
    algorithm = {"adv_estimator": estimator, "norm_adv_by_std_in_grpo": norm, "gamma": case["gamma"]}
    return case, tensors, recompute(LossConfig(), **{k: tensors[k] for k in CORE}), algorithm


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATORS))
def test_every_estimator_is_checked_against_the_run_configs_estimator(api, estimator):
    for norm in (True, False):
        case, tensors, reported, algorithm = _advantage_batch(estimator, norm)
        rows = tensors["response_mask"].shape[0]
        run_id = api.create_run(  # the run's config, as verl's trainer logs it; it sizes the driver's
            # batch (train_batch_size x rollout.n responses: this whole batch), so the estimators that
            # normalise over the batch are checked exactly here too (a part is checked up to its statistics)
            config={"algorithm": algorithm, "data": {"train_batch_size": rows}, "actor_rollout_ref": {"rollout": {"n": 1}}}
        )  # fmt: skip
        good = _upload(api, run_id, 0, tensors, None, reported)
        assert good["ok"] is True, (estimator, norm, good["explanation"])
        assert good["advantages"]["ok"] is True and good["advantages"]["estimator"] == estimator
        other = "rloo" if estimator != "rloo" else "grpo"
        wrong, _ = compute_advantages(
            other, tensors["token_level_rewards"], tensors["response_mask"], case["index"]
        )
        if torch.allclose(wrong, tensors["advantages"], atol=1e-4):
            continue  # the two estimators agree on this batch: nothing to tell apart
        sent = {**tensors, "advantages": wrong}
        honest_loss = recompute(LossConfig(), **{k: sent[k] for k in CORE})  # only the advantages are wrong
        bad = _upload(api, run_id, 1, sent, None, honest_loss)
        assert bad["ok"] is False and bad["advantages"]["ok"] is False
        assert (
            f"differ from {estimator.upper()} advantages (adv_estimator={estimator!r})" in bad["explanation"]
        )
