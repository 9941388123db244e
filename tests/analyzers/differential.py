"""The fast path against the reference path over the settings space (hypothesis strategies shared by
tests/analyzers/test_analyzers_differential.py and bench/differential.py).

``fast``: :meth:`TokenBatch.metrics` with the compiled passes; ``reference``: verl's op sequence only
(:meth:`TokenBatch.reference_metrics`). They must agree to ``RTOL`` of the result plus ``ATOL`` (plus,
for the sums that cancel, ``ROUNDING`` of their terms' magnitudes), NaN where the other is NaN, the
same infinity where the other is infinite.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from rlvitals.analyzers.contract.config import AggMode, LossConfig
from rlvitals.analyzers.fast.dispatch import token_batch
from rlvitals.analyzers.reference.losses import agg_loss
from rlvitals.analyzers.reference.policy_losses import POLICY_LOSSES

RTOL, ATOL = 1e-5, 1e-6
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MODES = sorted(m for m in POLICY_LOSSES if m not in ("clip_cov", "bypass_mode"))  # a draw; rollout: own tests
EXTREMES = (math.inf, -math.inf, math.nan, 1e30, -1e30)


@st.composite
def cases(draw, max_width: int = 300):
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, 6))
    width = draw(st.one_of(st.just(1), st.integers(1, max_width), st.just(16384)))
    if width == 16384:
        rows = 1
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    lp = -torch.rand(rows, width, generator=g, dtype=f64) * 3
    old = lp + torch.randn(rows, width, generator=g, dtype=f64) * draw(st.sampled_from([0.0, 0.05, 0.5]))
    scale = draw(st.sampled_from([1.0, 1e4]))  # huge advantages
    adv = torch.randn(rows, width, generator=g, dtype=f64) * scale
    kind = draw(st.sampled_from(["prefix", "scattered", "empty-rows", "all-masked", "full"]))
    if kind == "scattered":
        mask = torch.rand(rows, width, generator=g) < 0.5
    elif kind == "all-masked":
        mask = torch.zeros(rows, width, dtype=torch.bool)
    elif kind == "full":
        mask = torch.ones(rows, width, dtype=torch.bool)
    else:
        lengths = torch.randint(0 if kind == "empty-rows" else 1, width + 1, (rows,), generator=g)
        mask = torch.arange(width)[None] < lengths[:, None]
    tensors = {"log_prob": lp, "old_log_prob": old, "advantages": adv}
    if draw(st.booleans()):
        tensors["ref_log_prob"] = lp + torch.randn(rows, width, generator=g, dtype=f64) * 0.1
        tensors["entropy"] = torch.rand(rows, width, generator=g, dtype=f64)
    if draw(st.booleans()):
        tensors["rollout_is_weights"] = torch.rand(rows, width, generator=g, dtype=f64) + 0.5
    where = draw(st.sampled_from(["none", "under-mask", "outside-mask"]))
    if where != "none":
        value = draw(st.sampled_from(EXTREMES))
        name = draw(st.sampled_from(sorted(tensors)))
        spots = ~mask if where == "under-mask" else mask
        if bool(spots.any()):
            flat = spots.flatten().nonzero().flatten()
            pick = flat[torch.randint(len(flat), (1,), generator=g)]
            tensors[name].view(-1)[pick] = value
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors["response_mask"] = mask
    n_tokens, n_seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    use_global = draw(st.booleans())
    dp = draw(st.sampled_from([1, 2, 4])) if use_global else 1
    config = LossConfig(
        loss_mode=draw(st.sampled_from(MODES)),
        loss_agg_mode=draw(st.sampled_from([m.value for m in AggMode])),
        loss_scale_factor=draw(st.sampled_from([None, 16.0, 1.0])),
        clip_ratio_low=draw(st.sampled_from([None, 0.2])),
        clip_ratio_high=draw(st.sampled_from([None, 0.28])),
        dp_size=dp,
        batch_num_tokens=n_tokens * dp + draw(st.integers(0, 5)) if use_global else None,
        global_batch_size=n_seqs * dp + draw(st.integers(0, 2)) if use_global else None,
        use_kl_loss="ref_log_prob" in tensors and draw(st.booleans()),
        entropy_coeff=draw(st.sampled_from([0.0, 0.01])),
        dro_beta=0.1,
    )
    return config, tensors


# what a sum's rounding may change, per unit of the sum of its terms' magnitudes: verl adds float32
# terms in float32 (in torch's order), the compiled loops in float64. Where the terms cancel, that is
# more than RTOL of the result, never more than this much of the magnitudes.
ROUNDING = {torch.float32: 2e-6, torch.float64: 1e-14, torch.float16: 0.0, torch.bfloat16: 0.0}


def close(a: float, b: float, magnitude: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= ATOL + RTOL * max(abs(a), abs(b)) + magnitude


def _magnitudes(batch, config: LossConfig, reference: dict[str, float]) -> dict[str, float]:
    """Per metric, ``ROUNDING`` x the same aggregation of the terms' magnitudes (``pg_loss`` and the
    ``policy_loss`` built on it; the other metrics are checked to ``RTOL`` of themselves)."""
    captured = batch.policy_agg_inputs(config)
    unit = ROUNDING[batch.dtype]
    if captured is None or not unit:
        return {}
    loss_mat, mask, mode = captured
    with torch.no_grad():
        pg = float(agg_loss(loss_mat.abs(), mask, mode, **config.global_batch_info)) * unit
    parts = pg + unit * abs(config.entropy_coeff * reference.get("entropy_loss", 0.0))
    if config.use_kl_loss:
        parts += unit * abs(config.kl_loss_coef * reference.get("kl_loss", 0.0))
    return {"pg_loss": pg, "policy_loss": parts}


def disagreements(config: LossConfig, tensors: dict) -> dict[str, tuple[float, float]]:
    """Metric -> (fast, reference) where the two paths disagree."""
    fast = token_batch(dict(tensors), dense=True).metrics(config)
    batch = token_batch(dict(tensors), dense=True)
    reference = batch.reference_metrics(config)
    slack = _magnitudes(batch, config, reference)
    return {
        k: (fast[k], reference[k])
        for k in reference
        if k in fast and not close(fast[k], reference[k], slack.get(k, 0.0))
    }
