"""A custom policy loss and its helpers, written as a user of rlvitals would write them."""

from __future__ import annotations

import torch
from rlvitals.analyzers.reference.losses import agg_loss, masked_mean, masked_sum


def compute_policy_loss_tanh(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
):
    """``l = -A * tanh(r - 1)`` with ``r = exp(logp - logp_old)``: a bounded surrogate (verl's signature)."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    pg_losses = -advantages * torch.tanh(ratio - 1.0)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    info = config.global_batch_info
    metrics = {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)}
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **info), metrics


def token_sum_half(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    """Half the masked token sum (times dp_size, as verl's token-sum)."""
    return masked_sum(loss_mat, loss_mask) * dp_size / 2


def k1_squared(logprob, ref_logprob):
    return (logprob - ref_logprob) ** 2


def centered_outcome(token_level_rewards, response_mask, index=None, **_):
    """Each response's total reward minus the batch mean, on every valid token."""
    scores = (token_level_rewards * response_mask).sum(-1)
    adv = (scores - scores.mean()).unsqueeze(-1) * response_mask
    return adv, adv
