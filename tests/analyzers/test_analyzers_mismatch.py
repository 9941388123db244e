"""The mismatch report's math: worked examples, the pinned fields, invariance to what sits under the
mask, and the trend rule's causes on hand-made streams (the real runs are in the service test)."""

from __future__ import annotations

import math

import pytest
import torch
from rlvitals.analyzers import HealthMonitor
from rlvitals.analyzers.fast.rollout import rollout_correction
from rlvitals.analyzers.verdicts.mismatch import is_bounds, mismatch_report


def _batch(seed: int = 0, b: int = 6, n: int = 40):
    gen = torch.Generator().manual_seed(seed)
    train = -torch.rand(b, n, generator=gen) * 4
    rollout = train + 0.05 * torch.randn(b, n, generator=gen)
    mask = torch.ones(b, n)
    for i in range(b):
        mask[i, 10 + 5 * i :] = 0
    return train, rollout, mask


def test_worked_example_two_tokens():
    train = torch.tensor([[-1.0, -2.0, -9.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    r = mismatch_report(train, rollout, mask)
    # gaps 0.5 and -1.0 on the two valid tokens
    assert r["token_mult_prob_error"] == pytest.approx((math.exp(0.5) + math.exp(1.0)) / 2)
    assert r["gen_kl_error"] == pytest.approx(((math.exp(0.5) - 1.5) + (math.exp(-1.0) - 1 + 1.0)) / 2)
    assert r["abs_gap"] == pytest.approx({"mean": 0.75, "p50": 0.75, "p99": 0.995, "max": 1.0})
    assert r["mean_gap"] == pytest.approx(-0.25)
    assert r["tokens"] == 2 and r["sequences"] == 1
    assert r["by_position"] == pytest.approx([0.5, 1.0])  # two columns used: one bucket each
    assert r["worst"][0]["gaps"] == pytest.approx([0.5, -1.0]) and r["worst"][0]["max_at"] == 1


def test_verl_metrics_are_rollout_correction_s_own():
    train, rollout, mask = _batch()
    r = mismatch_report(train, rollout, mask, is_threshold="0.8_1.25")
    _, _, verl = rollout_correction(train, rollout, mask, rollout_is="token", rollout_is_threshold="0.8_1.25")
    for key in ("kl", "k3_kl", "chi2_token", "rollout_is_mean", "rollout_is_eff_sample_size"):
        assert r["verl"][key] == verl["rollout_corr/" + key]
    assert r["gen_kl_error"] == pytest.approx(r["verl"]["k3_kl"], rel=1e-4)  # NeMo's k3 is verl's k3_kl
    ratio = (train - rollout)[mask.bool()].double().exp()
    assert r["bounds"]["beyond_high"] == pytest.approx(float((ratio > 1.25).double().mean()))
    assert r["bounds"]["beyond_low"] == pytest.approx(float((ratio < 0.8).double().mean()))
    assert is_bounds(2.0) == (0.5, 2.0) and is_bounds(None) == (0.5, 2.0)


def test_quantiles_match_torch_quantile():
    train, rollout, mask = _batch(seed=3, b=16, n=300)
    r = mismatch_report(train, rollout, mask)
    gaps = (train.double() - rollout.double())[mask.bool()].abs()
    want = torch.quantile(gaps, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    assert [r["abs_gap"]["p50"], r["abs_gap"]["p99"]] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_garbage_under_the_mask_changes_nothing(seed):
    train, rollout, mask = _batch(seed)
    clean = mismatch_report(train, rollout, mask, group_index=torch.arange(6) // 2)
    gen = torch.Generator().manual_seed(100 + seed)
    dirty_rollout = torch.where(mask.bool(), rollout, -50 * torch.rand(rollout.shape, generator=gen))
    dirty = mismatch_report(train, dirty_rollout, mask, group_index=torch.arange(6) // 2)
    assert dirty == clean


def test_gap_that_grows_with_position_and_one_in_low_probability_tokens():
    b, n = 8, 90
    gen = torch.Generator().manual_seed(1)
    train = -torch.rand(b, n, generator=gen) * 5
    mask = torch.ones(b, n)
    growing = train + 0.01 * torch.randn(b, n, generator=gen) * torch.linspace(0.1, 3.0, n)
    r = mismatch_report(train, growing, mask)
    assert r["shape"]["position_growth"] > 3 and r["by_position"][-1] > r["by_position"][0]
    # a sampler at temperature 0.7: logits / 0.7 renormalised: low-probability tokens lose the most
    logits = torch.randn(b, n, 32, generator=gen) * 3
    tokens = torch.randint(0, 32, (b, n, 1), generator=gen)
    train_lp = torch.log_softmax(logits, -1).gather(-1, tokens).squeeze(-1)
    cold_lp = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens).squeeze(-1)
    r = mismatch_report(train_lp, cold_lp, mask)
    assert r["shape"]["low_prob_ratio"] > 3 and r["shape"]["low_prob_bias"] > 0.5


def test_empty_mask_and_bad_shapes_raise():
    train, rollout, mask = _batch()
    with pytest.raises(ValueError, match="at least one valid token"):
        mismatch_report(train, rollout, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="same"):
        mismatch_report(train, rollout[:, :-1], mask)


def _feed(series, *, lr=1e-3, extra=None):
    monitor = HealthMonitor()
    found = []
    for step, gap in enumerate(series):
        found += monitor.observe(step, {"actor/lr": lr})
        found += monitor.observe(step, {"rlvitals/mismatch/abs_gap_mean": gap, **(extra or {})})
    return [f for f in found if f.state == "firing"]


def test_rule_names_the_cause_from_the_shape():
    quiet = _feed([1e-7] * 30)
    assert quiet == []
    [steady] = _feed([0.01] * 30)
    assert steady.evidence["cause"] == "precision" and steady.severity.value == "info"
    [cache] = _feed([0.01] * 30, extra={"rlvitals/mismatch/position_growth": 2.5})
    assert cache.evidence["cause"] == "cache_or_precision"
    [sampling] = _feed(
        [0.01] * 30,
        extra={"rlvitals/mismatch/low_prob_ratio": 6.0, "rlvitals/mismatch/low_prob_bias": 0.9},
    )
    assert sampling.evidence["cause"] == "sampling_settings"
    rising = [1e-4] * 10 + [1e-4 * 1.6**k for k in range(1, 15)]
    [stale] = _feed(rising)
    assert stale.evidence["cause"] in ("stale_weights", "weight_sync") and stale.severity.value == "warning"
    [bug] = _feed(rising, lr=0.0)
    assert bug.evidence["cause"] == "pipeline_bug" and bug.severity.value == "critical"
    assert "learning rate 0" in bug.message


def test_rule_reads_the_other_frameworks_summaries():
    monitor = HealthMonitor()
    found = []
    for step in range(12):  # NeMo-RL's token_mult_prob_error climbing past its 1.05 bound
        found += monitor.observe(step, {"train/token_mult_prob_error": 1.0 + 0.01 * step, "train/lr": 1e-6})
    firing = [f for f in found if f.rule == "mismatch_trend" and f.state == "firing"]
    assert firing and {f.signal for f in firing} == {"token_mult_prob_error"}
    assert firing[-1].severity.value == "warning"  # past 1.05 it is no longer the info-level floor


def test_an_audit_of_a_batch_without_valid_tokens_says_why_it_has_no_report():
    from rlvitals.analyzers.verdicts.algorithm import AlgorithmConfig
    from rlvitals.analyzers.verdicts.batch_audit import batch_mismatch

    train, rollout, mask = _batch()
    tensors = {"old_log_prob": train, "log_prob": train, "rollout_log_probs": rollout}
    assert "token_mult_prob_error" in batch_mismatch({**tensors, "response_mask": mask}, AlgorithmConfig())
    skipped = batch_mismatch({**tensors, "response_mask": torch.zeros_like(mask)}, AlgorithmConfig())
    assert skipped == {"skipped": "ValueError: response_mask must contain at least one valid token (1)"}
