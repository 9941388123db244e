"""Histograms of one micro-batch for the audits page: the importance ratio and the advantages.

The importance ratio is verl's ``exp(clamp(log_prob - old_log_prob, -20, 20))`` at the valid
(``response_mask`` = 1) tokens; the clip bounds ``1 - clip_low``, ``1 + clip_high`` and the dual-clip
bound ``clip_ratio_c`` come from the batch's ``LossConfig`` (TRL: ``epsilon_low``/``epsilon_high``/``delta``)
so the page can draw them over the bars. Pure torch; the result is JSON-safe. ``audit_batch``
(``rlvitals.analyzers.contract.batch``) computes them with the audit, from the batch's parsed config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

DEFAULT_BINS = 60
# the plotted ratio range spans these quantiles (and always the clip bounds); the rest is counted
RANGE_QUANTILES = (0.002, 0.998)
_QUANTILE_LIMIT = 1 << 24  # torch.quantile's input size limit
_CLIP_FIELDS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


def _clip_bounds(config: Any) -> dict[str, float] | None:
    """The ratio's clip bounds under ``config`` (a parsed ``LossConfig`` / ``TrlLossConfig``, or a
    mapping of their fields); None when a mapping's clip fields are not valid (the audit itself
    reports that), so the histograms still show."""
    from ..contract.config import LossConfig
    from ..contract.trl_config import TrlLossConfig

    if isinstance(config, TrlLossConfig):  # TRL: no dual clip (a big bound); delta caps the ratio instead
        low, high, delta = config.epsilon_low, config.epsilon_high, config.delta
        return {"low": 1.0 - low, "high": 1.0 + high, "dual": float(delta or 1e30)}
    if isinstance(config, LossConfig):
        cfg = config
    else:
        config = config or {}
        if config.get("trainer") == "trl":
            low, high, delta = (config.get(k) for k in ("epsilon_low", "epsilon_high", "delta"))
            config = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": delta or 1e30}
        # only the clip fields: the rest of a batch's config (dp_size, token counts) does not matter here
        try:
            cfg = LossConfig(**{k: v for k, v in config.items() if k in _CLIP_FIELDS})
        except (TypeError, ValueError):
            return None
    return {"low": 1.0 - cfg.clip_low, "high": 1.0 + cfg.clip_high, "dual": float(cfg.clip_ratio_c)}


def _quantiles(x: torch.Tensor, qs: tuple[float, float]) -> tuple[float, float]:
    if x.numel() > _QUANTILE_LIMIT:
        step = math.ceil(x.numel() / _QUANTILE_LIMIT)
        x = x.sort().values[::step]
    q = torch.quantile(x, torch.tensor(qs, dtype=x.dtype))
    return float(q[0]), float(q[1])


def histogram(values: torch.Tensor, *, lo: float, hi: float, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """Counts of ``values`` (1-D, finite) in ``bins`` equal bins over ``[lo, hi]``.

    Returns ``{"edges": [bins + 1], "counts": [bins], "below", "above", "outside", "min", "max", "mean"}``;
    values outside ``[lo, hi]`` are counted in ``below`` / ``above``, never dropped silently.
    """
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    x = values.to(torch.float64)
    counts = (
        torch.histc(x, bins=bins, min=lo, max=hi) if x.numel() else torch.zeros(bins, dtype=torch.float64)
    )
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    below = int((x < lo).sum())
    above = int((x > hi).sum())
    return {
        "edges": edges.tolist(),
        "counts": [int(c) for c in counts.tolist()],
        "below": below,
        "above": above,
        "outside": below + above,
        "min": float(x.min()) if x.numel() else None,
        "max": float(x.max()) if x.numel() else None,
        "mean": float(x.mean()) if x.numel() else None,
    }


def batch_histograms(
    tensors: Mapping[str, torch.Tensor], *, config: Any = None, bins: int = DEFAULT_BINS
) -> dict[str, Any]:
    """Histograms of a batch's importance ratio and advantages over its valid tokens.

    ``tensors``: ``log_prob``, ``old_log_prob``, ``advantages``, ``response_mask``, each
    ``(batch, response_len)``; ``config``: a ``LossConfig`` / ``TrlLossConfig``, or a mapping of its
    fields (verl names), or None for defaults.
    An all-zero mask gives zero ``tokens`` and empty counts. Non-finite values are left out and
    counted in ``non_finite``.
    """
    mask = tensors["response_mask"].to(torch.bool)
    log_ratio = (tensors["log_prob"].to(torch.float64) - tensors["old_log_prob"].to(torch.float64))[mask]
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))  # verl: negative_approx_kl clamped to ±20
    advantages = tensors["advantages"].to(torch.float64)[mask]
    clip = _clip_bounds(config)

    finite_ratio = ratio[torch.isfinite(ratio)]
    finite_adv = advantages[torch.isfinite(advantages)]
    low, high = (clip["low"], clip["high"]) if clip else (0.8, 1.2)
    if finite_ratio.numel():
        q_lo, q_hi = _quantiles(finite_ratio, RANGE_QUANTILES)
        margin = 0.5 * (high - low)
        r_lo, r_hi = max(0.0, min(q_lo, low - margin)), max(q_hi, high + margin)
    else:
        r_lo, r_hi = low, high
    if finite_adv.numel():
        a_lo, a_hi = float(finite_adv.min()), float(finite_adv.max())
    else:
        a_lo, a_hi = -1.0, 1.0
    return {
        "tokens": int(mask.sum()),
        "non_finite": int(ratio.numel() - finite_ratio.numel() + advantages.numel() - finite_adv.numel()),
        "clip": clip,
        "ratio": histogram(finite_ratio, lo=r_lo, hi=r_hi, bins=bins),
        "advantages": histogram(finite_adv, lo=a_lo, hi=a_hi, bins=bins),
    }
