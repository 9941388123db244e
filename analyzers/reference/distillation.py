"""On-policy distillation: verl 0.9.1's single-sample reverse-KL estimator loss (``distillation_loss``
with ``compute_distillation_loss_reverse_kl_estimator``), from the log-probs of the sampled tokens.

The student samples; the teacher scores the same tokens. Per token, ``d_t = kl_penalty(log p_student,
log p_teacher, loss_mode)`` (k1 ``= log p_s - log p_t``, abs, k2 ``= (log p_s - log p_t)^2 / 2``,
k3 ``= exp(log p_t - log p_s) - (log p_t - log p_s) - 1``, clamped to [-10, 10]); an estimate of the
reverse KL(student || teacher) (Agarwal et al. 2024, arXiv:2306.13649; Lu et al., Thinking Machines,
"On-policy distillation", 2025). Then, as verl:

- metrics before clamping: ``distillation/abs_loss`` = mean ``|d|``, ``distillation/loss_min`` /
  ``loss_max`` over valid tokens;
- ``d = clamp(d, -loss_max_clamp, loss_max_clamp)`` when ``loss_max_clamp`` is set;
- ``use_policy_gradient`` (verl's default): ``-d`` is the advantage of a vanilla PPO clip loss against
  ``old_log_prob`` (with DistillationLossConfig's clip ratios, ``clip_ratio_c`` 3.0), reported as
  ``distillation/{pg_clipfrac, ppo_kl, pg_clipfrac_lower}``; otherwise ``agg_loss(d)`` is backpropagated
  directly (supervised);
- ``distillation/loss`` is that scalar. verl's actor loss adds it to the policy loss times
  ``distillation_loss_coef`` (when ``use_task_rewards``; else times 1 and the policy loss is dropped).

``forward_kl_topk`` needs the student's logits and the teacher's top-k: not reproducible from log-probs
of the sampled tokens, so not here. All tensors ``(batch, response_len)``; an empty mask raises (verl's
``min()`` of an empty selection does too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..contract.config import LossConfig
from ..contract.distillation_config import ESTIMATOR_MODES, PREFIX, TENSOR, DistillationConfig  # noqa: F401
from .losses import agg_loss, clipped_token_losses, kl_penalty

Tensor = torch.Tensor

METRIC_RTOL = 1e-4  # as the other audits: a trainer's GPU reductions differ from ours in summation order
METRIC_ATOL = 1e-6


def distillation_loss(
    student_log_prob: Tensor,
    teacher_log_prob: Tensor,
    response_mask: Tensor,
    *,
    config: DistillationConfig | None = None,
    actor: LossConfig | None = None,
    old_log_prob: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """verl 0.9.1's distillation loss scalar and its ``distillation/*`` metrics (see module docstring).

    ``actor`` supplies ``loss_agg_mode`` and the global batch info (verl's actor config); with
    ``use_policy_gradient`` ``old_log_prob`` is required (the rollout-time student log-probs).
    """
    config = DistillationConfig() if config is None else config
    actor = LossConfig() if actor is None else actor
    if student_log_prob.shape != teacher_log_prob.shape or student_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"student_log_prob {tuple(student_log_prob.shape)}, teacher_log_prob "
            f"{tuple(teacher_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must match"
        )
    valid = response_mask.bool()
    if not bool(valid.any()):
        raise ValueError("response_mask must contain at least one valid token")
    with torch.no_grad():
        losses = kl_penalty(student_log_prob, teacher_log_prob, config.loss_mode)
        selected = losses[valid]
        metrics = {
            "distillation/abs_loss": selected.abs().mean().item(),
            "distillation/loss_min": selected.min().item(),
            "distillation/loss_max": selected.max().item(),
        }
        if config.loss_max_clamp is not None:  # the lower clamp is for k1, which can be negative
            losses = losses.clamp(min=-config.loss_max_clamp, max=config.loss_max_clamp)
        info = actor.global_batch_info
        if config.use_policy_gradient:
            if old_log_prob is None:
                raise ValueError("use_policy_gradient needs old_log_prob (the student's rollout log-probs)")
            pg_losses, pg_metrics = clipped_token_losses(
                old_log_prob,
                student_log_prob,
                -losses,
                response_mask,
                clip_low=config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio,
                clip_high=config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio,
                clip_ratio_c=3.0,
            )
            if rollout_is_weights is not None:
                pg_losses = pg_losses * rollout_is_weights
            loss = agg_loss(pg_losses, response_mask, actor.loss_agg_mode, **info)
            metrics.update({f"distillation/{k}": float(v) for k, v in pg_metrics.items()})
        else:
            loss = agg_loss(losses, response_mask, actor.loss_agg_mode, **info)
        metrics["distillation/loss"] = float(loss)
    return loss, metrics


def _verdict(reported: float, recomputed: float) -> dict[str, Any]:
    if math.isnan(reported) or math.isnan(recomputed) or math.isinf(reported) or math.isinf(recomputed):
        ok = reported == recomputed or (math.isnan(reported) and math.isnan(recomputed))
        err = 0.0 if ok else math.inf
    else:
        err = abs(reported - recomputed)
        ok = err <= METRIC_ATOL + METRIC_RTOL * abs(recomputed)
    return {"ok": bool(ok), "reported": reported, "recomputed": recomputed, "abs_err": err}


def audit_distillation(
    config: DistillationConfig,
    actor: LossConfig,
    tensors: Mapping[str, Tensor],
    reported: Mapping[str, float | None],
    *,
    policy_loss: float | None = None,
) -> dict[str, Any]:
    """Recompute verl's distillation loss from ``log_prob`` (the student), ``teacher_log_probs``,
    ``response_mask`` (the mask the actor trained on), ``old_log_prob`` and ``rollout_is_weights``, and
    check the reported ``distillation/*`` values.

    ``policy_loss``: the recomputed PPO total (pg_loss - entropy + KL terms) of the same batch; with it a
    reported ``policy_loss`` is checked as what verl's ``distillation_ppo_loss`` returns: ``policy_loss +
    distillation_loss_coef * distillation/loss`` (``use_task_rewards``), else ``distillation/loss`` alone.

    Returns ``{"ok", "config", "verdicts", "recomputed", "unexpected", "explanation"}``; ``ok`` is None
    (with ``"skipped"``) when the batch has no valid token.
    """
    out: dict[str, Any] = {"config": config.to_dict()["distillation_loss"]}
    try:
        loss, metrics = distillation_loss(
            tensors["log_prob"],
            tensors[TENSOR],
            tensors["response_mask"],
            config=config,
            actor=actor,
            old_log_prob=tensors["old_log_prob"],
            rollout_is_weights=tensors.get("rollout_is_weights"),
        )
    except ValueError as exc:  # an empty mask: verl's min() over no token raises too
        return {**out, "ok": None, "skipped": str(exc), "verdicts": {}, "unexpected": []}
    recomputed = dict(metrics)
    if policy_loss is not None:
        coef = config.distillation_loss_coef if config.use_task_rewards else 1.0
        base = policy_loss if config.use_task_rewards else 0.0
        recomputed["policy_loss"] = base + coef * float(loss)
    verdicts: dict[str, dict[str, Any]] = {}
    unexpected: list[str] = []
    for key, value in reported.items():
        name = key.removeprefix("actor/")
        if value is None or not (
            name.startswith(PREFIX) or (name == "policy_loss" and policy_loss is not None)
        ):
            continue
        if name not in recomputed:
            unexpected.append(name)
            continue
        verdicts[name] = _verdict(float(value), float(recomputed[name]))
    bad = sorted(k for k, v in verdicts.items() if not v["ok"])
    setting = (
        f"loss_mode={config.loss_mode!r}, use_policy_gradient={config.use_policy_gradient}, "
        f"loss_max_clamp={config.loss_max_clamp!r}, use_task_rewards={config.use_task_rewards}, "
        f"distillation_loss_coef={config.distillation_loss_coef:g}, loss_agg_mode={str(actor.loss_agg_mode)!r}"
    )
    parts = [
        f"{k} reported {verdicts[k]['reported']:.6g} but recomputed {verdicts[k]['recomputed']:.6g}"
        for k in bad
    ]
    if unexpected:
        parts.append(
            f"{', '.join(sorted(unexpected))} reported but not produced by this configuration: the trainer "
            "ran a different distillation loss than its config says"
        )
    ok = not parts
    if ok:
        explanation = f"{len(verdicts)} distillation metric(s) agree ({setting})."
    else:
        explanation = (
            "Distillation mismatch: " + "; ".join(parts) + f". Recomputed with {setting} from log_prob "
            "(the student) and teacher_log_probs."
        )
    return {
        **out,
        "ok": ok,
        "verdicts": verdicts,
        "recomputed": {k: float(v) for k, v in recomputed.items()},
        "unexpected": sorted(unexpected),
        "explanation": explanation,
    }
