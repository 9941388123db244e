"""TRL loss types mapped onto verl configs: TRL's own formulas (written out here as TRL computes them)
must equal ``recompute`` under ``trl_loss_config`` on batches clear of verl's clamps."""

from __future__ import annotations

import math

import pytest
import torch
from rlvitals.analyzers import LossConfig, audit, recompute, trl_loss_config
from rlvitals.analyzers.config import AggMode
from rlvitals.analyzers.trl import TRL_DIFFERENCES


def _batch(seed: int, b: int = 8, t: int = 40, empty_rows: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    if empty_rows:
        lengths[::3] = 0
    return {
        "log_prob": logp,
        "old_log_prob": logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4,
        "advantages": torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous(),
        "response_mask": torch.arange(t)[None, :] < lengths[:, None],
        "ref_log_prob": logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3,
    }


def _trl_loss(
    t, loss_type, *, eps=0.2, eps_high=None, beta=0.0, delta=None, max_len=None, k=1, items=None, procs=1
):
    """TRL GRPOTrainer._compute_loss, transcribed (per-sequence advantages, k3 KL without clamps)."""
    mask = t["response_mask"].to(t["log_prob"].dtype)
    coef_1 = torch.exp(t["log_prob"] - t["old_log_prob"])
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + (eps if eps_high is None else eps_high))
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    adv = t["advantages"]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        d = t["ref_log_prob"] - t["log_prob"]
        per_token = per_token + beta * (torch.exp(d) - d - 1)
    if loss_type == "grpo":
        return float(((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()) / k
    if loss_type == "bnpo":
        return float((per_token * mask).sum() / mask.sum().clamp(min=1.0)) / k
    if loss_type == "dr_grpo":
        return float((per_token * mask).sum() / (per_token.size(0) * max_len)) / k
    return float((per_token * mask).sum() / (items / procs))


@pytest.mark.parametrize("empty_rows", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("k", [1, 4])
def test_trl_loss_types_equal_mapped_verl_policy_loss(empty_rows: bool, beta: float, k: int) -> None:
    t = _batch(1, empty_rows=empty_rows)
    b = t["response_mask"].shape[0]
    n = int(t["response_mask"].sum())
    cases = {
        "grpo": {"batch_size": b},
        "bnpo": {"num_tokens": n},
        "dr_grpo": {"batch_size": b, "max_completion_length": 64},
        "dapo": {"num_items_in_batch": 4 * n, "num_processes": 2},
    }
    for loss_type, extra in cases.items():
        cfg = trl_loss_config(
            loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, gradient_accumulation_steps=k, **extra
        )
        ours = recompute(cfg, **t)["policy_loss"]
        theirs = _trl_loss(
            t,
            loss_type,
            eps=0.2,
            eps_high=0.28,
            beta=beta,
            max_len=64,
            k=1 if loss_type == "dapo" else k,
            items=extra.get("num_items_in_batch"),
            procs=extra.get("num_processes", 1),
        )
        assert ours == pytest.approx(theirs, rel=1e-10, abs=1e-12), loss_type


def test_trl_delta_two_sided_clipping_is_verl_dual_clip() -> None:
    t = _batch(2)
    t["old_log_prob"] = t["log_prob"] - torch.rand_like(t["log_prob"]) * 2  # ratios up to e^2
    cfg = trl_loss_config("bnpo", delta=3.0)
    assert cfg.clip_ratio_c == 3.0
    assert recompute(cfg, **t)["pg_loss"] == pytest.approx(_trl_loss(t, "bnpo", delta=3.0), rel=1e-10)
    assert recompute(cfg, **t)["pg_clipfrac_lower"] > 0


def test_mapping_table_and_validation() -> None:
    assert trl_loss_config("grpo").loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_MEAN
    assert trl_loss_config("bnpo").loss_agg_mode is AggMode.TOKEN_MEAN
    dr = trl_loss_config("dr_grpo", max_completion_length=1024)
    assert dr.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and dr.loss_scale_factor == 1024
    dapo = trl_loss_config("dapo", num_items_in_batch=5000, num_processes=8)
    assert (dapo.loss_agg_mode, dapo.batch_num_tokens, dapo.dp_size) == (AggMode.TOKEN_MEAN, 5000, 8)
    assert trl_loss_config("grpo", beta=0.04).use_kl_loss and trl_loss_config("grpo").entropy_coeff == 0.0
    with pytest.raises(ValueError, match="loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'"):
        trl_loss_config("cispo")
    with pytest.raises(ValueError, match="max_completion_length is required"):
        trl_loss_config("dr_grpo")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        trl_loss_config("dapo")
    assert any("dual clip" in line for line in TRL_DIFFERENCES) and any(
        "±20" in line for line in TRL_DIFFERENCES
    )


def test_empty_trl_batch_is_zero_where_verl_is_nan() -> None:
    t = _batch(3)
    t["response_mask"] = torch.zeros_like(t["response_mask"])
    assert _trl_loss(t, "bnpo") == 0.0
    assert math.isnan(recompute(trl_loss_config("bnpo"), **t)["pg_loss"])


def test_audit_reads_trl_clip_ratio_name() -> None:
    t = _batch(4)
    cfg = trl_loss_config("grpo", epsilon_high=0.28, batch_size=8)
    truth = recompute(cfg, **t)
    report = audit(cfg, t, {"clip_ratio/region_mean": truth["pg_clipfrac"], "loss": 1.0})
    assert report.ok and set(report.verdicts) == {"pg_clipfrac"}
    wrong = audit(LossConfig(), t, {"clip_ratio/region_mean": truth["pg_clipfrac"]})
    assert "asymmetric clip (low 0.2, high 0.28)" in wrong.explanation
