"""Rollout-vs-training mismatch of one batch, measured from the tokens, and *where* it lives.

The rollout engine (vLLM/SGLang, often bf16) and the trainer (FSDP/Megatron) score the same sampled
tokens; their log-probs should agree. Inputs, all ``(batch, response_len)``: ``train`` (the trainer's
``old_log_prob``), ``rollout`` (the engine's ``rollout_log_probs``), ``response_mask`` (0/1); optional
``group_index`` ``(batch,)`` (the GRPO group / prompt of each sequence). With ``gap_t = train_t -
rollout_t`` on valid tokens:

- NeMo-RL ``token_mult_prob_error = masked_mean(exp(|gap| * mask), mask)`` and ``gen_kl_error =
  masked_mean(exp(gap) - 1 - gap, mask)`` (k3 of KL(pi_gen || pi_train); NeMo-RL ``loss_functions.py``,
  ``ClippedPGLossFn``; its CI holds ``max(token_mult_prob_error) < 1.05``);
- verl 0.9.1's off-policy and IS diagnostics (``kl``, ``k3_kl``, ``chi2_token``, ``chi2_seq``,
  ``rollout_is_mean/std/min/max``, ``rollout_is_eff_sample_size``) by :func:`rollout.rollout_correction`
  (token-level IS at the configured threshold, verl's default 2.0 otherwise), and ``training/*`` (the
  probability difference and its Pearson correlation) by :func:`rollout.rollout_debug_metrics`;
- ``veto_fraction``: the share of sequences holding a token with ``exp(gap) < 1e-4`` (verl <= 0.5's
  ``rollout_token_veto_threshold`` default: such a sequence was vetoed whole);
- ``|gap|`` mean / p50 / p99 / max, the Pearson correlation of ``train`` and ``rollout`` log-probs, and
  the share of tokens whose ratio ``exp(gap)`` lies outside the IS bounds the config names (TIS ``U``:
  ``[1/U, U]``; IcePop ``"L_U"``: ``[L, U]``);
- where: the mean ``|gap|`` by position bucket (``by_position``, first to last: equal-width buckets of
  the columns up to the longest response), by sequence length, by the token's rollout probability
  ``exp(rollout)``, by group, and the worst sequences (row index, group, per-token gap);
- the shape in two numbers the trend rule reads: ``position_growth`` (mean ``|gap|`` in the last third
  of the positions over the first third: > 1 grows with position, the signature of a KV cache or
  precision drift) and ``low_prob_ratio`` (mean ``|gap|`` of tokens with ``p < 0.1`` over those with
  ``p >= 0.1``), with ``low_prob_bias = |mean gap| / mean |gap|`` over those tokens (near 1: one-sided,
  the signature of sampling settings such as temperature/top-p/top-k applied by the engine only; near
  0: rounding noise, which also lands on low-probability tokens when the logits are large).

An empty mask raises ``ValueError`` (as verl does). Cost: see ``bench/mismatch.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..contract.rollout_config import parse_is_threshold
from ..fast.rollout import rollout_correction, rollout_debug_metrics

Tensor = torch.Tensor

SERIES_PREFIX = "rlvitals/mismatch/"
VETO_THRESHOLD = 1e-4  # verl <= 0.5 rollout_token_veto_threshold
PROB_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)  # rollout-probability buckets
LOW_PROB = 0.1
POSITION_BUCKETS = 8
LENGTH_BUCKETS = 4
WORST = 5
WORST_TOKENS = 256  # per-token gaps kept per worst sequence
TOP_GROUPS = 10
# the verl metrics kept in the report, by their rollout_corr/ name
_VERL_KEYS = (
    "kl",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "rollout_is_mean",
    "rollout_is_std",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_eff_sample_size",
    "log_ppl_abs_diff",
)
# what the server writes to the run's metrics (name under SERIES_PREFIX -> the report's value)
SERIES = (
    "token_mult_prob_error",
    "gen_kl_error",
    "abs_gap_mean",
    "abs_gap_p99",
    "abs_gap_max",
    "pearson",
    "kl",
    "chi2_token",
    "is_mean",
    "ess",
    "beyond_bounds",
    "position_growth",
    "low_prob_ratio",
    "low_prob_bias",
)


def is_bounds(threshold: float | str | None) -> tuple[float, float]:
    """The ratio bounds a rollout-correction threshold names: TIS ``U`` -> ``(1/U, U)`` (verl's
    ``fraction_low`` uses ``1/U``), IcePop ``"L_U"`` -> ``(L, U)``; None -> verl's default ``(0.5, 2.0)``."""
    upper, lower = parse_is_threshold(2.0 if threshold is None else threshold)
    return (1.0 / upper if lower is None else lower), upper


def _pearson(x: Tensor, y: Tensor) -> float | None:
    """Pearson correlation of two 1-D float64 tensors; None for fewer than 2 values or no spread."""
    if x.numel() < 2:
        return None
    xc, yc = x - x.mean(), y - y.mean()
    den = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    return None if den == 0 else max(-1.0, min(1.0, float((xc * yc).sum()) / den))


def _bucket_means(ids: Tensor, gap: Tensor, n: int) -> tuple[list[float | None], list[int]]:
    """Per bucket ``0..n-1`` of ``ids`` (1-D int64): mean ``gap`` (None: no token) and token count."""
    sums = torch.bincount(ids, weights=gap, minlength=n)[:n]
    counts = torch.bincount(ids, minlength=n)[:n]
    means = [
        None if c == 0 else float(s) / int(c) for s, c in zip(sums.tolist(), counts.tolist(), strict=True)
    ]
    return means, [int(c) for c in counts.tolist()]


def _quantile_from_top(top: Tensor, n: int, q: float) -> float:
    """The ``q`` quantile (torch.quantile's linear interpolation) of ``n`` values from their largest
    ``top`` (descending; it must reach down to rank ``floor(q * (n - 1))``)."""
    pos = q * (n - 1)
    below = math.floor(pos)
    hi_rank = n - 1 - below  # index into the descending top of the value at sorted position ``below``
    lo = float(top[hi_rank])
    hi = float(top[hi_rank - 1]) if hi_rank >= 1 else lo
    return lo + (pos - below) * (hi - lo)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None:
        return None
    if den <= 0:
        return None if num <= 0 else math.inf
    return num / den


def mismatch_report(
    train: Tensor,
    rollout: Tensor,
    response_mask: Tensor,
    *,
    group_index: Tensor | None = None,
    is_threshold: float | str | None = None,
    position_buckets: int = POSITION_BUCKETS,
    worst: int = WORST,
) -> dict[str, Any]:
    """The mismatch report of one batch (see the module docstring for every formula). ``train``,
    ``rollout``, ``response_mask``: ``(batch, response_len)``; ``group_index``: ``(batch,)`` int64 or
    None; ``is_threshold``: the rollout-correction threshold whose bounds are counted (verl's
    ``rollout_is_threshold``; None: 2.0). JSON-ready (floats, None for "no token there")."""
    if train.shape != rollout.shape or train.shape != response_mask.shape or train.dim() != 2:
        raise ValueError(
            f"train {tuple(train.shape)}, rollout {tuple(rollout.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be the same (batch, response_len) shape"
        )
    flat = torch.nonzero(response_mask.reshape(-1)).squeeze(1)  # (n,) valid token indices, row-major
    n = int(flat.numel())
    if n == 0:
        raise ValueError("response_mask must contain at least one valid token (1)")
    batch, width = train.shape
    lower, upper = is_bounds(is_threshold)
    with torch.no_grad():
        try:
            _, _, verl = rollout_correction(
                train, rollout, response_mask, rollout_is="token",
                rollout_is_threshold=2.0 if is_threshold is None else is_threshold,
            )  # fmt: skip
        except ZeroDivisionError:  # IcePop zeroed every weight (verl raises): the off-policy metrics alone
            _, _, verl = rollout_correction(train, rollout, response_mask)
        debug = rollout_debug_metrics(train, rollout, response_mask)
        # the valid tokens only, (n,): one gather each instead of boolean indexing over the whole batch
        train_v = train.reshape(-1).index_select(0, flat).double()
        rollout_v = rollout.reshape(-1).index_select(0, flat).double()
        gap_v = train_v - rollout_v
        abs_v = gap_v.abs()
        row, col = flat // width, flat % width
        p_v = rollout_v.exp()  # the token's rollout probability
        top = torch.topk(abs_v, min(n, n // 100 + 2)).values  # the largest 1% + 2, descending
        half = 0.5 * (
            n - 1
        )  # the median as torch.quantile interpolates it (two middle values when n is even)
        p50 = float(torch.kthvalue(abs_v, math.floor(half) + 1).values)
        if half % 1:
            p50 = 0.5 * (p50 + float(torch.kthvalue(abs_v, math.floor(half) + 2).values))
        q = [p50, float(_quantile_from_top(top, n, 0.99))]
        ratio = gap_v.clamp(-20.0, 20.0).exp()
        beyond_low = float((ratio < lower).sum()) / n
        beyond_high = float((ratio > upper).sum()) / n
        lengths = torch.bincount(row, minlength=batch)  # (batch,) valid tokens per row
        has_tokens = lengths > 0
        vetoed = torch.bincount(row[ratio < VETO_THRESHOLD], minlength=batch) > 0
        starts = torch.cumsum(lengths, 0) - lengths  # each row's first index into the (n,) arrays

        # where: by position (columns up to the longest response)
        span = int(col.max()) + 1
        buckets = max(1, min(position_buckets, span))
        pos_ids = (col * buckets) // span
        by_position, pos_counts = _bucket_means(pos_ids, abs_v, buckets)
        third = max(1, span // 3)
        early = abs_v[col < third]
        late = abs_v[col >= span - third]
        growth = _ratio(
            float(late.mean()) if late.numel() else None, float(early.mean()) if early.numel() else None
        )

        # by rollout probability
        edges = torch.tensor(PROB_EDGES[1:-1], dtype=torch.float64)
        prob_ids = torch.bucketize(p_v, edges, right=True)
        prob_means, prob_counts = _bucket_means(prob_ids, abs_v, len(PROB_EDGES) - 1)
        low = p_v < LOW_PROB
        n_low = int(low.sum())
        low_abs = float(abs_v[low].mean()) if n_low else None
        low_ratio = _ratio(low_abs, float(abs_v[~low].mean()) if n_low < n else None)
        # how one-sided the low-probability gap is: 1 when every such token errs the same way (a
        # temperature / top-p applied on one side only shifts them all), ~0 for rounding noise
        low_bias = _ratio(abs(float(gap_v[low].mean())), low_abs) if n_low else None

        # per sequence
        row_sum = torch.bincount(row, weights=abs_v, minlength=batch)
        row_mean = torch.where(has_tokens, row_sum / lengths.clamp_min(1), torch.zeros_like(row_sum))

        # by sequence length: equal-width buckets of [shortest, longest]
        lo_len, hi_len = int(lengths[has_tokens].min()), int(lengths.max())
        n_len = max(1, min(LENGTH_BUCKETS, hi_len - lo_len + 1))
        len_ids = ((lengths - lo_len).clamp_min(0) * n_len) // (hi_len - lo_len + 1)
        by_length = []
        for b in range(n_len):
            rows = (len_ids == b) & has_tokens
            tokens = int(lengths[rows].sum())
            by_length.append(
                {
                    "min_length": lo_len + (b * (hi_len - lo_len + 1)) // n_len,
                    "max_length": lo_len + ((b + 1) * (hi_len - lo_len + 1)) // n_len - 1,
                    "sequences": int(rows.sum()),
                    "tokens": tokens,
                    "mean": float(row_sum[rows].sum()) / tokens if tokens else None,
                }
            )

        by_group = None
        if group_index is not None and tuple(group_index.shape) == (batch,):
            ids, inverse = torch.unique(group_index, return_inverse=True)
            g_sum = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, row_sum)
            g_tok = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, lengths.double())
            g_mean = torch.where(g_tok > 0, g_sum / g_tok.clamp_min(1), torch.zeros_like(g_sum))
            order = torch.argsort(g_mean, descending=True)[:TOP_GROUPS]
            by_group = {
                "groups": len(ids),
                "spread": float(g_mean[g_tok > 0].std()) if int((g_tok > 0).sum()) > 1 else 0.0,
                "worst": [
                    {"group": int(ids[i]), "tokens": int(g_tok[i]), "mean": float(g_mean[i])}
                    for i in order.tolist()
                    if g_tok[i] > 0
                ],
            }

        worst_rows = []
        for i in torch.argsort(row_mean, descending=True)[: max(0, worst)].tolist():
            if not bool(has_tokens[i]):
                continue
            s, e = int(starts[i]), int(starts[i] + lengths[i])
            gaps, cols = gap_v[s:e], col[s:e]
            at = int(gaps.abs().argmax())
            worst_rows.append(
                {
                    "index": i,
                    "group": None if group_index is None else int(group_index[i]),
                    "length": int(lengths[i]),
                    "mean": float(row_mean[i]),
                    "max": float(gaps[at].abs()),
                    "max_at": int(cols[at]),
                    "gaps": [round(float(v), 6) for v in gaps[:WORST_TOKENS].tolist()],
                }
            )

        report: dict[str, Any] = {
            "tokens": n,
            "sequences": int(has_tokens.sum()),
            "token_mult_prob_error": float(abs_v.exp().mean()),
            "gen_kl_error": float((gap_v.exp() - 1.0 - gap_v).mean()),
            "abs_gap": {"mean": float(abs_v.mean()), "p50": q[0], "p99": q[1], "max": float(abs_v.max())},
            "mean_gap": float(gap_v.mean()),
            "pearson": _pearson(train_v, rollout_v),
            "verl": {k: float(verl["rollout_corr/" + k]) for k in _VERL_KEYS if "rollout_corr/" + k in verl},
            "probs_diff": {
                k.removeprefix("training/rollout_"): (None if v != v else float(v))
                for k, v in debug.items()
                if k != "training/rollout_probs_diff_valid"
            },
            "veto_fraction": float(vetoed.sum()) / max(1, int(has_tokens.sum())),
            "bounds": {
                "lower": lower,
                "upper": upper,
                "beyond_low": beyond_low,
                "beyond_high": beyond_high,
                "beyond": beyond_low + beyond_high,
            },
            "by_position": by_position,
            "position_buckets": [
                {
                    "start": (b * span + buckets - 1) // buckets,
                    "end": ((b + 1) * span + buckets - 1) // buckets - 1,
                    "tokens": pos_counts[b],
                    "mean": by_position[b],
                }
                for b in range(buckets)
            ],
            "by_length": by_length,
            "by_prob": [
                {
                    "low": PROB_EDGES[b],
                    "high": PROB_EDGES[b + 1],
                    "tokens": prob_counts[b],
                    "mean": prob_means[b],
                }
                for b in range(len(PROB_EDGES) - 1)
            ],
            "by_group": by_group,
            "worst": worst_rows,
            "shape": {"position_growth": growth, "low_prob_ratio": low_ratio, "low_prob_bias": low_bias},
        }
    report["series"] = series_of(report)
    return report


def series_of(report: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a report the server writes to the run's metrics, as ``rlvitals/mismatch/<name>``
    (finite values only: a ratio with nothing to compare is left out)."""
    verl = report.get("verl") or {}
    shape = report.get("shape") or {}
    values = {
        "token_mult_prob_error": report.get("token_mult_prob_error"),
        "gen_kl_error": report.get("gen_kl_error"),
        "abs_gap_mean": (report.get("abs_gap") or {}).get("mean"),
        "abs_gap_p99": (report.get("abs_gap") or {}).get("p99"),
        "abs_gap_max": (report.get("abs_gap") or {}).get("max"),
        "pearson": report.get("pearson"),
        "kl": verl.get("kl"),
        "chi2_token": verl.get("chi2_token"),
        "is_mean": verl.get("rollout_is_mean"),
        "ess": verl.get("rollout_is_eff_sample_size"),
        "beyond_bounds": (report.get("bounds") or {}).get("beyond"),
        "position_growth": shape.get("position_growth"),
        "low_prob_ratio": shape.get("low_prob_ratio"),
        "low_prob_bias": shape.get("low_prob_bias"),
    }
    return {
        SERIES_PREFIX + k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and math.isfinite(float(v))
    }
