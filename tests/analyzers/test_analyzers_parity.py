"""Parity with the real verl 0.9.1 on a golden fixture (no verl needed here).

The fixture (golden/verl_0_9_1.{safetensors,json}) was produced by golden/make_golden.py, which runs
verl's own ``ppo_loss`` / ``kl_penalty`` / ``agg_loss`` / ``compute_grpo_outcome_advantage`` on
hundreds of random cases. Tolerances: float32 rtol 1e-5 / atol 1e-6, float64 rtol 1e-7; half precision
runs verl's own ops in its own dtype and must agree to float rounding of the final division.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from rlvitals.analyzers import LossConfig, grpo_advantages, ppo_loss, recompute
from safetensors.torch import load_file

# every test on the compiled token passes and on the torch ops (conftest.py)
pytestmark = pytest.mark.usefixtures("kernel_path")

GOLDEN = Path(__file__).resolve().parent / "golden"
TOLERANCE = {
    "float32": {"rel": 1e-5, "abs": 1e-6},
    "float64": {"rel": 1e-7, "abs": 1e-12},
    "float16": {"rel": 1e-6, "abs": 1e-7},
    "bfloat16": {"rel": 1e-6, "abs": 1e-7},
}


@cache
def _fixture() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1.safetensors"))


def _ids(kind: str) -> list[str]:
    return [case["id"] for case in _fixture()[0][kind]]


def _case(kind: str, case_id: str) -> tuple[dict, dict[str, torch.Tensor]]:
    meta, store = _fixture()
    case = next(c for c in meta[kind] if c["id"] == case_id)
    prefix = case_id + "."
    return case, {k[len(prefix) :]: v for k, v in store.items() if k.startswith(prefix)}


def _check(got: dict[str, float], expected: dict[str, float], tol: dict[str, float], where: str) -> None:
    assert set(got) == set(expected), where
    for key, want in expected.items():
        if math.isnan(want):
            assert math.isnan(got[key]), f"{where}: {key} should be NaN, got {got[key]}"
        else:
            assert got[key] == pytest.approx(want, **tol), f"{where}: {key}"


@pytest.mark.parametrize("case_id", _ids("loss_cases"))
def test_recompute_matches_verl(case_id: str) -> None:
    case, tensors = _case("loss_cases", case_id)
    cfg = LossConfig(**case["config"])
    _check(recompute(cfg, **tensors), case["expected"], TOLERANCE[case["dtype"]], f"{case_id} {case['tags']}")


@pytest.mark.parametrize("case_id", _ids("loss_cases")[::4])
def test_differentiable_ppo_loss_matches_verl(case_id: str) -> None:
    case, tensors = _case("loss_cases", case_id)
    with torch.no_grad():
        _, metrics = ppo_loss(LossConfig(**case["config"]), **tensors)
    got = {k: float(v) for k, v in metrics.items()}
    _check(got, case["expected"], TOLERANCE[case["dtype"]], case_id)


@pytest.mark.parametrize("case_id", _ids("grpo_cases"))
def test_grpo_advantages_match_verl(case_id: str) -> None:
    case, tensors = _case("grpo_cases", case_id)
    adv, ret = grpo_advantages(
        tensors["token_level_rewards"],
        tensors["response_mask"],
        case["index"],
        norm_adv_by_std_in_grpo=case["norm_adv_by_std_in_grpo"],
    )
    expected = tensors["expected_advantages"]
    assert adv.dtype == expected.dtype
    assert torch.equal(adv, expected), case_id
    assert torch.equal(ret, expected)


def test_fixture_covers_every_mode_kl_type_dtype_and_edge() -> None:
    meta, store = _fixture()
    tags = {tag for case in meta["loss_cases"] for tag in case["tags"]}
    from rlvitals.analyzers.contract.config import AggMode, KLType

    required = {f"mode:{m.value}" for m in AggMode} | {f"kl:{k.value}" for k in KLType}
    required |= {f"dtype:{d}" for d in TOLERANCE}
    required |= {
        "dp:2",
        "dp:8",
        "global:True",
        "global:False",
        "mask:ragged",
        "mask:empty",
        "mask:empty-rows",
    }
    required |= {"mask:int", "clamp:log_ratio", "clamp:k3", "clip:asymmetric", "garbage:finite"}
    required |= {"garbage:nonfinite", "expected:nan", "adv:per-sequence"}
    assert required <= tags, sorted(required - tags)
    assert len(meta["loss_cases"]) >= 400 and meta["verl_version"] == "0.9.1"
    # both clip kinds actually fire in the fixture
    assert any(c["expected"]["pg_clipfrac"] > 0 for c in meta["loss_cases"])
    assert any(c["expected"]["pg_clipfrac_lower"] > 0 for c in meta["loss_cases"])
    size = sum(p.stat().st_size for p in GOLDEN.glob("verl_0_9_1.*"))
    assert size < 5e6 and len(store) > 2000


@pytest.mark.parametrize("case_id", _ids("loss_cases")[1::6])
def test_verl_reported_numbers_pass_the_audit_and_perturbed_ones_do_not(case_id: str) -> None:
    from rlvitals.analyzers import audit

    case, tensors = _case("loss_cases", case_id)
    cfg = LossConfig(**case["config"])
    report = audit(cfg, tensors, {f"actor/{k}": v for k, v in case["expected"].items()})
    assert report.ok, report.explanation
    assert report.empty == (int(tensors["response_mask"].bool().sum()) == 0)
    finite = {k: v for k, v in case["expected"].items() if math.isfinite(v) and abs(v) > 1e-3}
    if finite:
        key = sorted(finite)[0]
        bad = audit(cfg, tensors, {key: finite[key] * 1.5 + 0.01})
        assert not bad.ok and key in bad.mismatched and key in bad.explanation


# -- every policy loss mode (golden/make_golden_modes.py) ------------------------------------------------
@cache
def _modes() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1_modes.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1_modes.safetensors"))


def _mode_case(case_id: str) -> tuple[dict, dict[str, torch.Tensor]]:
    meta, store = _modes()
    case = next(c for c in meta["cases"] if c["id"] == case_id)
    prefix = case_id + "."
    return case, {k[len(prefix) :]: v for k, v in store.items() if k.startswith(prefix)}


def _has_rollout_correction() -> bool:
    import importlib.util

    return importlib.util.find_spec("rlvitals.analyzers.reference.rollout") is not None


def _expected_here(case: dict) -> dict[str, float] | None:
    """verl's metrics, less the ``rollout_corr/*`` ones while rlvitals.analyzers.reference.rollout is
    not there (bypass_mode then reports only its policy-loss metrics); None where bypass_mode needs it."""
    expected = case["expected"]
    if case["config"]["loss_mode"] != "bypass_mode" or _has_rollout_correction():
        return expected
    rc = case["config"]["rollout_correction"]
    if rc["loss_type"] == "reinforce" and rc["rollout_is"] is not None:
        return None
    return {k: v for k, v in expected.items() if not k.startswith("rollout_corr/")}


def _recompute_case(case: dict, tensors: dict[str, torch.Tensor], fn) -> dict[str, float]:
    torch.manual_seed(case["seed"])  # clip_cov's torch.randperm draws what verl's drew
    return fn(LossConfig(**case["config"]), **tensors)


@pytest.mark.parametrize("case_id", [c["id"] for c in _modes()[0]["cases"]])
def test_every_loss_mode_matches_verl(case_id: str) -> None:
    case, tensors = _mode_case(case_id)
    expected = _expected_here(case)
    where = f"{case_id} {case['tags']}"
    if expected is None:
        with pytest.raises(ValueError, match=r"needs rlvitals\.analyzers\.rollout"):
            _recompute_case(case, tensors, recompute)
        return
    _check(_recompute_case(case, tensors, recompute), expected, TOLERANCE[case["dtype"]], where)


@pytest.mark.parametrize("case_id", [c["id"] for c in _modes()[0]["cases"]][::5])
def test_every_differentiable_loss_mode_matches_verl(case_id: str) -> None:
    case, tensors = _mode_case(case_id)
    expected = _expected_here(case)
    if expected is None:
        return
    with torch.no_grad():
        _, metrics = _recompute_case(case, tensors, ppo_loss)
    got = {k: float(v) for k, v in metrics.items()}
    _check(got, expected, TOLERANCE[case["dtype"]], case_id)


def test_mode_fixture_covers_every_loss_mode_agg_mode_dtype_weights_and_normalisation() -> None:
    from rlvitals.analyzers.contract.config import AggMode
    from rlvitals.analyzers.reference.policy_losses import LossMode

    meta, _store = _modes()
    assert meta["verl_version"] == "0.9.1"
    seen = {
        (
            *tuple(
                t.split(":", 1)[1] for t in sorted(c["tags"]) if t.split(":")[0] in ("dtype", "global", "is")
            ),
            c["config"]["loss_mode"],
            c["config"]["loss_agg_mode"],
        )
        for c in meta["cases"]
    }
    want = {
        (dtype, glob, w, mode.value, agg.value)
        for dtype in ("float32", "float64")
        for glob in ("False", "True")
        for w in ("False", "True")
        for mode in LossMode
        for agg in AggMode
    }
    assert want <= seen, sorted(want - seen)[:5]
    # what lies under the mask: every mode with garbage in the padding, in a token and a seq-mean mode
    garbage = {
        (c["config"]["loss_mode"], c["config"]["loss_agg_mode"], t)
        for c in meta["cases"]
        for t in c["tags"]
        if t.startswith("garbage:mask-")
    }
    assert garbage == {
        (mode.value, agg, f"garbage:mask-{kind}")
        for mode in LossMode
        for agg in ("token-mean", "seq-mean-token-mean")
        for kind in ("overflow", "nan")
    }
    hits = [
        c
        for c in meta["cases"]
        if c["config"]["loss_mode"] == "clip_cov" and c["expected"]["pg_clipfrac"] > 0
    ]
    assert len(hits) >= 10  # the random draw really zeroes tokens in the fixture
    assert sum(p.stat().st_size for p in GOLDEN.glob("verl_0_9_1_modes.*")) < 3e6


# -- losses that are small differences of large parts (golden/make_golden_cancel.py) ------------------------
@cache
def _cancel() -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((GOLDEN / "verl_0_9_1_cancel.json").read_text())
    return meta, load_file(str(GOLDEN / "verl_0_9_1_cancel.safetensors"))


@pytest.mark.parametrize("case_id", [c["id"] for c in _cancel()[0]["cases"]])
def test_cancelling_rows_match_verl_to_its_rounding(case_id: str) -> None:
    # verl holds each row's sum as a float32 tensor: where rows cancel, that rounding is part of the result
    meta, store = _cancel()
    case = next(c for c in meta["cases"] if c["id"] == case_id)
    tensors = {k[len(case_id) + 1 :]: v for k, v in store.items() if k.startswith(case_id + ".")}
    expected = dict(_expected_here(case))
    got = _recompute_case(case, tensors, recompute)
    # policy_loss = pg_loss - c_e entropy_loss (+ c_k kl_loss) is checked to the rounding of its parts:
    # where they cancel, 1e-5 of each part is more than 1e-5 of the difference (verl's own float32)
    cfg, tol = case["config"], TOLERANCE[case["dtype"]]
    parts = abs(expected["pg_loss"]) + abs(cfg["entropy_coeff"] * expected.get("entropy_loss", 0.0))
    parts += abs(cfg["kl_loss_coef"] * expected["kl_loss"]) if cfg["use_kl_loss"] else 0.0
    want = expected.pop("policy_loss")
    assert abs(got.pop("policy_loss") - want) <= tol["abs"] + tol["rel"] * parts, case_id
    _check(got, expected, tol, f"{case_id} {case['tags']}")


def test_cancel_fixture_covers_every_loss_mode_agg_mode_dtype_and_kind() -> None:
    from rlvitals.analyzers.contract.config import AggMode
    from rlvitals.analyzers.reference.policy_losses import LossMode

    meta, _store = _cancel()
    assert meta["verl_version"] == "0.9.1"
    seen = {
        (c["config"]["loss_mode"], c["config"]["loss_agg_mode"], c["dtype"], t)
        for c in meta["cases"]
        for t in c["tags"]
        if t.startswith("cancel:")
    }
    assert seen == {
        (mode.value, agg.value, dtype, f"cancel:{kind}")
        for mode in LossMode
        for agg in AggMode
        for dtype in ("float32", "float64")
        for kind in ("grpo", "token")
    }
    assert sum(p.stat().st_size for p in GOLDEN.glob("verl_0_9_1_cancel.*")) < 3e6
