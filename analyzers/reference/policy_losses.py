"""verl 0.9.1's policy losses (``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``), op for op.

One open registry: every built-in registers itself with :func:`register_policy_loss` exactly as a
user's loss would; a duplicate name raises, an unknown one lists the registered names. Each entry is
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None)
-> (pg_loss, metrics)`` with verl's signature and verl's metric names (without the ``actor/`` prefix),
differentiable, in the input dtype. A loss returns exactly the metrics verl's returns: ``gpg`` none,
``kl_cov`` and ``dro`` only ``ppo_kl``, ``clip_cov`` no ``pg_clipfrac_lower``.

Tensors are ``(batch, response_len)``; ``response_mask`` is bool. ``rollout_is_weights`` (the rollout
correction's importance weights, same shape) multiplies the per-token loss before aggregation, as verl
does (``geo_mean`` turns them into one geometric-mean weight per sequence). Formulas: docs/losses.md.

Empty masks behave as in verl: ``masked_mean`` gives 0 for the diagnostics, ``agg_loss`` NaN for
token-mean and the seq-* modes; ``bypass_mode`` refuses an empty mask (verl's rollout correction does).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contract.config import LossConfig
from ..contract.registries import (  # noqa: F401  (re-exported: the registry lives in the contract layer)
    POLICY_LOSSES,
    BoundsFn,
    LossMode,
    PolicyLoss,
    PolicyLossFn,
    get_policy_loss,
    register_policy_loss,
)
from .losses import agg_loss, clipped_token_losses, kl_penalty, masked_mean

Tensor = torch.Tensor


def _info(config) -> dict[str, Any]:
    return config.global_batch_info


def _weighted(pg_losses: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


# -- vanilla PPO (Schulman et al. 2017) with dual clip (Ye et al. 2019) ---------------------------------
@register_policy_loss(LossMode.VANILLA)
def compute_policy_loss_vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``, for ``A < 0`` at most ``-A c``;
    ``r = exp(clamp(logp - logp_old, ±20))``. Metrics: pg_clipfrac, ppo_kl, pg_clipfrac_lower."""
    pg_losses, metrics = clipped_token_losses(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        clip_ratio_c=config.clip_ratio_c,
    )
    pg_losses = _weighted(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config)), metrics


# -- DPPO (arXiv:2602.04879): divergence-masked REINFORCE with a truncated, detached ratio ------------------
def _dppo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, valid
):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    clip_ratio_c = (
        config.clip_ratio_c
    )  # TIS bound (verl reads actor.clip_ratio_c; its own fallback 20 is dead)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    pos, neg = valid(prob, old_prob, log_prob, old_log_prob, config.clip_low, config.clip_high)
    valid_mask = torch.where(advantages > 0, pos, neg).detach().float()
    # l = -A * sg(min(r, c)) * logp * valid
    pg_losses = _weighted(-advantages * truncated_ratio * log_prob * valid_mask, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config))
    metrics = {
        "pg_clipfrac": masked_mean((1.0 - valid_mask).float(), response_mask).detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).float() * valid_mask, response_mask).detach(),
    }
    return pg_loss, metrics


def _tv_valid(prob, old_prob, log_prob, old_log_prob, low, high):
    # valid if pi - pi_old <= delta_high (A > 0) / >= -delta_low (A <= 0)
    return (prob - old_prob) <= high, (prob - old_prob) >= -low


def _binary_kl_valid(prob, old_prob, log_prob, old_log_prob, low, high):
    # binary KL between Bernoulli(pi_old) and Bernoulli(pi), each side bounded when it grows the divergence
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    return (binary_kl <= high) | (prob <= old_prob), (binary_kl <= low) | (prob >= old_prob)


@register_policy_loss(LossMode.DPPO_TV)
def compute_policy_loss_dppo_tv(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """DPPO-Binary-TV: tokens whose probability moved more than ``clip_ratio_low/high`` are masked."""
    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        _tv_valid,
    )


@register_policy_loss(LossMode.DPPO_KL)
def compute_policy_loss_dppo_kl(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """DPPO-Binary-KL: tokens whose binary KL exceeds ``clip_ratio_low/high`` in the bad direction are masked."""
    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        _binary_kl_valid,
    )


# -- GSPO (arXiv:2507.18071): one clipped ratio per sequence --------------------------------------------
@register_policy_loss(LossMode.GSPO)
def compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``s_i = exp(mean_t (logp - logp_old))`` (no ±20 clamp; log clamped at 10), token ratio
    ``sg(s_i) pi/sg(pi)``; ``l = max(-A s, -A clip(s, 1-eps_low, 1+eps_high))``."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - config.clip_low, 1 + config.clip_high)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config))
    metrics = {
        "pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
        "pg_clipfrac_lower": torch.tensor(0.0, device=pg_loss.device),
    }
    return pg_loss, metrics


# -- SAPO (arXiv:2511.20347): a sigmoid gate instead of a hard clip ----------------------------------------
@register_policy_loss(LossMode.SAPO, uses_agg_mode=False)
def compute_policy_loss_sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = -A * (4/tau) sigmoid(tau (r - 1))``, ``tau = tau_pos`` for ``A > 0`` else ``tau_neg``; always
    aggregated with seq-mean-token-mean (verl ignores ``loss_agg_mode`` here). Clip fractions are 0."""
    tau_pos = torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = _weighted(-gates * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **_info(config))
    zero = torch.tensor(0.0, device=pg_loss.device)
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
        "pg_clipfrac_lower": zero.clone(),
    }
    return pg_loss, metrics


# -- GPG (Chu et al. 2025): plain policy gradient --------------------------------------------------------
@register_policy_loss(LossMode.GPG)
def compute_policy_loss_gpg(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = -A logp``. No metrics (verl returns none)."""
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config)), {}


# -- Clip-Cov / KL-Cov (Cui et al. 2025, arXiv:2505.22617) -------------------------------------------------
def _clip_cov_parts(old_log_prob, log_prob, advantages, response_mask, config):
    if not config.clip_cov_ratio > 0:
        raise ValueError("clip_cov_ratio must be > 0 for loss_mode 'clip_cov'")
    negative_approx_kl = log_prob - old_log_prob  # no ±20 clamp here (verl)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    # cov_t = (A_t - mean A)(logp_t - mean logp); candidates: unclipped valid tokens with lb < cov < ub
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(config.clip_cov_ratio * response_mask.sum().item()), 1)
    candidates = torch.nonzero(
        (cov_all < config.clip_cov_ub) & (cov_all > config.clip_cov_lb) & (response_mask > 0)
    )
    return ppo_kl, pg_losses1, pg_losses2, candidates, clip_num


@register_policy_loss(LossMode.CLIP_COV, random=True, bounds=lambda *a, **k: _clip_cov_bounds(*a, **k))
def compute_policy_loss_clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """Vanilla clip (no dual clip, no ±20 clamp), then ``min(k, n)`` of the ``n`` unclipped tokens with
    ``clip_cov_lb < cov < clip_cov_ub`` drawn by ``torch.randperm`` get zero loss (``k = max(int(ratio *
    tokens), 1)``). ``pg_clipfrac`` is their share; ``pg_loss`` depends on the draw (see ``bounds``)."""
    ppo_kl, pg_losses1, pg_losses2, top_k_idx, clip_num = _clip_cov_parts(
        old_log_prob, log_prob, advantages, response_mask, config
    )
    corr = torch.ones_like(advantages)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=advantages.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config))
    return pg_loss, {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


def _clip_cov_bounds(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
) -> tuple[float, float]:
    """The smallest and largest ``pg_loss`` any ``randperm`` draw can give: the aggregation is linear
    in the token losses, so zeroing the ``k`` candidates with the largest (smallest) contribution gives
    the low (high) end. A token's contribution is its loss times its aggregation weight (the gradient
    of the linear ``agg_loss``), in float64."""
    with torch.no_grad():
        _, pg_losses1, pg_losses2, idx, clip_num = _clip_cov_parts(
            old_log_prob.detach(), log_prob.detach(), advantages.detach(), response_mask, config
        )
        full = _weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights).double()
    k = min(clip_num, len(idx))
    probe = full.clone().requires_grad_(True)
    with torch.enable_grad():
        base = agg_loss(probe, response_mask, loss_agg_mode, **_info(config))
        total = float(base.detach())
        if k == 0:
            return total, total
        (weights,) = torch.autograd.grad(base, probe)
    contrib = (weights * full)[idx[:, 0], idx[:, 1]].sort().values
    return total - float(contrib[-k:].sum()), total - float(contrib[:k].sum())


@register_policy_loss(LossMode.KL_COV)
def compute_policy_loss_kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = -A r`` (no clip), plus ``ppo_kl_coef |log r|`` on the ``max(1, int(n kl_cov_ratio))`` valid
    tokens of largest covariance ``(A - mean A)(logp - mean logp)`` (``torch.topk``). Metric: ``ppo_kl`` =
    masked mean of ``|log r|`` (not the signed KL of the other modes)."""
    if not config.kl_cov_ratio > 0:
        raise ValueError("kl_cov_ratio must be > 0 for loss_mode 'kl_cov'")
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + config.ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    if min(config.kl_cov_ratio, len(all_valid_adv)) != 0:
        cov = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov) * config.kl_cov_ratio))
        large = torch.topk(cov, k_percent_nums, largest=True).indices
        if len(large) != 0:
            large = all_valid_idx[large]
            width = advantages.shape[1]
            pg_losses[large // width, large % width] = pg_losses_kl[large // width, large % width]
    pg_losses = _weighted(pg_losses, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config))
    return pg_loss, {"ppo_kl": ppo_kl_abs.detach()}


# -- GMPO (arXiv:2507.20673): geometric mean of token ratios per sequence -------------------------------------
@register_policy_loss(LossMode.GEO_MEAN, uses_agg_mode=False)
def compute_policy_loss_geo_mean(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l_i = -mean_t(A) exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps_low, eps_high)))``,
    ``pg_loss = mean_i l_i`` over every row (empty rows count as 0): ``loss_agg_mode`` and the global
    batch info are ignored, as in verl. Clip fractions split by the advantage's sign."""
    negative_approx_kl = log_prob - old_log_prob  # no ±20 clamp (verl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -config.clip_low, config.clip_high)
    negative_approx_kl_min = sgn_advantage * torch.min(
        sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp
    )
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:  # token weights -> one geometric-mean weight per sequence
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    metrics = {
        "pg_clipfrac": masked_mean((clipped * (advantages > 0)).float(), response_mask).detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": masked_mean((clipped * (advantages < 0)).float(), response_mask).detach(),
    }
    return pg_loss, metrics


# -- DRO: policy gradient with a quadratic log-ratio penalty ------------------------------------------------
@register_policy_loss(LossMode.DRO)
def compute_policy_loss_dro(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = -(A logp - beta/2 (logp - logp_old)^2)``, ``beta = dro_beta > 0``. Metric: ppo_kl (no clamp)."""
    beta = config.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    log_ratio = log_prob - old_log_prob
    pg_losses = _weighted(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config))
    return pg_loss, {"ppo_kl": masked_mean(-log_ratio, response_mask).detach()}


# -- CISPO (MiniMax-M1, arXiv:2506.13585): clipped, detached IS weight times logp -----------------------------
@register_policy_loss(LossMode.CISPO)
def compute_policy_loss_cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = -sg(clip(r, 1-eps_low, 1+eps_high)) A logp``; ``pg_clipfrac`` = share with ``r`` outside the
    band; ``pg_clipfrac_lower`` is 0 (verl reports it for compatibility)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
    pg_losses = _weighted(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_info(config))
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), response_mask).detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": torch.tensor(0.0, device=pg_loss.device),
    }
    return pg_loss, metrics


# -- bypass mode: old_log_prob is the rollout's; PPO-clip or IS-weighted REINFORCE ------------------------------
@register_policy_loss(LossMode.BYPASS_MODE)
def compute_policy_loss_bypass_mode(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``old_log_prob`` is the rollout engine's. The rollout correction (``policy_loss.rollout_correction``:
    ``rollout_is``, thresholds, ``rollout_rs``) gives IS weights, a rejection mask and ``rollout_corr/*``
    metrics; then ``loss_type`` ``ppo_clip`` is vanilla on the rejection mask (weights not applied: the
    clip already bounds the ratio) and ``reinforce`` is ``-A logp w`` with ``ppo_kl`` vs the rollout.
    ``rollout_is_weights`` passed in are ignored, as in verl."""
    rc = config.rollout_correction_settings
    if not bool(response_mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    with torch.no_grad():
        weights, mask, rollout_metrics = _rollout_correction(log_prob, old_log_prob, response_mask, rc)
    if rc["loss_type"] == "reinforce":
        pg_losses = -advantages * log_prob if weights is None else -advantages * log_prob * weights
        pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **_info(config))
        metrics = {"ppo_kl": masked_mean(-(log_prob - old_log_prob), mask).detach()}
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config
        )
    return pg_loss, {**metrics, **rollout_metrics}


def _rollout_correction(log_prob, rollout_log_prob, response_mask, rc):
    """verl's ``compute_rollout_correction_and_rejection_mask`` via :mod:`.rollout` (its own
    module). Without it, only the settings that change nothing in the loss are accepted, and the
    ``rollout_corr/*`` metrics are left out."""
    try:
        from .rollout import rollout_correction  # type: ignore[import-not-found]
    except ImportError:
        if rc["rollout_rs"] is not None or (rc["loss_type"] == "reinforce" and rc["rollout_is"] is not None):
            raise ValueError(
                "bypass_mode with rollout_rs, or reinforce with rollout_is, needs rlvitals.analyzers.reference.rollout"
            ) from None
        return None, response_mask, {}
    weights, mask, metrics = rollout_correction(
        log_prob,
        rollout_log_prob,
        response_mask,
        rollout_is=rc["rollout_is"],
        rollout_is_threshold=rc["rollout_is_threshold"],
        rollout_is_batch_normalize=rc["rollout_is_batch_normalize"],
        rollout_rs=rc["rollout_rs"],
        rollout_rs_threshold=rc["rollout_rs_threshold"],
    )
    return weights, mask.to(torch.bool), {k: torch.as_tensor(v) for k, v in metrics.items()}


# -- verl's ppo_loss: the policy loss of config.loss_mode plus the entropy and KL terms --------------------
def ppo_loss(
    config: LossConfig,
    *,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    ref_log_prob: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor loss of verl's ``ppo_loss``: ``pg_loss - entropy_coeff * entropy_loss
    (+ kl_loss_coef * kl_loss when use_kl_loss)``; all terms share one aggregation.

    The policy loss is ``config.loss_mode``'s registered function (this module's registry);
    ``rollout_is_weights`` multiply its per-token loss. Returns ``(policy_loss, metrics)`` with detached
    scalar tensors ``pg_loss``, the loss mode's own metrics (vanilla: ``pg_clipfrac``, ``ppo_kl``,
    ``pg_clipfrac_lower``), ``policy_loss``, plus ``entropy_loss`` when ``entropy`` is given and
    ``kl_loss`` when ``ref_log_prob`` is given (added to the loss only when ``use_kl_loss``).
    """
    mask = response_mask.to(torch.bool)
    pg_loss, pg_metrics = get_policy_loss(config.loss_mode).fn(
        old_log_prob, log_prob, advantages, mask, config.loss_agg_mode, config, rollout_is_weights
    )
    metrics: dict[str, Tensor] = {"pg_loss": pg_loss.detach(), **pg_metrics}
    policy_loss = pg_loss
    info = config.global_batch_info
    if entropy is not None:
        entropy_loss = agg_loss(entropy, mask, config.loss_agg_mode, **info)
        policy_loss = policy_loss - config.entropy_coeff * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    if config.use_kl_loss and ref_log_prob is None:
        raise ValueError("ref_log_prob is required when use_kl_loss is True")
    if ref_log_prob is not None:
        kld = kl_penalty(log_prob, ref_log_prob, config.kl_loss_type)
        kl_loss = agg_loss(kld, mask, config.loss_agg_mode, **info)
        if config.use_kl_loss:
            policy_loss = policy_loss + kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = kl_loss.detach()
    metrics["policy_loss"] = policy_loss.detach()
    return policy_loss, metrics
