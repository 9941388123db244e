"""TRL 1.16's GRPOTrainer loss (``rlvitals.analyzers.reference.trl``) and its audit: properties that hold for every
loss type, validation, and explanations in TRL's option names. Exactness against the real trainer is in
``tests/client/test_client_integrations_trl_real.py`` (TRL in a side environment)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from rlvitals.analyzers import TrlLossConfig, trl_audit, trl_loss
from rlvitals.analyzers.reference.trl import TrlLossType, is_trl_config


def _batch(seed: int = 0, b: int = 6, t: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[2] = 0  # an empty row, as a fully tool-masked completion gives
    return {
        "log_prob": logp,
        "old_log_prob": logp + torch.randn(b, t, generator=g) * 0.3,
        "advantages": torch.randn(b, 1, generator=g).expand(b, t).contiguous(),
        "response_mask": torch.arange(t)[None, :] < lengths[:, None],
        "ref_log_prob": logp + torch.randn(b, t, generator=g) * 0.2,
        "entropy": torch.rand(b, t, generator=g) * 2,
    }


def _config(kind: TrlLossType, **extra) -> TrlLossConfig:
    return TrlLossConfig(loss_type=kind, beta=0.04, max_completion_length=12, num_items_in_batch=40,
                         gradient_accumulation_steps=2, steps_per_generation=4, **extra)  # fmt: skip


@pytest.mark.parametrize("kind", list(TrlLossType))
def test_garbage_in_masked_positions_changes_nothing(kind):
    config = _config(kind, entropy_bonus=True, entropy_coef=0.01, off_policy_mask_threshold=0.05)
    clean = _batch()
    dirty = {k: v.clone() for k, v in clean.items()}
    hidden = ~clean["response_mask"]
    for name in ("log_prob", "old_log_prob", "ref_log_prob", "entropy"):
        dirty[name][hidden] = 7.0
    assert trl_loss(config, **dirty) == pytest.approx(trl_loss(config, **clean), rel=1e-6, nan_ok=True)


@pytest.mark.parametrize("kind", list(TrlLossType))
def test_an_empty_micro_batch_gives_zero_loss_not_nan(kind):
    batch = _batch()
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    assert trl_loss(_config(kind), **batch)["loss"] == 0.0


def test_on_policy_grpo_is_minus_mean_advantage_and_clips_nothing():
    batch = _batch()
    batch["old_log_prob"] = batch["log_prob"].clone()
    got = trl_loss(TrlLossConfig(loss_type="grpo"), **batch)
    mask = batch["response_mask"]
    rows = mask.any(-1)
    expected = -(batch["advantages"][:, 0] * rows).sum() / mask.shape[0]  # empty rows count as 0
    assert got["loss"] == pytest.approx(float(expected), rel=1e-6)
    assert got["clip_ratio/region_mean"] == 0.0


def test_sequence_level_weights_count_sequences_in_the_clip_share():
    batch = _batch(3)
    batch["old_log_prob"] = batch["log_prob"] - 0.5  # every ratio e^0.5: clipped where A > 0
    got = trl_loss(TrlLossConfig(loss_type="grpo", importance_sampling_level="sequence"), **batch)
    positive = (batch["advantages"][:, 0] > 0) & batch["response_mask"].any(-1)
    assert got["clip_ratio/high_mean"] == pytest.approx(float(positive.sum()) / 6)


def test_bias_corrected_kl_is_the_plain_kl_times_the_ratio():
    batch = _batch(4)
    on = trl_loss(TrlLossConfig(beta=0.1, num_items_in_batch=40), **batch)["kl"]
    off = trl_loss(TrlLossConfig(beta=0.1, num_items_in_batch=40, use_bias_correction_kl=False), **batch)[
        "kl"
    ]
    assert on != pytest.approx(off)
    batch["old_log_prob"] = batch["log_prob"]
    on = trl_loss(TrlLossConfig(beta=0.1, num_items_in_batch=40), **batch)["kl"]
    off = trl_loss(TrlLossConfig(beta=0.1, num_items_in_batch=40, use_bias_correction_kl=False), **batch)[
        "kl"
    ]
    assert on == pytest.approx(off)  # ratio 1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_bias_correction_kl": False}, "use_bias_correction_kl=False"),
        ({"entropy_coef": 0.0}, "entropy_coef=0"),
        ({"steps_per_generation": 2}, "steps_per_generation=2"),
        ({"importance_sampling_level": "sequence"}, "importance_sampling_level='sequence'"),
        ({"loss_type": TrlLossType.BNPO}, "loss_type='bnpo'"),
    ],
)
def test_a_mismatch_is_explained_by_the_trl_option_that_reproduces_it(change, named):
    config = _config(TrlLossType.DAPO, entropy_bonus=True, entropy_coef=0.05)
    batch = _batch(5)
    reported = trl_loss(dataclasses.replace(config, **change), **batch)
    report = trl_audit(config, batch, {"loss": reported["loss"]})
    assert not report.ok and report.mismatched == ["loss"]
    assert named in report.explanation and "dp_size" not in report.explanation


def test_honest_numbers_agree_with_trl_named_in_the_explanation():
    config = _config(TrlLossType.GRPO)
    batch = _batch(6)
    reported = {f"train/{k}" if k == "kl" else k: v for k, v in trl_loss(config, **batch).items()}
    report = trl_audit(config, batch, reported)
    assert report.ok and "TRL 1.16" in report.explanation
    assert set(report.verdicts) >= {"loss", "kl", "clip_ratio/region_mean", "entropy"}


def test_an_unaudited_config_checks_nothing_and_says_why():
    config = TrlLossConfig(unaudited="vllm_importance_sampling_correction multiplies the loss")
    report = trl_audit(config, _batch(), {"loss": 1.0})
    assert report.ok and report.verdicts == {} and "Not audited: vllm_importance" in report.explanation
    with pytest.raises(ValueError, match="cannot be recomputed"):
        trl_loss(config, **_batch())


def test_config_round_trips_through_json_and_is_told_from_a_verl_config():
    config = _config(TrlLossType.CISPO, delta=1.5)
    data = config.to_dict()
    assert is_trl_config(data) and not is_trl_config({"loss_agg_mode": "token-mean"})
    assert TrlLossConfig.from_dict(data) == config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"loss_type": "ppo"}, "loss_type must be one of 'grpo', 'bnpo'"),
        ({"loss_type": "dr_grpo"}, "max_completion_length is required"),
        ({"loss_type": "dapo"}, "num_items_in_batch is required for loss_type 'dapo'"),
        ({"loss_type": "grpo", "importance_sampling_level": "tokens"}, "importance_sampling_level must be"),
        ({"loss_type": "grpo", "top_entropy_quantile": 1.5}, "top_entropy_quantile must be in"),
        ({"loss_type": "grpo", "gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be"),
        ({"loss_type": "grpo", "beta": math.nan}, "beta must be a finite number"),
    ],
)
def test_bad_settings_raise_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        TrlLossConfig(**fields)


def test_unknown_settings_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown TRL loss setting\(s\) \['clip_ratio'\]"):
        TrlLossConfig.from_dict({"trainer": "trl", "loss_type": "grpo", "clip_ratio": 0.2})
