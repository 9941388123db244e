"""verl's off-policy metrics of rollout correction (``compute_offpolicy_metrics``) from one blocked torch
pass over whole rows, with the reference ops wherever it does not apply."""

from __future__ import annotations

import math

import torch

from ..reference.rollout import SAFETY_BOUND, offpolicy_metrics_reference
from . import workspace

Tensor = torch.Tensor


def offpolicy_metrics(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: the blocked pass where it applies, else the reference ops."""
    fused = _offpolicy_metrics_fused(log_prob, rollout_log_prob, mask)
    return fused if fused is not None else offpolicy_metrics_reference(log_prob, rollout_log_prob, mask)


def _row_counts(mask: Tensor) -> Tensor:
    """``mask.sum(-1)`` (verl's per-row counts), from the bytes for a bool mask (3x faster)."""
    if mask.dtype == torch.bool and mask.shape[-1] < 2**31:
        return mask.view(torch.uint8).sum(dim=-1, dtype=torch.int32).to(torch.int64)
    return mask.sum(dim=-1)


def _offpolicy_metrics_fused(
    log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor
) -> dict[str, float] | None:
    """The same metrics from one pass over blocks of whole rows (``workspace.BLOCK_ELEMS`` tokens, so the
    block and its scratch stay in L2): five masked row sums per row, then verl's arithmetic on the
    ``(batch,)`` rows. The per-row values are verl's (the same elementwise ops, the same rows summed);
    the three token means add row sums instead of reducing the whole tensor at once (float32
    summation order, ~1e-7 relative). None (take verl's op sequence) for other dtypes, mixed dtypes,
    a mask that promotes the values, or anything non-finite (even under the mask, which verl drops)."""
    dtype = log_prob.dtype
    if (
        dtype not in (torch.float32, torch.float64)
        or rollout_log_prob.dtype != dtype
        or log_prob.dim() != 2
        or torch.promote_types(dtype, mask.dtype) != dtype
        or mask.is_complex()
    ):
        return None
    b, width = log_prob.shape
    step = max(1, min(b, workspace.BLOCK_ELEMS // max(width, 1)))
    source = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    rows = torch.empty((5, b), dtype=dtype)
    names = ("m", "d", "e", "w")
    bufs = {k: workspace._take((step, width), dtype, log_prob.device) for k in names}
    try:
        for s in range(0, b, step):
            e = min(s + step, b)
            m, d, ex, w = (bufs[k][: e - s] for k in names)
            m.copy_(source[s:e])
            lp, ro = log_prob[s:e], rollout_log_prob[s:e]
            torch.sum(torch.mul(lp, m, out=w), dim=-1, out=rows[0, s:e])
            torch.sum(torch.mul(ro, m, out=w), dim=-1, out=rows[1, s:e])
            torch.sub(lp, ro, out=d)  # log_ratio; rollout - log_prob is exactly its negation
            torch.sum(torch.mul(d, m, out=w), dim=-1, out=rows[2, s:e])
            torch.exp(d, out=ex)
            torch.sum(torch.sub(ex, d, out=w).sub_(1.0).mul_(m), dim=-1, out=rows[3, s:e])  # k3
            torch.exp(torch.clamp(d, -SAFETY_BOUND, SAFETY_BOUND, out=w), out=ex)  # rho
            torch.sum(ex.square_().mul_(m), dim=-1, out=rows[4, s:e])
    finally:
        workspace._give(*bufs.values())
    if not bool(torch.isfinite(rows).all()):
        return None
    counts = _row_counts(mask)
    n = float(counts.sum() + 1e-8)  # verl's count + 1e-8 (float32 for an integer mask)
    lp_rows, ro_rows, lr_rows = rows[0], rows[1], rows[2]
    per_row = counts + 1e-8
    m: dict[str, float] = {}
    mean_train = lp_rows / per_row
    m["training_ppl"] = torch.exp(-mean_train).mean().item()
    m["training_log_ppl"] = (-mean_train).mean().item()
    totals = [math.fsum(r) for r in rows[2:].tolist()]
    m["kl"] = -totals[0] / n
    m["k3_kl"] = totals[1] / n
    mean_rollout = ro_rows / per_row
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"] = diff.mean().item()
    m["log_ppl_abs_diff"] = diff.abs().mean().item()
    m["log_ppl_diff_max"] = diff.max().item()
    m["log_ppl_diff_min"] = diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    m["chi2_token"] = totals[2] / n - 1.0
    seq_log = lr_rows.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_log).mean() - 1.0).item()
    if not all(math.isfinite(v) for v in m.values()):
        return None
    return m
