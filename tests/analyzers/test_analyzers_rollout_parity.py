"""Parity with the real verl 0.9.1 for rollout correction, every registered outcome advantage estimator
and on-policy distillation, on a golden fixture (no verl needed here).

golden/verl_0_9_1_rollout.{safetensors,json} were produced by golden/make_golden_rollout.py from verl's
own ``rollout_corr_helper``, ``utils.debug.metrics``, ``core_algos`` estimators and
``trainer.distillation.losses.distillation_loss``: every IS level and threshold kind (TIS, IcePop), batch
normalisation, every rejection option alone and chained, bool/int/float masks. Tolerances: float32
rtol 1e-5 / atol 1e-6, float64 rtol 1e-7; a std verl computes as sqrt(E[w^2] - E[w]^2) gets that
tolerance carried through the cancellation (``_moment_tolerance``).
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import (
    DistillationConfig,
    LossConfig,
    compute_advantages,
    distillation_loss,
    rollout_corr_metrics,
    rollout_correction,
    rollout_debug_metrics,
)
from rlvitals.analyzers.contract.rollout_config import IS_LEVELS, RS_OPTIONS
from safetensors.torch import load_file

# every test on the compiled token passes and on the torch ops (conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")

GOLDEN = Path(__file__).resolve().parent / "golden"
TOLERANCE = {"float32": {"rel": 1e-5, "abs": 1e-6}, "float64": {"rel": 1e-7, "abs": 1e-12}}


@cache
def _fixture() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1_rollout.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1_rollout.safetensors"))


def _ids(kind: str, **where) -> list[str]:
    return [c["id"] for c in _fixture()[0][kind] if all(c.get(k) == v for k, v in where.items())]


def _case(kind: str, case_id: str) -> tuple[dict, dict[str, torch.Tensor]]:
    meta, store = _fixture()
    case = next(c for c in meta[kind] if c["id"] == case_id)
    prefix = case_id + "."
    return case, {k[len(prefix) :]: v for k, v in store.items() if k.startswith(prefix)}


def _moment_tolerance(key: str, expected: dict[str, float], tol: dict[str, float]) -> dict[str, float]:
    """The tolerance for a std that verl computes as sqrt(E[w^2] - E[w]^2), carried through the formula.

    The moments themselves match to ``tol``; their difference cancels when the weights sit close to their
    mean (TIS weights near 1 with a std of 0.08 lose two digits), so the std's relative error is
    ``tol * (1 + mean^2 / std^2) / 2``. Summation order differs between CPUs (the fixture was made on
    another one), so the cancelled digits do too.
    """
    if not key.endswith("_std") or key.endswith("_seq_std"):  # the seq stds are torch.std: well conditioned
        return tol
    std, mean = expected[key], expected.get(key[: -len("std")] + "mean")
    if mean is None or not std or math.isnan(mean):
        return tol
    return {**tol, "rel": tol["rel"] * (1 + (mean / std) ** 2) / 2}


def _check(got: dict[str, float], expected: dict[str, float], tol: dict[str, float], where: str) -> None:
    assert set(got) == set(expected), f"{where}: {sorted(set(got) ^ set(expected))}"
    for key, want in expected.items():
        if math.isnan(want):
            assert math.isnan(got[key]), f"{where}: {key} should be NaN, got {got[key]}"
        else:
            assert got[key] == pytest.approx(want, **_moment_tolerance(key, expected, tol)), f"{where}: {key}"


def _close(got: torch.Tensor, want: torch.Tensor, tol: dict[str, float]) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=tol["rel"], atol=tol["abs"], equal_nan=True)


def test_the_fixture_covers_every_option() -> None:
    cases = [c for c in _fixture()[0]["rollout_cases"] if "metrics" in c]
    levels = {c["kwargs"]["rollout_is"] for c in cases}
    assert levels == {None, *IS_LEVELS}
    icepop = {c["kwargs"]["rollout_is"] for c in cases if "_" in str(c["kwargs"]["rollout_is_threshold"])}
    assert icepop >= set(IS_LEVELS)
    assert {c["kwargs"]["rollout_is"] for c in cases if c["kwargs"]["rollout_is_batch_normalize"]} >= set(
        IS_LEVELS
    )
    options = {o for c in cases if c["kwargs"]["rollout_rs"] for o in c["kwargs"]["rollout_rs"].split(",")}
    assert options == set(RS_OPTIONS)
    assert any("," in (c["kwargs"]["rollout_rs"] or "") for c in cases)
    for option in RS_OPTIONS:  # each option keeps some tokens and rejects others somewhere
        key = f"rollout_corr/rollout_rs_{option}_masked_fraction"
        assert any(0 < c["metrics"].get(key, 0) < 1 for c in cases), option
    assert any(c["metrics"].get("rollout_corr/rollout_is_ratio_fraction_high", 0) > 0 for c in cases)
    assert any(c["metrics"].get("rollout_corr/rollout_is_oob_ratio", 0) > 0 for c in cases)
    assert {c["dtype"] for c in cases} == {"float32", "float64"}
    estimators = {c["estimator"] for c in _fixture()[0]["advantage_cases"]}
    assert estimators == {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk",
                          "opo", "gpg"}  # fmt: skip


@pytest.mark.parametrize("case_id", _ids("rollout_cases"))
def test_rollout_correction_matches_verl(case_id: str) -> None:
    case, t = _case("rollout_cases", case_id)
    args = (t["old_log_prob"], t["rollout_log_prob"], t["response_mask"])
    if case.get("verl_raises"):  # IcePop zeroed every weight; verl's ESS divides by zero, and so do we
        with pytest.raises(ZeroDivisionError):
            rollout_correction(*args, **case["kwargs"])
        return
    tol = TOLERANCE[case["dtype"]]
    weights, mask, metrics = rollout_correction(*args, **case["kwargs"])
    assert torch.equal(mask, t["expected_mask"]) and mask.dtype == t["expected_mask"].dtype
    if case["weights"]:
        _close(weights, t["expected_weights"], tol)
    else:
        assert weights is None
    _check(metrics, case["metrics"], tol, f"{case_id} {case['kwargs']}")
    _check(rollout_corr_metrics(*args), case["corr_metrics"], tol, f"{case_id} corr")
    _check(rollout_debug_metrics(*args), case["debug_metrics"], tol, f"{case_id} debug")


@pytest.mark.parametrize("case_id", _ids("advantage_cases"))
def test_advantage_estimators_match_verl(case_id: str) -> None:
    case, t = _case("advantage_cases", case_id)
    tol = TOLERANCE[case["dtype"]]
    adv, ret = compute_advantages(
        case["estimator"],
        t["token_level_rewards"],
        t["response_mask"],
        case["index"],
        gamma=case["gamma"],
        norm_adv_by_std_in_grpo=case["norm_adv_by_std_in_grpo"],
    )
    _close(adv, t["expected_advantages"], tol)
    _close(ret, t.get("expected_returns", t["expected_advantages"]), tol)


@pytest.mark.parametrize("case_id", _ids("distillation_cases"))
def test_distillation_loss_matches_verl(case_id: str) -> None:
    case, t = _case("distillation_cases", case_id)
    config = DistillationConfig(
        loss_mode=case["loss_mode"],
        use_policy_gradient=case["use_policy_gradient"],
        loss_max_clamp=case["loss_max_clamp"],
    )
    loss, metrics = distillation_loss(
        t["student_log_prob"],
        t["teacher_log_prob"],
        t["response_mask"],
        config=config,
        actor=LossConfig(loss_agg_mode=case["loss_agg_mode"]),
        old_log_prob=t["old_log_prob"],
    )
    _check(metrics, case["expected"], TOLERANCE[case["dtype"]], f"{case_id} {case['loss_mode']}")
    assert float(loss) == metrics["distillation/loss"]
