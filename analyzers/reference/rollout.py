"""Rollout correction: verl 0.9.1's ``rollout_corr_helper``, recomputed from three tensors.

The rollout engine (vLLM/SGLang, often bf16) and the trainer (FSDP/Megatron) compute different
log-probs for the same sampled tokens. verl corrects the gap with importance-sampling (IS) weights
``rho = pi_train / pi_rollout`` and rejection sampling (RS) masks, and logs ``rollout_corr/*``
(Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025;
Liu et al., "When speed kills stability", 2025; IcePop: Ling team, 2025). Everything below is
computed from ``old_log_prob``, ``rollout_log_probs`` and ``response_mask``, all
``(batch, response_len)``, with ``log_ratio = old_log_prob - rollout_log_prob``:

- IS ``token``:    ``w_t = exp(clamp(log_ratio_t, -20, 20))``;
  IS ``sequence``: ``w_t = exp(clamp(sum_t log_ratio_t, -20, 20))`` for every token of the row.
  Threshold ``"U"`` (a number) is TIS: ``w = min(w, U)``; ``"L_U"`` is IcePop: ``w = 0`` outside ``[L, U]``.
  ``rollout_is_batch_normalize`` divides by the masked mean weight (token) or the mean per-sequence
  weight (sequence) when that mean is > 1e-8.
- RS: ``token_k1/k2/k3`` per token, ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k2/k3`` per sequence,
  ``k1 = -log_ratio``, ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``. k1 keeps
  ``log(L) <= stat <= log(U)`` (``"U"`` alone means ``L = 1/U``); the others keep ``stat <= U``. Options
  chain with commas (``"token_k1,seq_mean_k3"``: every one must pass), thresholds likewise (one shared
  or one per option).

verl runs this once per batch on the driver (``compute_rollout_correction_and_add_to_batch``) and, in
bypass mode, inside the loss. torch.distributed is not consulted: verl's batch normalisation uses a
distributed mean only when a process group is initialised, which an audit of one upload never is.

Errors: a mask without any valid token, mismatched shapes and malformed options raise ``ValueError``
(as verl does).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..contract.rollout_config import parse_is_threshold, parse_rs_thresholds, rs_options

Tensor = torch.Tensor

OffpolicyFn = Callable[[Tensor, Tensor, Tensor], dict[str, float]]
SAFETY_BOUND = 20.0  # exp(+-20): the clamp verl applies before exponentiating a log-ratio
PREFIX = "rollout_corr/"


# -- verl's masked reductions (verl.utils.torch_functional), exactly ---------------------------------------
class _Mask:
    """A response mask with its bool view, per-axis counts and float copies computed once per call
    (verl recomputes them in every ``masked_mean``; at 64x4096 that is most of the time)."""

    __slots__ = ("_counts", "tensor", "valid")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.valid = tensor.bool()
        self._counts: dict[object, Tensor] = {}  # per-axis counts, zeros and factors per dtype

    def zero(self, dtype: torch.dtype) -> Tensor:
        key = ("zero", dtype)
        if key not in self._counts:
            self._counts[key] = torch.zeros((), dtype=dtype, device=self.tensor.device)
        return self._counts[key]

    def factor(self, dtype: torch.dtype) -> Tensor:
        """The mask as a multiplier in the dtype of ``values * mask`` (verl's product's dtype)."""
        key = ("factor", dtype)
        if key not in self._counts:
            self._counts[key] = self.tensor.to(torch.promote_types(dtype, self.tensor.dtype))
        return self._counts[key]

    def count(self, axis: int | None) -> Tensor:
        if axis not in self._counts:
            self._counts[axis] = self.tensor.sum(axis=axis)
        return self._counts[axis]


def _masked_sum(values: Tensor, mask: _Mask, axis: int | None = None) -> Tensor:
    """verl's ``(where(mask, values, 0) * mask).sum(axis)``. For finite values that is ``values * mask``
    value for value (x * 1 = x, x * 0 = 0), so one multiply gives the same sum at a fraction of
    ``where``'s cost; a non-finite sum (NaN/inf under the mask, which ``where`` drops) redoes it
    verl's way."""
    if values.dtype.is_floating_point:
        total = (values * mask.factor(values.dtype)).sum(axis=axis)
        if math.isfinite(total) if axis is None else bool(torch.isfinite(total).all()):
            return total
    # a 0-dim zero of values' dtype: the same result as verl's Python 0.0, about twice as fast
    kept = torch.where(mask.valid, values, mask.zero(values.dtype))
    if torch.promote_types(kept.dtype, mask.tensor.dtype) != kept.dtype:
        kept = kept * mask.tensor  # e.g. float32 values under a float64 mask: verl's sum is float64
    # otherwise verl's ``* mask`` multiplies kept values by exactly 1 and zeros by 0: the same tensor,
    # without the mixed-dtype multiply that costs more than the rest of the reduction
    return kept.sum(axis=axis)


def _masked_mean(values: Tensor, mask: _Mask, axis: int | None = None) -> Tensor:
    return _masked_sum(values, mask, axis) / (mask.count(axis) + 1e-8)


def _reciprocal(x: float) -> float:
    """verl's ``1.0 / masked_mean(...).item()`` for the effective sample size. Where every IS weight
    is 0 (e.g. a float16 log-prob of -inf) verl 0.9.1 itself raises ZeroDivisionError there: no
    trainer reports that batch: the same error, said in words (an audit: not recomputable)."""
    if x == 0:
        raise ZeroDivisionError(
            "verl 0.9.1 divides by zero computing rollout_corr/rollout_is_eff_sample_size (every "
            "importance weight under the mask is 0): a trainer running it raises on this batch"
        )
    return 1.0 / x


def _flag(op, values: Tensor, bound) -> Tensor:
    """``op(values, bound).float()`` written straight into a float32 tensor (a bool tensor and its
    conversion cost ~5x more; the values are the same 0.0 / 1.0)."""
    return op(values, bound, out=torch.empty(values.shape, dtype=torch.float32, device=values.device))


def _as_factor(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``mask`` as the multiplier verl's ``x * mask`` uses: the same values in ``x``'s dtype when the
    product has that dtype anyway (0/1 convert exactly), which avoids a slow mixed-dtype multiply."""
    return mask.to(dtype) if torch.promote_types(dtype, mask.dtype) == dtype else mask


# -- the computation -------------------------------------------------------------------------------------
def _check(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> None:
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {tuple(old_log_prob.shape)} does not match rollout_log_prob shape "
            f"{tuple(rollout_log_prob.shape)}"
        )
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob shape {tuple(old_log_prob.shape)} does not match response_mask shape "
            f"{tuple(response_mask.shape)}"
        )
    if not bool(torch.count_nonzero(response_mask)):  # .any() on an int64 mask is ~30x slower
        raise ValueError(NO_VALID_TOKEN)


NO_VALID_TOKEN = "response_mask must contain at least one valid token (1)"


def _check_shapes(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> None:
    """:func:`_check` but the valid-token count (the compiled pass counts them, and raises the same)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        _check(old_log_prob, rollout_log_prob, response_mask)


def _is_weights(
    log_ratio: Tensor, mask: Tensor, level: str, threshold: float | str, batch_normalize: bool
) -> tuple[Tensor, dict[str, float]]:
    upper, lower = parse_is_threshold(threshold)
    mk = _Mask(mask)
    if level == "token":
        stat = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        stat = _masked_sum(log_ratio, mk, axis=-1).unsqueeze(-1)  # (batch, 1): log prod_t rho_t
        raw = torch.exp(stat.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be 'token' or 'sequence'; got {level!r}")
    raw = raw * _as_factor(mask, raw.dtype)
    if lower is None:  # TIS: truncate
        weights = raw.clamp(max=upper)
    else:  # IcePop: zero outside [lower, upper]
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, stat, mk, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _masked_mean(
            _flag(torch.lt, raw, lower).add_(_flag(torch.gt, raw, upper)), mk
        ).item()
    if batch_normalize:
        if level == "token":
            mean = _masked_mean(weights, mk)
        else:
            seq_weights = _masked_mean(weights, mk, axis=-1)
            seq_mask = (mk.count(-1) > 0).to(dtype=weights.dtype)
            mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(
    weights: Tensor, raw: Tensor, stat: Tensor, mk: _Mask, level: str, upper: float, lower: float | None
) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (before batch normalisation)."""
    lower = 1.0 / upper if lower is None else lower
    # verl compares against float32 0-dim log thresholds: a 0-dim tensor does not promote the other side
    log_upper = torch.log(torch.tensor(upper, device=weights.device))
    log_lower = torch.log(torch.tensor(lower, device=weights.device))
    m: dict[str, float] = {}
    valid = mk.valid
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(stat.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(stat.min()).item()
        m["rollout_is_mean"] = _masked_mean(weights, mk).item()
        m["rollout_is_ratio_fraction_high"] = (stat > log_upper).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (stat < log_lower).float().mean().item()
    else:
        m["rollout_is_mean"] = _masked_mean(weights, mk).item()
        m["rollout_is_ratio_fraction_high"] = _masked_mean(_flag(torch.gt, raw, upper), mk).item()
        m["rollout_is_ratio_fraction_low"] = _masked_mean(_flag(torch.lt, raw, lower), mk).item()
        m["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()
    clipped = weights.clamp(min=0.0, max=upper)
    if mk.count(None) > 1:
        mean = _masked_mean(clipped, mk)
        var = _masked_mean(clipped.square(), mk) - mean.square()
        m["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    # ESS = 1 / E[(w / E[w])^2] over valid tokens
    normalized = clipped / (_masked_mean(clipped, mk) + 1e-8)
    m["rollout_is_eff_sample_size"] = _reciprocal(_masked_mean(normalized.square(), mk).item())
    # pre-truncation raw means: a truncated mean never exceeds upper
    _is_seq_metrics(m, _masked_mean(weights, mk, axis=-1), _masked_mean(raw, mk, axis=-1), upper, lower)
    return m


def _is_seq_metrics(
    m: dict[str, float], seq_mean: Tensor, raw_seq_mean: Tensor, upper: float, lower: float
) -> None:
    m["rollout_is_seq_mean"] = seq_mean.mean().item()
    m["rollout_is_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_mean.max().item()
    m["rollout_is_seq_min"] = seq_mean.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
    m["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower).float().mean().item()


def _seq_max(values: Tensor, valid: Tensor) -> Tensor:
    neg_inf = torch.tensor(float("-inf"), device=values.device, dtype=values.dtype)
    top = values.masked_fill(~valid, neg_inf).max(dim=-1).values
    return torch.where(top == neg_inf, torch.zeros_like(top), top)


def _rejection_mask(
    log_ratio: Tensor, mask: Tensor, rollout_rs: str, threshold: float | str | None
) -> tuple[Tensor, dict[str, float]]:
    """verl's ``compute_rollout_rejection_mask``: every listed option must pass (logical AND)."""
    options = rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    if log_ratio.shape[0] == 0:
        return mask, {}
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    mk = _Mask(mask)
    valid = mk.valid
    seq_valid = mk.count(-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    m: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        lo_log = math.log(lower) if k1 else None
        hi = math.log(upper) if k1 else upper
        values = per_token[option[-2:]]
        seq_stat = None
        if option.startswith("token_"):
            stat = values
        else:
            if option.startswith("seq_sum"):
                seq_stat = _masked_sum(values, mk, axis=-1)
            elif option.startswith("seq_mean"):
                seq_stat = _masked_mean(values, mk, axis=-1)
            else:
                seq_stat = _seq_max(values, valid)
            stat = seq_stat.unsqueeze(-1).expand_as(mask)
        keep = (stat >= lo_log) & (stat <= hi) if k1 else stat <= hi
        keep_f = keep.to(dtype=log_ratio.dtype)
        combined = combined * keep_f
        m.update(
            _rs_metrics(option, stat, mk, seq_valid, seq_stat, hi, lo_log if k1 else 0.0, apply_lower=k1)
        )
        seq_keep = (~((~keep) & valid)).all(dim=-1)
        m[f"rollout_rs_{option}_masked_fraction"] = _masked_mean(1 - keep_f, mk).item()
        seq_valid_f = seq_valid.float()
        if seq_valid_f.sum() > 0:
            seq_keep_f = seq_keep.to(dtype=log_ratio.dtype)
            m[f"rollout_rs_{option}_seq_masked_fraction"] = (
                ((1.0 - seq_keep_f) * seq_valid_f).sum() / seq_valid_f.sum()
            ).item()
        else:
            m[f"rollout_rs_{option}_seq_masked_fraction"] = 0.0
    m["rollout_rs_masked_fraction"] = _masked_mean(1 - combined, mk).item()
    kept = (combined > 0.5) & valid
    m["rollout_rs_seq_masked_fraction"] = (~kept & valid).any(dim=-1).float().mean().item()
    return (_as_factor(mask, combined.dtype) * combined).to(dtype=mask.dtype), m


def _rs_metrics(
    option: str,
    stat: Tensor,
    mk: _Mask,
    seq_valid: Tensor,
    seq_stat: Tensor | None,
    upper: float,
    lower: float,
    *,
    apply_lower: bool,
) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` for one option (``upper``/``lower`` in the statistic's units)."""
    p = f"rollout_rs_{option}"
    valid = mk.valid
    seq_values = seq_stat if seq_stat is not None else _masked_mean(stat, mk, axis=-1)
    seq_values = seq_values[seq_valid]
    sequence = seq_stat is not None and seq_values.numel() > 0
    m: dict[str, float] = {f"{p}_mean": _masked_mean(stat, mk).item()}
    if sequence:
        m[f"{p}_max"] = seq_values.max().item()
        m[f"{p}_min"] = seq_values.min().item()
        m[f"{p}_fraction_high"] = (seq_values > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (seq_values < lower).float().mean().item() if apply_lower else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~valid, float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~valid, float("inf")).min().item()
        m[f"{p}_fraction_high"] = _masked_mean(_flag(torch.gt, stat, upper), mk).item()
        m[f"{p}_fraction_low"] = _masked_mean(_flag(torch.lt, stat, lower), mk).item() if apply_lower else 0.0
    if mk.count(None) > 1:
        clamped = stat.clamp(min=lower if apply_lower else 0.0, max=upper)
        mean = _masked_mean(clamped, mk)
        var = _masked_mean(clamped.square(), mk) - mean.square()
        m[f"{p}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    _rs_seq_metrics(m, p, seq_values, upper, lower, apply_lower)
    return m


def _rs_seq_metrics(
    m: dict[str, float], p: str, seq_values: Tensor, upper: float, lower: float, apply_lower: bool
) -> None:
    if seq_values.numel() > 0:
        m[f"{p}_seq_mean"] = seq_values.mean().item()
        m[f"{p}_seq_std"] = seq_values.std().item() if seq_values.numel() > 1 else 0.0
        m[f"{p}_seq_max"] = seq_values.max().item()
        m[f"{p}_seq_min"] = seq_values.min().item()
        m[f"{p}_seq_max_deviation"] = seq_values.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (seq_values > upper).float().mean().item()
        if apply_lower:
            m[f"{p}_seq_fraction_low"] = (seq_values < lower).float().mean().item()
    else:
        for key in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation"):
            m[f"{p}_{key}"] = 0.0
        m[f"{p}_seq_fraction_high"] = 0.0
        m[f"{p}_seq_fraction_low"] = 0.0


def offpolicy_metrics_reference(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: KL(pi_rollout || pi_train) estimators, perplexities, chi^2."""
    m: dict[str, float] = {}
    mk = _Mask(mask)
    mean_train = _masked_mean(log_prob, mk, axis=-1)  # (batch,)
    m["training_ppl"] = torch.exp(-mean_train).mean().item()
    m["training_log_ppl"] = (-mean_train).mean().item()
    m["kl"] = _masked_mean(rollout_log_prob - log_prob, mk).item()  # k1: E[log mu - log pi]
    log_ratio = log_prob - rollout_log_prob
    m["k3_kl"] = _masked_mean(torch.exp(log_ratio) - log_ratio - 1, mk).item()  # E[r - log r - 1]
    mean_rollout = _masked_mean(rollout_log_prob, mk, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train  # log(train_ppl / rollout_ppl) per sequence
    m["log_ppl_diff"] = diff.mean().item()
    m["log_ppl_abs_diff"] = diff.abs().mean().item()
    m["log_ppl_diff_max"] = diff.max().item()
    m["log_ppl_diff_min"] = diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    m["chi2_token"] = (_masked_mean(rho.square(), mk) - 1.0).item()  # E_mu[rho^2] - 1
    seq_log = _masked_sum(log_ratio, mk, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_log).mean() - 1.0).item()  # E[(prod rho_t)^2] - 1
    return m


def rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    offpolicy_metrics: OffpolicyFn | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """IS weights, rejection mask and ``rollout_corr/*`` metrics, as verl 0.9.1's
    ``compute_rollout_correction_and_rejection_mask`` (see the module docstring for the formulas).

    Args (all ``(batch, response_len)``): ``old_log_prob`` (the trainer's), ``rollout_log_prob`` (the
    rollout engine's), ``response_mask`` (0/1, the mask before rejection).

    Returns ``(weights or None, response_mask after rejection, metrics)``; ``weights`` is None unless
    ``rollout_is`` is set and is 0 on masked tokens; the mask keeps ``response_mask``'s dtype.
    ``offpolicy_metrics(log_prob, rollout_log_prob, mask)``: what computes verl's off-policy metrics
    (default :func:`offpolicy_metrics`; the fast layer passes its blocked pass, which gives the same).
    """
    _check_shapes(old_log_prob, rollout_log_prob, response_mask)
    with torch.no_grad():
        _check(old_log_prob, rollout_log_prob, response_mask)
        log_ratio = old_log_prob - rollout_log_prob
        metrics: dict[str, float] = {}
        weights = None
        if rollout_is is not None and rollout_is_threshold is not None:
            weights, is_metrics = _is_weights(
                log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
            )
            metrics.update(is_metrics)
        mask = response_mask.clone()
        if rollout_rs is not None:
            mask, rs_metrics = _rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
            metrics.update(rs_metrics)
        metrics.update(
            (offpolicy_metrics or offpolicy_metrics_reference)(old_log_prob, rollout_log_prob, response_mask)
        )
    return weights, mask, {PREFIX + k: v for k, v in metrics.items()}


def rollout_corr_metrics(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    offpolicy_metrics: OffpolicyFn | None = None,
) -> dict[str, float]:
    """The off-policy diagnostics alone (verl's ``compute_rollout_corr_metrics_from_logprobs``):
    ``rollout_corr/{training_ppl, training_log_ppl, kl, k3_kl, rollout_ppl, rollout_log_ppl,
    log_ppl_diff, log_ppl_abs_diff, log_ppl_diff_max, log_ppl_diff_min, ppl_ratio, chi2_token, chi2_seq}``.
    """
    _check_shapes(log_prob, rollout_log_prob, response_mask)
    with torch.no_grad():
        _check(log_prob, rollout_log_prob, response_mask)
        metrics = (offpolicy_metrics or offpolicy_metrics_reference)(
            log_prob, rollout_log_prob, response_mask
        )
        return {PREFIX + k: v for k, v in metrics.items()}


def rollout_debug_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """verl's ``calculate_debug_metrics`` (``training/*``): on token probabilities ``p = exp(log_prob)``
    of valid tokens, ``|p_actor - p_rollout|`` max / mean / std (unbiased) and the Pearson correlation
    of ``p_actor`` and ``p_rollout`` (arXiv:2506.13585). No valid token: ``valid`` 0 and NaNs.
    """
    if old_log_prob.shape != rollout_log_prob.shape or response_mask.shape != old_log_prob.shape:
        raise ValueError("old_log_prob, rollout_log_prob and response_mask must have the same shape")
    valid = response_mask.bool()
    if not bool(valid.any()):
        nan = float("nan")
        return {
            "training/rollout_probs_diff_valid": 0,
            "training/rollout_probs_diff_max": nan,
            "training/rollout_probs_diff_mean": nan,
            "training/rollout_probs_diff_std": nan,
            "training/rollout_actor_probs_pearson_corr": nan,
        }
    with torch.no_grad():
        actor = torch.masked_select(torch.exp(old_log_prob), valid)
        rollout = torch.masked_select(torch.exp(rollout_log_prob), valid)
        diff = (actor - rollout).abs()
        if actor.numel() > 1:
            pearson = torch.corrcoef(torch.stack([actor, rollout], dim=0))[0][1].item()
            std = diff.std().item()
        else:  # one token: torch warns and gives NaN for both; say NaN without the warning
            pearson = std = float("nan")
        return {
            "training/rollout_probs_diff_valid": 1,
            "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": std,
            "training/rollout_actor_probs_pearson_corr": pearson,
        }
