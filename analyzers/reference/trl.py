"""TRL 1.16 ``GRPOTrainer._compute_loss``, reproduced from the tensors one micro-batch saw.

:func:`trl_loss` follows TRL's code operation by operation in the tensors' own dtype, so on the same
device it returns what TRL returned (float32 agreement at rtol 1e-5, tested against the real trainer in
``tests/client/test_client_integrations_trl_real.py``). What it reproduces, for every ``loss_type``
(``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``, ``cispo``, ``sapo``, ``vespo``):

- the importance weight ``w = exp(log_prob - old_log_prob)`` per token, or per sequence with
  ``importance_sampling_level="sequence"`` (GSPO: ``exp(mean_t log-ratio)``, one weight per row);
- the per-token loss: clip types ``-min(w A, clip(w, 1-eps_low, 1+eps_high) A)`` with ``delta``
  capping ``w`` (two-sided clipping, Wang et al.); ``cispo`` ``-min(w, eps_high).detach() A log_prob``
  (MiniMax-M1); ``sapo`` ``-4/tau sigmoid(tau (w-1)) A`` (tau by the sign of A); ``vespo``
  ``-phi(w_seq) A log_prob`` with TRL's gamma weights;
- DeepSeek-V3.2's off-policy sequence mask (``off_policy_mask_threshold``), the high-entropy token mask
  (``top_entropy_quantile``, one process), the k3 KL to the reference times ``beta``, multiplied by ``w``
  when ``use_bias_correction_kl``;
- TRL's aggregation per loss type and its division by ``gradient_accumulation_steps`` (for
  ``dapo``/``cispo``/``vespo``: by ``num_items_in_batch / num_processes x GA / steps_per_generation``);
- the entropy bonus ``- entropy_coef x masked mean entropy / GA`` (the coefficient TRL applied on this
  call: the adaptive controller's gating is read by the client before the call);
- the metrics TRL logs from the same tensors: ``clip_ratio/{low,high,region}_mean``,
  ``clip_ratio/low_min``, ``clip_ratio/high_max``, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``kl``,
  ``entropy`` and (with an entropy bonus) ``policy_loss``; cross-process means equal these on one process.

Shapes: every tensor ``(batch, completion_len)``; ``response_mask`` is TRL's ``completion_mask`` times
its ``tool_mask``. An all-empty batch: TRL divides by ``max(count, 1)``, so the losses are 0, never NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..contract.trl_config import (  # noqa: F401  (re-exported: the loss's settings and metric names)
    CLIPPED,
    GLOBAL_TOKEN_NORM,
    LEVELS,
    LOCAL_METRICS,
    METRICS,
    TRAINER,
    TRL_LOSS_TYPES,
    TrlLossConfig,
    TrlLossType,
    is_trl_config,
)


def high_entropy_mask(entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """TRL's ``get_high_entropy_mask`` on one process: tokens whose entropy reaches the ``threshold``
    quantile of the valid tokens' entropies (``(B, T)`` bool)."""
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    masked_entropies = entropies * mask.float()
    return (masked_entropies >= entropy_threshold) & mask.bool()


def off_policy_mask(
    advantages: Tensor, log_prob: Tensor, sampling_log_prob: Tensor, mask: Tensor, threshold: float
):
    """TRL's ``get_off_policy_mask`` (DeepSeek-V3.2): keep a sequence if ``A >= 0`` or its mean
    ``log pi_old - log pi`` is at most ``threshold``. ``(B, 1)`` in ``mask``'s dtype."""
    kl_div = torch.nan_to_num(sampling_log_prob - log_prob, nan=0.0)
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg_seq_kl <= threshold)).to(dtype=mask.dtype)


def gamma_weights(advantages: Tensor, log_ratio: Tensor, mask: Tensor, c: TrlLossConfig) -> Tensor:
    """TRL's ``get_gamma_weights`` for ``vespo`` without vLLM ratios: ``phi(w) = e^lam w^k e^(-lam w)``
    of the sequence ratio ``w = exp(sum_t log-ratio)`` (clamped to ``[log 1e-8, 20]``), ``(B, 1)``."""
    lower_clamp = math.log(1e-8)
    seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    nonneg = advantages >= 0
    k_seq = torch.where(nonneg, c.vespo_k_pos, c.vespo_k_neg)
    lambda_seq = torch.where(nonneg, c.vespo_lambda_pos, c.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _nan_extreme(values: Tensor, fn) -> float:
    kept = values[~torch.isnan(values)]
    return math.nan if kept.numel() == 0 else float(fn(kept))


@torch.no_grad()
def trl_loss(
    config: TrlLossConfig,
    *,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    ref_log_prob: Tensor | None = None,
    entropy: Tensor | None = None,
) -> dict[str, float]:
    """What TRL's ``_compute_loss`` returned (``loss``) and logged for one micro-batch; see the module
    docstring. Needs ``ref_log_prob`` when ``beta != 0`` and ``entropy`` for an entropy bonus, the
    ``entropy`` metric or ``top_entropy_quantile < 1``."""
    c = config
    if c.unaudited is not None:
        raise ValueError(f"this TRL loss cannot be recomputed: {c.unaudited}")
    per_token_logps = log_prob
    mask = response_mask.to(log_prob.dtype)
    needs_entropy = c.entropy_bonus or c.top_entropy_quantile < 1.0
    if needs_entropy and entropy is None:
        raise ValueError("entropy is required for an entropy bonus or top_entropy_quantile < 1")
    if c.beta != 0.0 and ref_log_prob is None:
        raise ValueError("ref_log_prob is required when beta != 0")
    entropy_mask = (
        high_entropy_mask(entropy, mask, 1 - c.top_entropy_quantile) if c.top_entropy_quantile < 1.0 else None
    )
    adv = advantages[:, :1] if c.sequence_advantages else advantages
    if c.off_policy_mask_threshold is not None:
        keep = off_policy_mask(adv, per_token_logps, old_log_prob, mask, c.off_policy_mask_threshold)

    log_ratio = per_token_logps - old_log_prob
    if c.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:  # GSPO: one weight per sequence, the exp of its mean log-ratio
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if c.beta != 0.0:
        d = ref_log_prob - per_token_logps
        per_token_kl = torch.exp(d) - d - 1
        if c.use_bias_correction_kl:  # KL importance-sampled to the current policy
            per_token_kl = per_token_kl * coef_1

    out: dict[str, float] = {}
    if c.loss_type is TrlLossType.CISPO:
        clamped_ratios = torch.clamp(coef_1, max=c.epsilon_high)
        per_token_loss = -clamped_ratios * adv * per_token_logps
    elif c.loss_type in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - c.epsilon_low, 1 + c.epsilon_high)
        if c.delta is not None:
            coef_1 = torch.clamp(coef_1, max=c.delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    elif c.loss_type is TrlLossType.SAPO:
        temperatures = torch.where(adv > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * adv
    else:  # vespo
        phi_seq = gamma_weights(adv, log_ratio, mask, c)
        per_token_loss = -phi_seq * adv * per_token_logps
    if c.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * keep
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if c.beta != 0.0:
        per_token_loss = per_token_loss + c.beta * per_token_kl

    ga = c.gradient_accumulation_steps
    kind = c.loss_type
    if kind in (TrlLossType.GRPO, TrlLossType.SAPO):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        policy_loss, loss = loss, loss / ga
    elif kind is TrlLossType.BNPO:
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        policy_loss, loss = loss, loss / ga
    elif kind is TrlLossType.DR_GRPO:
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * c.max_completion_length)
        policy_loss, loss = loss, loss / ga
    elif kind in GLOBAL_TOKEN_NORM:  # num_items_in_batch spans the generation batch: one window's share
        items = torch.tensor(c.num_items_in_batch, device=mask.device)
        normalizer = items.clamp(min=1.0) / c.num_processes
        normalizer = normalizer * ga / c.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        policy_loss = loss
    else:  # luspo: a per-sequence sum, averaged over rows
        loss = (per_token_loss * mask).sum(-1).mean()
        policy_loss, loss = loss, loss / ga
    if c.entropy_bonus:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropy * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / ga
        loss = loss - c.entropy_coef * entropy_loss
        out["policy_loss"] = float(policy_loss)
    out["loss"] = float(loss)

    def masked_seq_mean(x: Tensor) -> Tensor:
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x: Tensor) -> float:
        if x.shape[1] == 1:  # sequence level: one value per row, empty rows included
            return float(x.sum() / torch.tensor(float(x.shape[0])).clamp(min=1.0))
        return float((x * mask).sum() / mask.sum().float().clamp(min=1.0))

    if c.beta != 0.0:
        out["kl"] = global_masked_mean(per_token_kl)
    if entropy is not None:
        out["entropy"] = global_masked_mean(entropy)
    if kind in CLIPPED:
        is_low = ((coef_1 < 1 - c.epsilon_low) & (adv < 0)).float()
        is_high = ((coef_1 > 1 + c.epsilon_high) & (adv > 0)).float()
        out["clip_ratio/low_mean"] = global_masked_mean(is_low)
        out["clip_ratio/high_mean"] = global_masked_mean(is_high)
        out["clip_ratio/region_mean"] = global_masked_mean(torch.maximum(is_low, is_high))
        out["clip_ratio/low_min"] = _nan_extreme(masked_seq_mean(is_low), torch.min)
        out["clip_ratio/high_max"] = _nan_extreme(masked_seq_mean(is_high), torch.max)
    elif kind is TrlLossType.CISPO:
        out["cispo_clip_ratio"] = global_masked_mean(((coef_1 > c.epsilon_high) & (adv > 0)).float())
    elif kind is TrlLossType.VESPO:
        out["vespo/phi_seq_mean"] = global_masked_mean(phi_seq)
    return out
