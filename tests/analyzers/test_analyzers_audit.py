"""Audit: verdicts, the explanation naming the misconfiguration, counterfactuals, empty batches,
the on-policy check, and the latency budget."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from rlvitals.analyzers import AuditReport, LossConfig, audit, counterfactuals, recompute

CONTRACT_KEYS = {
    "reported",
    "recomputed",
    "verdicts",
    "explanation",
    "summary",
    "details",
    "counterfactuals",
    "on_policy_gap",
    "empty",
    "ok",
    "verdict",
    "decided_by",
    "fast_path_defect",
}


def _tensors(seed: int = 0, b: int = 16, t: int = 96, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, t, generator=g) * 3
    lengths = torch.randint(t // 8, t + 1, (b,), generator=g)
    return {
        k: (v.to(dtype) if v.is_floating_point() else v)
        for k, v in {
            "log_prob": log_prob,
            "old_log_prob": log_prob + torch.randn(b, t, generator=g) * 0.3,
            "advantages": torch.randn(b, t, generator=g),
            "response_mask": torch.arange(t)[None, :] < lengths[:, None],
            "ref_log_prob": log_prob + torch.randn(b, t, generator=g) * 0.2,
            "entropy": torch.rand(b, t, generator=g) * 2,
            "token_level_rewards": torch.zeros(b, t),  # extra HTTP keys are ignored by the audit
            "group_index": torch.arange(b) // 4,
        }.items()
    }


LOSS_KEYS = ("log_prob", "old_log_prob", "advantages", "response_mask", "ref_log_prob", "entropy")


def _rc(config: LossConfig, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    return recompute(config, **{k: v for k, v in tensors.items() if k in LOSS_KEYS})


BASE = LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=0.05)


def _audit_as_if(true_config: LossConfig, claimed: LossConfig = BASE, **kw) -> AuditReport:
    tensors = _tensors(**kw)
    reported = {f"actor/{k}" if k != "kl_loss" else k: v for k, v in _rc(true_config, tensors).items()}
    return audit(claimed, tensors, reported)


def test_matching_report_is_ok_and_serialises_to_the_contract_shape() -> None:
    report = _audit_as_if(BASE)
    assert report.ok and not report.empty and report.mismatched == []
    d = report.to_dict()
    assert set(d) == CONTRACT_KEYS
    assert set(d["reported"]) == {
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "pg_clipfrac_lower",
        "entropy_loss",
        "kl_loss",
        "policy_loss",
    }
    assert all(set(v) == {"ok", "abs_err", "rel_err"} for v in d["verdicts"].values())
    assert "match verl 0.9.1" in d["explanation"]
    json.dumps(d)  # plain python types all the way down
    assert isinstance(d["on_policy_gap"], float) and d["on_policy_gap"] > 0


@pytest.mark.parametrize(
    ("true_config", "metric", "phrase"),
    [
        (
            LossConfig(
                use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean"
            ),
            "pg_loss",
            "reported pg_loss equals seq-mean-token-mean; config says token-mean",
        ),
        (
            LossConfig(
                use_kl_loss=True,
                entropy_coeff=0.01,
                kl_loss_coef=0.05,
                loss_agg_mode="seq-mean-token-sum-norm",
            ),
            "pg_loss",
            "reported pg_loss equals seq-mean-token-sum-norm; config says token-mean",
        ),
        (
            LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=0.05, clip_ratio_high=0.28),
            "pg_clipfrac",
            "reported pg_clipfrac equals asymmetric clip (low 0.2, high 0.28); config says symmetric clip ±0.2",
        ),
        (
            LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=0.05, clip_ratio_c=1.5),
            "pg_clipfrac_lower",
            "reported pg_clipfrac_lower equals clip_ratio_c=1.5; config says clip_ratio_c=3.0",
        ),
        (
            LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=0.05, kl_loss_type="k2"),
            "kl_loss",
            "reported kl_loss equals k2; config says low_var_kl",
        ),
        (
            LossConfig(use_kl_loss=True, entropy_coeff=-0.01, kl_loss_coef=0.05),
            "policy_loss",
            "reported policy_loss equals entropy_coeff=-0.01; config says entropy_coeff=0.01",
        ),
        (
            LossConfig(use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=-0.05),
            "policy_loss",
            "reported policy_loss equals kl_loss_coef=-0.05; config says kl_loss_coef=0.05",
        ),
    ],
)
def test_explanation_names_the_config_that_reproduces_the_report(true_config, metric, phrase) -> None:
    report = _audit_as_if(true_config)
    assert not report.ok
    assert metric in report.mismatched
    assert phrase in report.alternatives[metric][0].sentence
    assert phrase[0].upper() + phrase[1:] in report.explanation


def test_dp_size_multiplier_on_local_counts_is_named() -> None:
    tensors = _tensors()
    n_tokens = int(tensors["response_mask"].sum())
    true = LossConfig(use_kl_loss=True, dp_size=8, batch_num_tokens=n_tokens, global_batch_size=16)
    report = audit(LossConfig(use_kl_loss=True), tensors, _rc(true, tensors))
    assert "reported pg_loss equals dp_size=8" in report.alternatives["pg_loss"][0].sentence
    assert report.alternatives["pg_loss"][0].changes["dp_size"] == 8


def test_local_normalisation_instead_of_global_is_named() -> None:
    tensors = _tensors()
    claimed = LossConfig(batch_num_tokens=5000, global_batch_size=64)
    report = audit(claimed, tensors, _rc(LossConfig(), tensors))
    assert "batch_num_tokens=None" in report.explanation
    assert report.alternatives["pg_loss"][0].changes["batch_num_tokens"] is None


def test_opposite_sign_ppo_kl_is_named() -> None:
    tensors = _tensors()
    truth = _rc(BASE, tensors)
    report = audit(BASE, tensors, {"ppo_kl": -truth["ppo_kl"]})
    assert "reported ppo_kl equals the opposite sign" in report.explanation.lower()


def test_clipfrac_counted_on_one_side_only_is_named() -> None:
    tensors = _tensors()
    upper_only = _rc(LossConfig(clip_ratio_low=1.0), tensors)["pg_clipfrac"]
    report = audit(LossConfig(), tensors, {"pg_clipfrac": upper_only})
    assert "upper bound" in report.alternatives["pg_clipfrac"][0].description


def test_unexplainable_mismatch_says_so_and_hints_the_implied_normaliser() -> None:
    tensors = _tensors()
    truth = _rc(LossConfig(), tensors)
    report = audit(LossConfig(), tensors, {"pg_loss": truth["pg_loss"] * 1.37 + 0.01})
    assert not report.ok and report.alternatives["pg_loss"] == []
    assert "no single alternative" in report.explanation
    assert "implies normalising by" in report.explanation


def test_small_numeric_noise_is_tolerated_and_abs_rel_errors_reported() -> None:
    tensors = _tensors()
    truth = _rc(BASE, tensors)
    noisy = {k: v * (1 + 2e-6) for k, v in truth.items()}
    report = audit(BASE, tensors, noisy)
    assert report.ok
    assert report.verdicts["pg_loss"]["rel_err"] == pytest.approx(2e-6, rel=1e-3)
    assert report.verdicts["pg_loss"]["abs_err"] == pytest.approx(abs(truth["pg_loss"]) * 2e-6, rel=1e-3)


def test_empty_batch_is_called_empty_and_nan_reports_match() -> None:
    tensors = _tensors()
    tensors["response_mask"] = torch.zeros_like(tensors["response_mask"])
    reported = _rc(BASE, tensors)
    assert math.isnan(reported["pg_loss"])
    report = audit(BASE, tensors, reported)
    assert report.empty and report.ok and report.on_policy_gap is None
    assert report.explanation.startswith("Empty batch")
    d = report.to_dict()
    assert math.isnan(d["recomputed"]["pg_loss"]) and d["verdicts"]["pg_loss"]["ok"]
    # a trainer that reports 0.0 for an empty batch disagrees with verl, and the audit says it's empty
    report = audit(BASE, tensors, {"pg_loss": 0.0})
    assert report.empty and not report.ok and "Empty batch" in report.explanation


def test_on_policy_gap_flags_rollout_actor_mismatch() -> None:
    tensors = _tensors()
    tensors["old_log_prob"] = tensors["log_prob"].clone()
    tensors["old_log_prob"][0, 0] += 0.05  # a valid token: the actor and the rollout disagree
    truth = _rc(BASE, tensors)
    report = audit(BASE, tensors, truth, on_policy=True)
    assert report.on_policy_gap == pytest.approx(0.05, rel=1e-4)
    assert not report.ok and "rollout/actor mismatch" in report.explanation
    tensors["old_log_prob"][0, 0] = tensors["log_prob"][0, 0]
    tensors["old_log_prob"][~tensors["response_mask"]] = 9.0  # padding never counts
    report = audit(BASE, tensors, _rc(BASE, tensors), on_policy=True)
    assert report.ok and report.on_policy_gap == 0.0 and "On-policy check passed" in report.explanation


def test_missing_tensors_are_noted_not_guessed() -> None:
    tensors = {k: v for k, v in _tensors().items() if k not in ("ref_log_prob", "entropy")}
    report = audit(
        BASE, tensors, {"kl_loss": 0.1, "entropy_loss": 1.0, "pg_loss": _rc(LossConfig(), tensors)["pg_loss"]}
    )
    assert report.ok and set(report.verdicts) == {"pg_loss"}
    assert "ref_log_prob was not sent" in report.explanation
    with pytest.raises(ValueError, match="tensors is missing"):
        audit(BASE, {"log_prob": tensors["log_prob"]}, {})


def test_counterfactuals_cover_modes_clips_and_estimators() -> None:
    tensors = _tensors()
    cf = counterfactuals(BASE, tensors)
    assert set(cf["pg_loss_by_agg_mode"]) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "seq-mean-token-mean",
    }
    for mode, value in cf["pg_loss_by_agg_mode"].items():
        assert value == pytest.approx(
            _rc(
                LossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.05, entropy_coeff=0.01),
                tensors,
            )["pg_loss"]
        )
    clip = cf["pg_clipfrac"]
    assert clip["configured"] == clip["symmetric ±0.2"]
    assert clip["clip-higher (low 0.2, high 0.28)"] < clip["symmetric ±0.2"]
    assert clip["upper side only"] + clip["lower side only"] == pytest.approx(clip["configured"], abs=1e-6)
    assert set(cf["kl_loss_by_type"]) == {"k1", "abs", "k2", "low_var_kl"}
    assert cf["policy_loss"]["pg_loss only"] == pytest.approx(_rc(BASE, tensors)["pg_loss"])
    json.dumps(cf)


def test_counterfactuals_with_dp_size_but_no_global_seq_count_fall_back_to_local() -> None:
    tensors = _tensors()
    cfg = LossConfig(dp_size=4, batch_num_tokens=int(tensors["response_mask"].sum()) * 4)
    cf = counterfactuals(cfg, tensors)
    assert cf["pg_loss_by_agg_mode"]["seq-mean-token-mean"] == pytest.approx(
        _rc(LossConfig(loss_agg_mode="seq-mean-token-mean"), tensors)["pg_loss"]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_audit_works_for_other_dtypes(dtype: torch.dtype) -> None:
    true = LossConfig(loss_agg_mode="seq-mean-token-mean")
    report = _audit_as_if(true, LossConfig(), dtype=dtype, b=4, t=16)
    assert "seq-mean-token-mean" in report.explanation


def test_full_audit_of_a_64x4096_batch_is_not_pathologically_slow() -> None:
    """A sanity bound (10x the 0.5 s budget): bench/recompute.py times the full audit."""
    tensors = _tensors(b=64, t=4096)
    reported = _rc(LossConfig(use_kl_loss=True, loss_agg_mode="seq-mean-token-mean"), tensors)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the budget is for one core; extra threads only contend on a busy box
    try:
        audit(BASE, tensors, reported)  # warm-up
        timings = []
        for _ in range(5):
            start = time.perf_counter()
            report = audit(BASE, tensors, reported)  # mismatches: the alternative search runs too
            timings.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert not report.ok and report.counterfactuals and report.alternatives["policy_loss"]
    assert min(timings) < 5.0, timings


def test_reported_values_must_be_numbers() -> None:
    tensors = _tensors()
    assert audit(BASE, tensors, {"pg_loss": "NaN"}).reported["pg_loss"] != 0.0  # NaN spelled as text is fine
    with pytest.raises(ValueError, match=r"reported\['actor/pg_loss'\] must be a number"):
        audit(BASE, tensors, {"actor/pg_loss": "high"})


def test_search_without_ref_log_prob_never_tries_a_kl_term() -> None:
    tensors = {k: v for k, v in _tensors().items() if k not in ("ref_log_prob",)}
    reported = _rc(LossConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01), tensors)
    report = audit(LossConfig(clip_ratio_high=0.28), tensors, reported)
    assert "reported pg_loss equals" in report.explanation.lower()
    assert "policy_loss" in report.alternatives


def test_batch_with_a_nan_token_is_audited_on_verl_semantics() -> None:
    tensors = _tensors()
    tensors["log_prob"][0, 0] = math.nan  # a valid token: pg_loss, ppo_kl, kl_loss are NaN in verl too
    true = LossConfig(
        use_kl_loss=True, entropy_coeff=0.01, kl_loss_coef=0.05, loss_agg_mode="seq-mean-token-mean"
    )
    reported = _rc(true, tensors)
    assert math.isnan(reported["pg_loss"]) and math.isfinite(reported["entropy_loss"])
    report = audit(BASE, tensors, reported)
    assert report.verdicts["pg_loss"]["ok"]  # NaN reported, NaN recomputed
    assert math.isnan(report.on_policy_gap)
    assert "Reported entropy_loss equals seq-mean-token-mean; config says token-mean" in report.explanation


# -- the reference path arbitrates ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "dro"])
def test_a_fast_path_defect_costs_time_never_a_false_alarm(monkeypatch, mode) -> None:
    from rlvitals.analyzers.fast import kernels
    from rlvitals.analyzers.reference.policy_losses import get_policy_loss

    config = LossConfig(loss_mode=mode, dro_beta=0.1 if mode == "dro" else None)
    tensors = _tensors(seed=11)
    honest = _rc(config, tensors)
    fused = kernels._FUSED[get_policy_loss(mode).fn]

    def off(batch, cfg):  # a wrong number from the fast pass, as a real defect would give
        out = fused(batch, cfg)
        return None if out is None else {**out, "pg_loss": out["pg_loss"] + 0.25}

    monkeypatch.setitem(kernels._FUSED, get_policy_loss(mode).fn, off)
    report = audit(config, tensors, honest)
    assert report.ok and report.verdict == "agree" and report.decided_by == "reference"
    assert set(report.fast_path_defect) == {"pg_loss", "policy_loss"}
    assert report.fast_path_defect["pg_loss"]["fast"] == pytest.approx(honest["pg_loss"] + 0.25)
    wrong = audit(config, tensors, {**honest, "pg_loss": honest["pg_loss"] + 0.25})
    # its policy_loss disagrees with the fast one too, so the reference decides, and the defect loses
    assert wrong.verdict == "mismatch" and wrong.decided_by == "reference"


def test_an_agreeing_fast_path_is_not_recomputed() -> None:
    tensors = _tensors(seed=12)
    report = audit(BASE, tensors, _rc(BASE, tensors))
    assert report.verdict == "agree" and report.decided_by == "fast" and report.fast_path_defect == {}
    d = report.to_dict()
    assert (d["verdict"], d["decided_by"], d["fast_path_defect"]) == ("agree", "fast", {})
