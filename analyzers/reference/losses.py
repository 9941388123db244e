"""verl 0.9.1's PPO/GRPO actor loss, op for op (differentiable), plus the fast ``recompute``.

The differentiable building blocks reproduce ``verl.trainer.ppo.core_algos`` (``agg_loss``,
``compute_policy_loss_vanilla``, ``kl_penalty``) and ``verl.workers.utils.losses.ppo_loss`` with the
same operations in the same order and dtype, so a trainer can use them as its loss and get verl's
numbers. ``recompute`` answers the same question for an audit without autograd: it goes through
:class:`rlvitals.analyzers.fast.token_batch.TokenBatch` (fused, in-place, one pass over the tokens) and falls back
to these reference ops only where the fast path could differ from verl (half precision, non-finite
values anywhere in the batch).

All tensors are ``(batch, response_len)``; ``response_mask`` is bool or 0/1 int (non-zero = valid).

Empty masks behave as in verl: ``masked_mean`` divides by ``count + 1e-8`` so ``ppo_kl`` and the clip
fractions are 0, while ``agg_loss`` divides by the (zero) token or sequence count, so ``token-mean``
and the ``seq-*`` modes give NaN (``token-sum`` gives 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..contract.config import AggMode, KLType, LossConfig
from ..contract.registries import (
    AGG_MODES,
    KL_ESTIMATORS,
    register_agg_mode,
    register_kl_estimator,
)

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "agg_loss",
    "clipped_token_losses",
    "compute_policy_loss_vanilla",
    "kl_base",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "register_agg_mode",
    "register_kl_estimator",
]

Tensor = torch.Tensor


# -- masked reductions (verl.utils.torch_functional) --------------------------------------------------
def masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is non-zero; NaN/inf at masked-out positions are dropped first."""
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(dim=axis) if axis is not None else (valid * mask).sum()


def masked_mean(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """``masked_sum / (count + 1e-8)``: an empty mask gives 0, not NaN (verl's guard)."""
    count = mask.sum(dim=axis) if axis is not None else mask.sum()
    return masked_sum(values, mask, axis) / (count + 1e-8)


# -- aggregation modes ---------------------------------------------------------------------------------
AggFn = Callable[..., Tensor]


def _need_global(name: str, dp_size: int) -> None:
    if dp_size > 1:
        raise ValueError(f"{name} (global, across data-parallel ranks) is required when dp_size > 1")


@register_agg_mode(AggMode.TOKEN_MEAN)
def _token_mean(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    # sum_{i,t} m_it l_it / (global token count) * dp_size   (dp_size undoes DDP's gradient averaging)
    if batch_num_tokens is None:
        _need_global("batch_num_tokens", dp_size)
        batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size


@register_agg_mode(AggMode.TOKEN_SUM)
def _token_sum(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    # sum_{i,t} m_it l_it * dp_size
    return masked_sum(loss_mat, loss_mask) * dp_size


def _seq_mean_token_sum(loss_mat, loss_mask, *, dp_size, global_batch_size, norm):
    # (1/N) sum_i sum_t m_it l_it * dp_size, over sequences with at least one valid token.
    # verl multiplies by the mask here without masked_sum's NaN guard: NaN at a masked position of a
    # non-empty row reaches the loss in the seq-* modes. Reproduced as-is.
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
    if global_batch_size is None:
        _need_global("global_batch_size", dp_size)
        global_batch_size = seq_mask.sum()
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if norm is not None:
        loss = loss / norm
    return loss


@register_agg_mode(AggMode.SEQ_MEAN_TOKEN_SUM)
def _seq_sum(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    return _seq_mean_token_sum(
        loss_mat, loss_mask, dp_size=dp_size, global_batch_size=global_batch_size, norm=None
    )


@register_agg_mode(AggMode.SEQ_MEAN_TOKEN_SUM_NORM)
def _seq_sum_norm(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    # seq-mean-token-sum / loss_scale_factor (Dr. GRPO); default factor = padded response_len
    norm = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _seq_mean_token_sum(
        loss_mat, loss_mask, dp_size=dp_size, global_batch_size=global_batch_size, norm=norm
    )


@register_agg_mode(AggMode.SEQ_MEAN_TOKEN_MEAN)
def _seq_mean(loss_mat, loss_mask, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    # (1/N) sum_i [ sum_t m_it l_it / (T_i + 1e-8) ] * dp_size   (every response weighs the same)
    lengths = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (lengths + 1e-8)
    seq_mask = (lengths > 0).float()
    if global_batch_size is None:
        _need_global("global_batch_size", dp_size)
        global_batch_size = seq_mask.sum()
    return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


_AGG_CAPTURE: ContextVar[list | None] = ContextVar("rlvitals_agg_capture", default=None)


@contextmanager
def capture_agg_inputs() -> Iterator[list[tuple[Tensor, Tensor, str]]]:
    """Record every ``agg_loss`` call's ``(loss_mat, loss_mask, mode)`` inside the block: a policy loss's
    token-loss matrix, so that its value under other aggregation modes is one cheap reduction away."""
    captured: list = []
    token = _AGG_CAPTURE.set(captured)
    try:
        yield captured
    finally:
        _AGG_CAPTURE.reset(token)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: AggMode | str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a ``(batch, response_len)`` loss matrix to a scalar exactly as verl's ``agg_loss``.

    Without global info (``batch_num_tokens`` / ``global_batch_size``) the micro-batch is normalised
    locally; with it, micro-batch losses add up to the mini-batch loss. ``dp_size`` multiplies the
    result to undo the gradient all-reduce average. ``loss_scale_factor`` only affects
    ``seq-mean-token-sum-norm`` (default: ``loss_mask.shape[-1]``).
    """
    key = loss_agg_mode.value if isinstance(loss_agg_mode, AggMode) else loss_agg_mode
    fn = AGG_MODES.get(key) if isinstance(key, str) else None
    if fn is None:
        allowed = ", ".join(repr(m) for m in AGG_MODES)
        raise ValueError(f"loss_agg_mode must be one of {allowed}; got {loss_agg_mode!r}")
    captured = _AGG_CAPTURE.get()
    if captured is not None:
        captured.append((loss_mat, loss_mask, key))
    return fn(
        loss_mat,
        loss_mask,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )


# -- KL estimators (http://joschu.net/blog/kl-approx.html) ------------------------------------------------
KLFn = Callable[[Tensor, Tensor], Tensor]


@register_kl_estimator("k1")
def _k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return logprob - ref_logprob  # log(pi/pi_ref): unbiased value, signed


@register_kl_estimator("abs")
def _abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return (logprob - ref_logprob).abs()


@register_kl_estimator("k2")
def _k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return 0.5 * (logprob - ref_logprob).square()  # unbiased gradient, high variance


@register_kl_estimator("k3")
def _k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    # delta = log(pi_ref/pi) clamped to +-20; k3 = e^delta - delta - 1 >= 0, clamped to +-10
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    kld = (torch.exp(kl) - kl - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


def kl_base(kl_type: KLType | str) -> tuple[str, bool]:
    """``(registered base name, straight-through?)`` of a kl_loss_type: ``"low_var_kl+"`` -> ``("k3", True)``."""
    try:
        kind = KLType(kl_type)
        return kind.base, kind.straight_through
    except ValueError:
        pass
    name = kl_type if isinstance(kl_type, str) else None
    if name is not None and name.rstrip("+") in KL_ESTIMATORS and name.count("+") <= 1:
        return name.rstrip("+"), name.endswith("+")
    allowed = ", ".join(dict.fromkeys([*(repr(m.value) for m in KLType), *(repr(k) for k in KL_ESTIMATORS)]))
    raise ValueError(f"kl_loss_type must be one of {allowed}; got {kl_type!r}")


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_type: KLType | str) -> Tensor:
    """Per-token KL estimate between the policy and the reference, ``(batch, response_len)``.

    ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``; a ``+`` suffix returns the forward
    value of that estimator with the gradient of k2 (straight-through: ``k2 - k2.detach() + f.detach()``).
    """
    base, straight_through = kl_base(kl_type)
    forward = KL_ESTIMATORS[base](logprob, ref_logprob)
    if not straight_through:
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


# -- the PPO clip objective ------------------------------------------------------------------------------
def clipped_token_losses(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token half of :func:`compute_policy_loss_vanilla`: the ``(batch, response_len)`` loss
    matrix before aggregation, and the detached diagnostics."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    # a bound past the dtype's range never binds: 1 + 1e30 ("no upper clip") would overflow float16
    high = 1 + clip_high if 1 + clip_high <= torch.finfo(ratio.dtype).max else math.inf
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }
    return pg_losses, metrics


def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: LossConfig,
    loss_agg_mode: AggMode | str | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with dual clip (Schulman et al. 2017; Ye et al. 2019, arXiv:1912.09729).

    Per token, ``r = exp(clamp(logp - logp_old, -20, 20))`` and
    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; for ``A < 0`` also ``l = min(l, -A c)``.
    Returns ``(pg_loss, metrics)``: ``pg_loss`` aggregated with ``config``'s mode and global batch info;
    ``metrics`` holds detached scalars ``pg_clipfrac`` (share of valid tokens where the clipped term
    won), ``ppo_kl`` (masked mean of ``logp_old - logp``) and ``pg_clipfrac_lower`` (share where the
    dual clip bound won; only ``A < 0`` tokens count).
    """
    pg_losses, metrics = clipped_token_losses(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        clip_ratio_c=config.clip_ratio_c,
    )
    mode = config.loss_agg_mode if loss_agg_mode is None else loss_agg_mode
    pg_loss = agg_loss(pg_losses, response_mask, mode, **config.global_batch_info)
    return pg_loss, metrics
