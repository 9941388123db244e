"""The advantage check of estimators that normalise over the whole batch, against real verl 0.9.1.

verl's driver computes ``reinforce_plus_plus`` / ``reinforce_plus_plus_baseline`` advantages with
``masked_whiten`` over the whole training batch, and ``gpg``'s with ``alpha = batch / non-zero scores``
counted over it; a client uploads a micro-batch (a sample) of that batch. golden/verl_0_9_1_batch_stats.*
(made by golden/make_golden_batch_stats.py from verl's own estimator functions) holds whole batches of
``train_batch_size x rollout.n`` responses with verl's advantages and the whole batch's statistics. Here:

- the whole batch, its size known from the run's verl config, is checked exactly;
- a sample of it audits ok (recomputing over the sample alone would be a false mismatch), and the
  statistics the check fits are the whole batch's own;
- tampered advantages are flagged: a sample whose rows are not one affine map of the per-row values, a
  sign flip, and an affine change of the whole batch once its size says it is whole.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import LossConfig, recompute
from rlvitals.analyzers.contract.batch import AuditBatch
from rlvitals.analyzers.verdicts.algorithm import ADVANTAGE_ATOL, AlgorithmConfig, check_advantages
from rlvitals.analyzers.verdicts.batch_audit import audit_batch
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parent / "golden"
CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


@cache
def _fixture() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1_batch_stats.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1_batch_stats.safetensors"))


CASES = [c["id"] for c in _fixture()[0]["cases"]]


def _case(case_id: str) -> tuple[dict, dict[str, torch.Tensor]]:
    meta, store = _fixture()
    case = next(c for c in meta["cases"] if c["id"] == case_id)
    tensors = {k: store[f"{case_id}.{k}"] for k in ("token_level_rewards", "response_mask", "advantages")}
    uids = sorted(set(case["index"]))
    tensors["group_index"] = torch.tensor([uids.index(u) for u in case["index"]], dtype=torch.int64)
    return case, tensors


def _run_config(meta: dict, case: dict) -> dict:
    """The verl trainer config a run carries: the batch size and the algorithm section."""
    return {
        "data": {"train_batch_size": meta["train_batch_size"]},
        "actor_rollout_ref": {"rollout": {"n": meta["rollout_n"]}},
        "algorithm": {"adv_estimator": case["estimator"], "gamma": case["gamma"]},
    }


def _rows(case: dict, tensors: dict, n_rows: int, seed: int) -> torch.Tensor:
    """A sample as the verl hook sends it: shuffled rows for reinforce_plus_plus (no groups needed),
    whole groups for the group estimators (the hook sends group_index only for whole groups)."""
    g = torch.Generator().manual_seed(seed)
    batch = tensors["response_mask"].shape[0]
    if case["estimator"] == "reinforce_plus_plus":
        return torch.randperm(batch, generator=g)[:n_rows]
    n = _fixture()[0]["rollout_n"]
    groups = torch.randperm(batch // n, generator=g)[: n_rows // n]
    return (groups.unsqueeze(1) * n + torch.arange(n)).flatten()


def _sample(case: dict, tensors: dict, n_rows: int) -> dict[str, torch.Tensor]:
    """An upload of ``n_rows`` responses whose own statistics differ from the whole batch's, so that
    recomputing over the sample alone (the check before) is a false mismatch. A sample can share them
    by chance (gpg: the same share of non-zero scores); those are skipped."""
    algorithm = AlgorithmConfig(adv_estimator=case["estimator"], gamma=case["gamma"])
    for seed in range(20):
        upload = _upload(tensors, _rows(case, tensors, n_rows, seed))
        if check_advantages(algorithm, upload)["scope"] == "batch_statistics":  # not exact over itself
            return upload
    raise AssertionError("no sample with other statistics than the batch's")


def _upload(tensors: dict, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The batch a client sends: the loss tensors (on-policy), a bool mask, the rewards and groups."""
    picked = {k: (v if rows is None else v[rows]) for k, v in tensors.items()}
    mask = picked["response_mask"].bool()
    gen = torch.Generator().manual_seed(3)
    old = (-torch.rand(mask.shape, generator=gen) - 0.1).to(picked["advantages"].dtype)
    return {**picked, "response_mask": mask, "log_prob": old, "old_log_prob": old.clone()}


def _audit(upload: dict, run_config: dict):
    reported = recompute(LossConfig(), **{k: upload[k] for k in CORE})
    return audit_batch(AuditBatch.validate(upload, config={}, reported=reported), run_config=run_config)


@pytest.mark.parametrize("case_id", CASES)
def test_the_whole_batch_is_checked_exactly(case_id):
    meta, _ = _fixture()
    case, tensors = _case(case_id)
    out = _audit(_upload(tensors), _run_config(meta, case))
    assert out.ok is True, out.result["explanation"]
    adv = out.advantages
    assert (adv["scope"], adv["rows"], adv["batch_size"]) == ("exact", 64, 64)
    assert "over the whole batch (64 responses)" in adv["explanation"]


@pytest.mark.parametrize("case_id", CASES)
@pytest.mark.parametrize("n_rows", [8, 16, 32])
def test_a_sample_of_the_batch_audits_ok_with_the_whole_batchs_statistics(case_id, n_rows):
    meta, _ = _fixture()
    case, tensors = _case(case_id)
    upload = _sample(case, tensors, n_rows)
    out = _audit(upload, _run_config(meta, case))
    assert out.ok is True, out.result["explanation"]
    adv = out.advantages
    assert (adv["scope"], adv["rows"], adv["batch_size"]) == ("batch_statistics", n_rows, 64)
    assert adv["exact_max_abs_err"] > 10 * ADVANTAGE_ATOL  # verl's estimator over the sample alone
    assert f"this upload holds {n_rows} of the batch's 64 responses" in adv["explanation"]
    tol = 1e-4 if case["dtype"] == "float32" else 1e-9
    assert adv["fitted"] == pytest.approx(case["batch_stats"], rel=tol)  # the whole batch's, from a part


@pytest.mark.parametrize("case_id", CASES)
def test_a_sample_is_checked_up_to_batch_statistics_when_the_batch_size_is_unknown(case_id):
    case, tensors = _case(case_id)
    upload = _sample(case, tensors, 16)
    out = _audit(upload, {"algorithm": {"adv_estimator": case["estimator"], "gamma": case["gamma"]}})
    assert out.ok is True and out.advantages["scope"] == "batch_statistics"
    assert out.advantages["batch_size"] is None
    assert "the run's config does not give the batch size" in out.advantages["explanation"]


@pytest.mark.parametrize("case_id", CASES)
def test_a_tampered_sample_is_flagged_with_the_reason(case_id):
    meta, _ = _fixture()
    case, tensors = _case(case_id)
    upload = _upload(tensors, _rows(case, tensors, 16, seed=7))
    mask = upload["response_mask"]
    row = int(torch.nonzero(upload["advantages"].abs().sum(-1) > 0)[0])  # a response with a signal
    tampered = upload["advantages"].clone()
    tampered[row] = (tampered[row] + 0.5) * mask[row]  # one response's advantages moved
    out = _audit({**upload, "advantages": tampered}, _run_config(meta, case))
    assert out.ok is False and out.advantages["ok"] is False
    assert out.advantages["scope"] == "batch_statistics" and out.advantages["max_abs_err"] > 0.05
    name = case["estimator"]
    assert (
        f"are not {name.upper()} advantages (adv_estimator={name!r}) for any batch statistics"
        in (out.result["explanation"])
    )


@pytest.mark.parametrize("case_id", CASES)
def test_sign_flipped_advantages_are_flagged(case_id):
    meta, _ = _fixture()
    case, tensors = _case(case_id)
    upload = _upload(tensors, _rows(case, tensors, 16, seed=9))
    out = _audit({**upload, "advantages": -upload["advantages"]}, _run_config(meta, case))
    assert out.ok is False and out.advantages["scope"] == "batch_statistics"


@pytest.mark.parametrize("case_id", CASES)
def test_a_rescaled_whole_batch_is_flagged_once_its_size_says_it_is_whole(case_id):
    meta, _ = _fixture()
    case, tensors = _case(case_id)
    upload = _upload(tensors)
    rescaled = {**upload, "advantages": upload["advantages"] * 1.5}
    out = _audit(rescaled, _run_config(meta, case))
    assert out.ok is False and out.advantages["scope"] == "exact"
    assert "over the whole batch (64 responses)" in out.result["explanation"]
    # without the batch size the same upload could be a part of a larger batch: checked as one, it passes
    unknown = _audit(rescaled, {"algorithm": _run_config(meta, case)["algorithm"]})
    assert unknown.ok is True and unknown.advantages["scope"] == "batch_statistics"


def test_group_estimators_are_still_checked_exactly_on_any_whole_groups():
    """GRPO normalises per group, not per batch: a sample of whole groups is checked exactly."""
    from rlvitals.analyzers import compute_advantages

    case, tensors = _case("reinforce_plus_plus_baseline.float64")
    grpo, _ = compute_advantages(
        "grpo", tensors["token_level_rewards"], tensors["response_mask"], tensors["group_index"]
    )
    upload = _upload({**tensors, "advantages": grpo}, _rows(case, tensors, 16, seed=1))
    out = check_advantages(AlgorithmConfig(adv_estimator="grpo"), upload, batch_size=64)
    assert out["ok"] is True and out["scope"] == "exact" and "fitted" not in out


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus_baseline", "gpg"])
def test_a_group_estimator_without_groups_is_skipped_with_the_reason(estimator):
    case, tensors = _case(f"{estimator}.float32")
    upload = {k: v for k, v in _sample(case, tensors, 16).items() if k != "group_index"}
    out = _audit(upload, {"algorithm": {"adv_estimator": estimator}})
    assert out.advantages["ok"] is None and "needs index" in out.advantages["skipped"]
    assert out.ok is True  # nothing to check is not a mismatch
