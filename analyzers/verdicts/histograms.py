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

from .chunks import CHUNK_ELEMENTS, row_chunks

DEFAULT_BINS = 60
# the plotted ratio range spans these quantiles (and always the clip bounds); the rest is counted
RANGE_QUANTILES = (0.002, 0.998)
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
    """``torch.quantile(x, qs)`` (linear interpolation) of a 1-D float64 tensor, found by partitioning
    ``x`` in place (its order changes): no sorted copy and no index tensor, whatever its size."""
    values = x.numpy()
    n = values.size
    positions = [q * (n - 1) for q in qs]
    kth = sorted({k for pos in positions for k in (math.floor(pos), math.ceil(pos))})
    values.partition(kth)
    out = []
    for pos in positions:
        lo, hi = float(values[math.floor(pos)]), float(values[math.ceil(pos)])
        out.append(lo + (hi - lo) * (pos - math.floor(pos)))
    return out[0], out[1]


class _Histogram:
    """``histogram``'s counts and summary, accumulated over chunks of values."""

    def __init__(self, lo: float, hi: float, bins: int) -> None:
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        self.lo, self.hi, self.bins = lo, hi, bins
        self.counts = torch.zeros(bins, dtype=torch.float64)
        self.below = self.above = self.n = 0
        self.total = 0.0
        self.min = self.max = None

    def add(self, values: torch.Tensor) -> None:
        x = values.to(torch.float64)
        if not x.numel():
            return
        self.counts += torch.histc(x, bins=self.bins, min=self.lo, max=self.hi)
        self.below += int((x < self.lo).sum())
        self.above += int((x > self.hi).sum())
        low, high = float(x.min()), float(x.max())
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)
        self.total += float(x.sum())
        self.n += x.numel()

    def result(self) -> dict[str, Any]:
        return {
            "edges": torch.linspace(self.lo, self.hi, self.bins + 1, dtype=torch.float64).tolist(),
            "counts": [int(c) for c in self.counts.tolist()],
            "below": self.below,
            "above": self.above,
            "outside": self.below + self.above,
            "min": self.min,
            "max": self.max,
            "mean": self.total / self.n if self.n else None,
        }


def histogram(values: torch.Tensor, *, lo: float, hi: float, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """Counts of ``values`` (1-D, finite) in ``bins`` equal bins over ``[lo, hi]``.

    Returns ``{"edges": [bins + 1], "counts": [bins], "below", "above", "outside", "min", "max", "mean"}``;
    values outside ``[lo, hi]`` are counted in ``below`` / ``above``, never dropped silently.
    """
    acc = _Histogram(lo, hi, bins)
    acc.add(values)
    return acc.result()


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
    log_prob, old_log_prob = tensors["log_prob"], tensors["old_log_prob"]
    mask, advantages = tensors["response_mask"], tensors["advantages"]
    clip = _clip_bounds(config)
    low, high = (clip["low"], clip["high"]) if clip else (0.8, 1.2)
    # a few rows at a time (no float64 copy of the whole batch): the finite ratios of the valid tokens
    # go into one buffer (the quantiles need them all); the advantages are only counted, in two passes
    tokens = sum(int(mask[rows].to(torch.bool).sum()) for rows in row_chunks(mask))
    ratios = torch.empty(tokens, dtype=torch.float64)
    kept = non_finite = 0
    a_lo = a_hi = None
    for rows in row_chunks(log_prob):
        valid = mask[rows].to(torch.bool)
        log_ratio = (log_prob[rows].to(torch.float64) - old_log_prob[rows].to(torch.float64))[valid]
        ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))  # verl: negative_approx_kl clamped to ±20
        ratio = ratio[torch.isfinite(ratio)]
        ratios[kept : kept + ratio.numel()] = ratio
        kept += ratio.numel()
        adv = advantages[rows].to(torch.float64)[valid]
        finite_adv = adv[torch.isfinite(adv)]
        non_finite += log_ratio.numel() - ratio.numel() + adv.numel() - finite_adv.numel()
        if finite_adv.numel():
            lo_, hi_ = float(finite_adv.min()), float(finite_adv.max())
            a_lo = lo_ if a_lo is None else min(a_lo, lo_)
            a_hi = hi_ if a_hi is None else max(a_hi, hi_)
    ratios = ratios[:kept]
    if kept:
        q_lo, q_hi = _quantiles(ratios, RANGE_QUANTILES)
        margin = 0.5 * (high - low)
        r_lo, r_hi = max(0.0, min(q_lo, low - margin)), max(q_hi, high + margin)
    else:
        r_lo, r_hi = low, high
    ratio_hist = _Histogram(r_lo, r_hi, bins)
    for start in range(0, kept, CHUNK_ELEMENTS):
        ratio_hist.add(ratios[start : start + CHUNK_ELEMENTS])
    adv_hist = _Histogram(*((a_lo, a_hi) if a_lo is not None else (-1.0, 1.0)), bins)
    for rows in row_chunks(log_prob):
        adv = advantages[rows].to(torch.float64)[mask[rows].to(torch.bool)]
        adv_hist.add(adv[torch.isfinite(adv)])
    return {
        "tokens": tokens,
        "non_finite": int(non_finite),
        "clip": clip,
        "ratio": ratio_hist.result(),
        "advantages": adv_hist.result(),
    }
