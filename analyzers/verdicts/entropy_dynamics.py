"""The entropy mechanism of policy-gradient RL, measured on audited batches (Cui et al. 2025, "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

For a softmax policy trained by (natural) policy gradient, the change of token entropy from one update to
the next is driven by the covariance between a token's log-probability and its advantage::

    H(π_{k+1}) − H(π_k)  ≈  −η · Cov_{tokens}(log π_k(a|s), A(s, a))

A positive covariance (confident tokens rewarded, unlikely ones punished) lowers entropy; a run whose
covariance stays positive and large is heading for entropy collapse before the entropy curve bends.

:func:`batch_covariance` computes that covariance from one audited batch's per-token tensors (centred over
the batch's valid tokens, float64 sums). The health rules' :class:`~rlvitals.analyzers.health.entropy_forecast.EntropyForecaster` turns a stream of those covariances and
the entropy actually observed into a step size η, a predicted entropy change per step and a predicted
trajectory (plain Python, JSON state, so the health monitor persists it). Its ``reward_ceiling_fit`` fits
the paper's empirical law R = −a·e^H + b on a run's early (entropy, reward) points and returns the reward
ceiling it implies (R at H = 0).

Estimator of η (documented in docs/health-rules.md, ``entropy_forecast``): the paper's η is the step size
of an update on the policy's logits, which an LLM's learning rate does not translate into, so η is
*estimated from the run itself*: each audited step ``t`` with covariance ``c_t`` is paired with the
entropy change observed next, ``d_t = (H_next − H_t) / (step_next − t)`` (nats per step), and η̂ is the
least-squares slope through the origin of −d on c, with exponentially decaying weights so a run whose
dynamics change is followed: η̂ = −Σ w·c·d / Σ w·c². A non-positive η̂ (entropy not moving the way the
covariance says) gives no forecast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .chunks import row_chunks


def batch_covariance(tensors: Mapping[str, Any]) -> dict[str, Any] | None:
    """Cov(log π, A) over one batch's valid tokens, with what it was computed from; ``None`` when the batch
    lacks the tensors (``advantages``, ``response_mask`` and ``old_log_prob`` or ``log_prob``) or has no
    valid token.

    The log-prob is the sampling policy's (``old_log_prob``: the policy before this update, as in the
    paper), else ``log_prob``. Advantages are verl's/TRL's per-token advantages (a per-sequence
    ``[B]`` or ``[B, 1]`` tensor is broadcast over the sequence). Non-finite tokens are left out (and
    counted). Returns ``{"cov", "tokens", "log_prob_source", "mean_log_prob", "mean_advantage",
    "entropy"}`` (``entropy``: the batch's mean token entropy when the ``entropy`` tensor came along).
    """
    import torch

    mask = tensors.get("response_mask")
    advantages = tensors.get("advantages")
    source = "old_log_prob" if "old_log_prob" in tensors else "log_prob"
    log_prob = tensors.get(source)
    if mask is None or advantages is None or log_prob is None:
        return None
    log_prob, mask, advantages = log_prob.detach(), mask.detach(), advantages.detach()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    entropy = tensors.get("entropy")
    if entropy is not None and tuple(entropy.shape) != tuple(log_prob.shape):
        entropy = None

    def chunks():
        # a few rows at a time in float64: the batch is never copied whole (an audit's memory stays
        # near the batch's own size however large it is)
        for rows in row_chunks(log_prob):
            lp = log_prob[rows].to(torch.float64)
            adv = advantages[rows].to(torch.float64).expand_as(lp)
            given = mask[rows].to(torch.bool)
            valid = given & torch.isfinite(lp) & torch.isfinite(adv)
            yield rows, lp, adv, given, valid

    n = dropped = 0
    sum_lp = sum_adv = 0.0
    for _, lp, adv, given, valid in chunks():
        n += int(valid.sum())
        dropped += int((given & ~valid).sum())
        sum_lp += float(lp[valid].sum())
        sum_adv += float(adv[valid].sum())
    if n == 0:
        return None
    mean_lp, mean_adv = sum_lp / n, sum_adv / n
    products = 0.0
    ent_sum, ent_n = 0.0, 0
    for rows, lp, adv, _, valid in chunks():
        products += float(((lp[valid] - mean_lp) * (adv[valid] - mean_adv)).sum())
        if entropy is not None:
            ent = entropy[rows].detach().to(torch.float64)
            ok = valid & torch.isfinite(ent)
            ent_sum += float(ent[ok].sum())
            ent_n += int(ok.sum())
    return {
        "cov": products / n,
        "tokens": n,
        "non_finite_tokens": dropped,
        "log_prob_source": source,
        "mean_log_prob": mean_lp,
        "mean_advantage": mean_adv,
        "entropy": ent_sum / ent_n if ent_n else None,
    }


def audit_points(run_id: int, series: list[tuple[str, int, float]], now: float) -> list[tuple]:
    """``points`` rows (``(run_id, name, step, value, flag, wall_time)``) for the series the health rules
    derived from one audit (``HealthMonitor.audit_series``: ``(name, step, value)``), finite values only."""
    return [
        (run_id, name, int(step), float(value), 0, now)
        for name, step, value in series
        if value is not None and math.isfinite(value)
    ]
