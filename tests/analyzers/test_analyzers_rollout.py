"""Rollout correction, advantage estimators and distillation: worked examples, invariances, registry and
config behaviour (parity with the real verl is test_analyzers_rollout_parity.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvitals.analyzers import (
    ADV_ESTIMATORS,
    DistillationConfig,
    RolloutCorrectionConfig,
    compute_advantages,
    distillation_loss,
    register_adv_estimator,
    rollout_correction,
)
from rlvitals.analyzers.verdicts.algorithm import AlgorithmConfig, audit_rollout, check_advantages


def _pair(seed: int = 0, b: int = 4, t: int = 10, scale: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2 - 0.05
    rollout = old + scale * torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.int64)
    mask[:, 7:] = 0
    mask[1, 3:] = 0
    return old, rollout, mask


def test_token_tis_worked_example() -> None:
    old = torch.tensor([[math.log(3.0), 0.0, math.log(0.5)]], dtype=torch.float64)
    rollout = torch.zeros_like(old)
    mask = torch.ones_like(old)
    weights, kept, m = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    assert weights[0].tolist() == pytest.approx([2.0, 1.0, 0.5])
    assert torch.equal(kept, mask)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(3.5 / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.0)
    assert m["rollout_corr/kl"] == pytest.approx(-(math.log(3.0) + math.log(0.5)) / 3)


def test_icepop_zeroes_weights_outside_the_band_and_sequence_is_uses_the_row_product() -> None:
    old = torch.tensor([[math.log(3.0), 0.0, math.log(0.5)]], dtype=torch.float64)
    rollout, mask = torch.zeros_like(old), torch.ones_like(old)
    weights, _, m = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold="0.6_2.0")
    assert weights[0].tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 3)
    weights, _, _ = rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=5.0)
    assert weights[0].tolist() == pytest.approx([1.5, 1.5, 1.5])  # 3 * 1 * 0.5


def test_chained_rejection_keeps_only_what_every_option_keeps() -> None:
    old, rollout, mask = _pair(scale=0.2)
    _, alone1, _ = rollout_correction(
        old, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"
    )
    _, alone2, _ = rollout_correction(old, rollout, mask, rollout_rs="seq_max_k2", rollout_rs_threshold=0.05)
    _, both, m = rollout_correction(
        old, rollout, mask, rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.8_1.25,0.05"
    )
    assert torch.equal(both, alone1 * alone2) and both.dtype == mask.dtype
    assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert {"rollout_corr/rollout_rs_token_k1_mean", "rollout_corr/rollout_rs_seq_max_k2_seq_max"} <= set(m)


@pytest.mark.parametrize(
    "options",
    [
        {"rollout_is": "token", "rollout_is_threshold": 1.2, "rollout_is_batch_normalize": True},
        {"rollout_is": "sequence", "rollout_is_threshold": "0.2_5.0", "rollout_rs": "seq_mean_k3",
         "rollout_rs_threshold": 0.01},
        {"rollout_rs": "token_k2,seq_sum_k1", "rollout_rs_threshold": "0.02,0.5_2.0"},
    ],
)  # fmt: skip
def test_garbage_in_masked_positions_changes_nothing(options) -> None:
    old, rollout, mask = _pair(seed=3)
    w1, m1, metrics1 = rollout_correction(old, rollout, mask, **options)
    off = ~mask.bool()
    old2, rollout2 = old.masked_fill(off, -55.0), rollout.masked_fill(off, 7.0)
    w2, m2, metrics2 = rollout_correction(old2, rollout2, mask, **options)
    assert torch.equal(m1, m2)
    if w1 is not None:
        assert torch.equal(w1[mask.bool()], w2[mask.bool()])
    assert metrics1 == metrics2


def test_rollout_options_are_validated_with_the_valid_names() -> None:
    old, rollout, mask = _pair()
    with pytest.raises(ValueError, match="token_k1"):
        rollout_correction(old, rollout, mask, rollout_rs="token_k9", rollout_rs_threshold=1.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        rollout_correction(old, rollout, mask, rollout_rs="token_k2")
    with pytest.raises(ValueError, match="one per option"):
        rollout_correction(old, rollout, mask, rollout_rs="token_k2,token_k3", rollout_rs_threshold="1,2,3")
    with pytest.raises(ValueError, match="at least one valid token"):
        rollout_correction(old, rollout, torch.zeros_like(mask), rollout_is="token")
    with pytest.raises(ValueError, match="'token' or 'sequence'"):
        RolloutCorrectionConfig(rollout_is="tokens")


def test_rollout_correction_config_is_read_where_verl_keeps_it() -> None:
    section = {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": None}
    whole = {"algorithm": {"adv_estimator": "rloo", "rollout_correction": section}}
    assert RolloutCorrectionConfig.from_verl(whole) == RolloutCorrectionConfig("sequence", 3.0)
    assert RolloutCorrectionConfig.from_verl(whole["algorithm"]) == RolloutCorrectionConfig("sequence", 3.0)
    assert RolloutCorrectionConfig.from_verl(section) == RolloutCorrectionConfig("sequence", 3.0)
    assert RolloutCorrectionConfig.from_verl({"algorithm": {"gamma": 1.0}}) is None
    algorithm = AlgorithmConfig.from_verl(whole)
    assert algorithm.adv_estimator == "rloo" and algorithm.rollout_correction.rollout_is == "sequence"


def test_bypass_mode_audits_log_prob_against_the_rollout() -> None:
    _, rollout, mask = _pair()
    log_prob = rollout + 0.01
    algorithm = AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(rollout_is="token", bypass_mode=True)
    )
    tensors = {
        "log_prob": log_prob,
        "old_log_prob": rollout,
        "response_mask": mask,
        "rollout_log_probs": rollout,
    }
    _, _, metrics = rollout_correction(log_prob, rollout, mask, rollout_is="token")
    result = audit_rollout(algorithm, tensors, {"rollout_corr/kl": metrics["rollout_corr/kl"]})
    assert result["ok"] is True and result["verdicts"]["rollout_corr/kl"]["recomputed"] == pytest.approx(
        -0.01
    )
    assert (
        audit_rollout(algorithm, {k: v for k, v in tensors.items() if k != "rollout_log_probs"}, {}) is None
    )


def _rewards():
    rewards = torch.zeros(6, 4)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    return rewards, torch.ones(6, 4), ["a", "a", "a", "b", "b", "b"]


def test_rloo_and_dr_grpo_worked_examples() -> None:
    rewards, mask, index = _rewards()
    rloo, _ = compute_advantages("rloo", rewards, mask, index)
    # group a: scores 1, 0, 1 -> each minus the mean of the other two
    assert rloo[:3, 0].tolist() == pytest.approx([0.5, -1.0, 0.5])
    dr, _ = compute_advantages("grpo", rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert dr[:3, 0].tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    passk, _ = compute_advantages("grpo_passk", rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # a: the best two tie (1, 1) -> 0; b: only the best (row 3) gets r_max - r_2nd = 1
    assert passk[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])


def test_the_estimator_registry_is_open_and_strict() -> None:
    rewards, mask, index = _rewards()
    with pytest.raises(ValueError, match="valid: gpg, grpo"):
        compute_advantages("gae", rewards, mask, index)
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("rloo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="needs index"):
        compute_advantages("rloo", rewards, mask)

    @register_adv_estimator("sign_test")
    def sign(rewards, mask, index, *, gamma, epsilon, norm_adv_by_std_in_grpo):
        adv = torch.sign(rewards.sum(-1, keepdim=True) - 0.5) * mask
        return adv, adv

    try:
        adv, _ = compute_advantages("sign_test", rewards, mask, index)
        assert adv[:, 0].tolist() == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
        result = check_advantages(AlgorithmConfig(adv_estimator="sign_test"), {
            "token_level_rewards": rewards, "response_mask": mask, "advantages": adv,
            "group_index": torch.tensor([0, 0, 0, 1, 1, 1])})  # fmt: skip
        assert result["ok"] is True
    finally:
        del ADV_ESTIMATORS["sign_test"]


def test_distillation_k3_supervised_worked_example_and_guards() -> None:
    student = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    teacher = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    loss, m = distillation_loss(student, teacher, mask, config=DistillationConfig(use_policy_gradient=False))
    k3 = 0.5 - math.log(0.5) - 1  # r - log r - 1 with r = p_t / p_s = 0.5
    assert float(loss) == pytest.approx(k3 / 2) and m["distillation/loss_max"] == pytest.approx(k3)
    assert "distillation/pg_clipfrac" not in m
    with pytest.raises(ValueError, match="use_policy_gradient"):
        DistillationConfig(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="old_log_prob"):
        distillation_loss(student, teacher, mask)
    with pytest.raises(ValueError, match="valid token"):
        distillation_loss(student, teacher, torch.zeros(1, 2), old_log_prob=student)


def test_sent_is_weights_are_checked_against_the_recomputed_ones() -> None:
    old, rollout, mask = _pair(seed=5)
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.1)
    weights, _, _ = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.1)
    tensors = {"log_prob": old, "old_log_prob": old, "response_mask": mask, "rollout_log_probs": rollout}
    algorithm = AlgorithmConfig(rollout_correction=config)
    good = audit_rollout(algorithm, {**tensors, "rollout_is_weights": weights}, {})
    assert good["ok"] is True and good["sent_weights"]["ok"] is True
    untruncated = torch.exp(old - rollout) * mask  # the trainer forgot TIS
    bad = audit_rollout(algorithm, {**tensors, "rollout_is_weights": untruncated}, {})
    assert bad["ok"] is False and "rollout_is_weights differ" in bad["explanation"]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_of_a_micro_batch_agree_up_to_the_batchs_normaliser(level) -> None:
    old, rollout, mask = _pair(seed=6, b=8, scale=0.2)
    kwargs = {"rollout_is": level, "rollout_is_threshold": 1.2, "rollout_is_batch_normalize": True}
    weights, _, _ = rollout_correction(old, rollout, mask, **kwargs)  # normalised over all 8 rows
    algorithm = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(**kwargs))
    rows = slice(0, 3)  # the micro-batch a loss hook sends
    tensors = {"log_prob": old[rows], "old_log_prob": old[rows], "response_mask": mask[rows],
               "rollout_log_probs": rollout[rows]}  # fmt: skip
    good = audit_rollout(algorithm, {**tensors, "rollout_is_weights": weights[rows]}, {})
    assert good["ok"] is True and good["sent_weights"]["ok"] is True
    assert good["sent_weights"]["batch_norm_scale"] != pytest.approx(1.0)  # the micro-batch's mean differs
    whole = audit_rollout(algorithm, {**tensors, **dict(zip(tensors, (old, old, mask, rollout), strict=True)),
                                      "rollout_is_weights": weights}, {})  # fmt: skip
    assert whole["sent_weights"]["batch_norm_scale"] == pytest.approx(1.0)
    unnormalised, _, _ = rollout_correction(
        old, rollout, mask, **{**kwargs, "rollout_is_batch_normalize": False}
    )
    skewed = weights[rows].clone()
    skewed[0] = unnormalised[rows][0]  # one row not normalised: no single factor fits
    bad = audit_rollout(algorithm, {**tensors, "rollout_is_weights": skewed}, {})
    assert bad["ok"] is False and "rollout_is_weights differ" in bad["explanation"]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.01, 0.1, 1.0, 10.0]),
    level=st.sampled_from(["token", "sequence"]),
    upper=st.floats(1.01, 10.0),
    option=st.sampled_from(["token_k2", "seq_mean_k3", "seq_max_k2", "token_k1"]),
)
def test_tis_weights_stay_in_bounds_ess_in_unit_interval_and_rejection_only_removes(
    seed, scale, level, upper, option
) -> None:
    old, rollout, mask = _pair(seed=seed, scale=scale)
    weights, kept, m = rollout_correction(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=upper, rollout_rs=option,
        rollout_rs_threshold=upper if option.endswith("k1") else 0.05,
    )  # fmt: skip
    valid = mask.bool()
    assert bool((weights[valid] >= 0).all()) and bool((weights[valid] <= upper).all())
    assert bool((weights[~valid] == 0).all())
    # ESS = 1 / E[(w / (E[w] + 1e-8))^2] <= ((E[w] + 1e-8) / E[w])^2 by Jensen: at most 1 (plus float
    # rounding) unless verl's +1e-8 is not small beside the mean weight (log-prob gaps of ~10 give weights
    # of e^-10, and then verl's formula itself exceeds 1)
    mean = m["rollout_corr/rollout_is_mean"]
    bound = ((mean + 1e-8) / mean) ** 2 if mean > 0 else math.inf
    assert 0 < m["rollout_corr/rollout_is_eff_sample_size"] <= bound * (1 + 1e-5), (mean, bound)
    assert bool((kept <= mask).all())  # rejection never adds a token
    assert m["rollout_corr/chi2_token"] >= -1 and m["rollout_corr/k3_kl"] >= 0
