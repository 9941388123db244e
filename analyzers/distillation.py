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

from dataclasses import dataclass

import torch

from .config import LossConfig
from .losses import agg_loss, clipped_token_losses, kl_penalty

Tensor = torch.Tensor

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass(frozen=True)
class DistillationConfig:
    """verl's ``distillation.distillation_loss`` (``DistillationLossConfig``) fields the loss reads, with
    verl's defaults; ``loss_agg_mode`` and global batch info come from the actor config."""

    loss_mode: str = "k3"
    loss_max_clamp: float | None = 10.0
    use_policy_gradient: bool = True
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        if self.loss_mode not in ESTIMATOR_MODES:
            raise ValueError(
                f"distillation loss_mode must be one of {', '.join(ESTIMATOR_MODES)} (forward_kl_topk needs "
                f"logits, not log-probs); got {self.loss_mode!r}"
            )
        if self.loss_mode == "k1" and not self.use_policy_gradient:
            raise ValueError(  # verl's DistillationLossConfig refuses it too
                "loss_mode 'k1' needs use_policy_gradient: its gradient does not depend on the teacher"
            )
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            raise ValueError(f"loss_max_clamp must be None or > 0; got {self.loss_max_clamp!r}")


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
