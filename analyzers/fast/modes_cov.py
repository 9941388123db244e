"""The fused passes of dppo (tv / binary kl), clip_cov, kl_cov and bypass_mode: verl's per-token floats,
reduced to row sums (see :mod:`rlvitals.analyzers.fast.kernels` for how they stay exact)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..contract.config import LossConfig
from .modes import _fused_vanilla
from .passes import _finish, _masked_losses_finite, _masked_mean_exact, _ppo_kl, _ratio_block, _signs
from .rollout import rollout_correction
from .workspace import Tensor, _eps_count, _fraction, _give, _rows_key, _take, _total

if TYPE_CHECKING:  # annotations only: no import at run time
    from .token_batch import TokenBatch


def _native_dppo(batch: TokenBatch, config: LossConfig, binary_kl: bool) -> dict[str, float] | None:
    # the loop packs the valid tokens' clamp(lp - old, +-20), lp and old; torch takes exp of them (r, p, q)
    # and for KL the log of the fraction the loop computes; the loop then does everything else
    # (csrc/losses_b.h). Masked tokens need none of them, but in a dense batch their loss must be finite
    # (verl's -A sg(min(r, c)) logp times a 0/1 validity: both dppo modes): else verl's op sequence.
    c = config.clip_ratio_c
    if batch.dense and not _masked_losses_finite(
        batch,
        ("dppo", c),
        lambda lp, old, adv: (-adv * torch.exp(torch.clamp(lp - old, -20.0, 20.0)).clamp(max=c)) * lp,
        lambda a, r, lp: a * max(c, 1.0) * lp,
    ):
        return None
    x = _take((3, batch.n_tokens), batch.dtype, batch.mask.device)
    try:
        batch.native.dppo_pack(batch.n_tokens, x).exp_()
        log_frac = batch.native.dppo_frac(x).log_() if binary_kl else None
        rows, kl_sum, kept, lower = batch.native.dppo(
            x, log_frac, config.clip_low, config.clip_high, config.clip_ratio_c
        )
    finally:
        _give(x)
    batch._native_aux(*batch._aux_plan(config))
    n = batch.n_tokens
    return _finish(
        batch,
        config,
        rows,
        pg_clipfrac=_fraction(n - kept, n),
        ppo_kl=_ppo_kl(batch, kl_sum),
        pg_clipfrac_lower=_fraction(lower, n),
    )


def _fused_dppo(batch: TokenBatch, config: LossConfig, *, binary_kl: bool) -> dict[str, float] | None:
    # valid = (A > 0 ? pos : neg) of the probability-divergence test; l = -A sg(min(r, c)) logp valid
    if batch.native:
        return _native_dppo(batch, config, binary_kl)
    low, high, c = config.clip_low, config.clip_high, config.clip_ratio_c
    kl_sum = kept = lower = 0.0
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            lp, old, adv = p.x("log_prob"), p.x("old_log_prob"), p.x("advantages")
            r, kl = _ratio_block(p, m, clamp=True)
            kl_sum += kl
            prob = torch.exp(lp, out=p.buf("p"))
            old_prob = torch.exp(old, out=p.buf("q"))
            pos, neg = p.buf("pos"), p.buf("neg")
            if binary_kl:
                # old_prob (old - logp) + (1 - old_prob) log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
                om = torch.neg(old_prob, out=p.buf("w")).add_(1.0)
                term = torch.add(om, 1e-8, out=p.buf("f"))
                term.div_(torch.neg(prob, out=p.buf("bkl")).add_(1.0).add_(1e-8)).log_().mul_(om)
                bkl = torch.sub(old, lp, out=p.buf("bkl")).mul_(old_prob).add_(term)
                torch.le(bkl, high, out=pos)
                torch.maximum(pos, torch.le(prob, old_prob, out=p.buf("w")), out=pos)
                torch.le(bkl, low, out=neg)
                torch.maximum(neg, torch.ge(prob, old_prob, out=p.buf("w")), out=neg)
            else:
                diff = torch.sub(prob, old_prob, out=p.buf("w"))
                torch.le(diff, high, out=pos)
                torch.ge(diff, -low, out=neg)
            # where(A > 0, pos, neg) = g pos + (1 - g) neg exactly (0/1 values), then times the mask
            valid = pos.mul_(torch.gt(adv, 0.0, out=p.buf("g")))
            valid.addcmul_(torch.le(adv, 0.0, out=p.buf("h")), neg).mul_(m)
            kept += float(valid.sum())
            lower += float(torch.dot(torch.gt(r, c, out=p.buf("h")).view(-1), valid.view(-1)))
            # -A * sg(min(r, c)) * logp * valid  (negated on the row sums)
            loss = torch.clamp(r, max=c, out=p.buf("l"))
            p.row_sum(torch.mul(adv, loss, out=loss).mul_(lp).mul_(valid), 0)
            p.aux_block(m)
        (rows,) = p.rows()
    return _finish(
        batch,
        config,
        [-v for v in rows],
        pg_clipfrac=_fraction(batch.n_tokens - int(kept), batch.n_tokens),
        ppo_kl=_ppo_kl(batch, kl_sum),
        pg_clipfrac_lower=_fraction(int(lower), batch.n_tokens),
    )


def _native_clip_cov(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # the loop: A m and logp m (torch sums them: verl's masked means), the kl sum and the valid tokens'
    # log-ratio; torch: its exp; the loop: loss row sums and the candidates (flat and packed indices) in
    # verl's row-major order; then verl's torch.randperm draw, and the loop takes the drawn losses off
    lo, hi = 1 - config.clip_low, 1 + config.clip_high
    n = batch.n_tokens
    am, lm = (_take(batch.shape, batch.dtype, batch.mask.device) for _ in range(2))
    try:
        kl_sum, r = batch.native.clip_cov_pack(n, am, lm)
        count = torch.tensor(_eps_count(n), dtype=torch.float32)
        mean_a, mean_lp = float(am.sum() / count), float(lm.sum() / count)
    finally:
        _give(am, lm)
    r.exp_()
    rows, cand, cand_q = batch.native.clip_cov(
        r, lo, hi, mean_a, mean_lp, config.clip_cov_lb, config.clip_cov_ub
    )
    # nothing drawn unless every sum is finite (else verl's own function draws, once)
    batch._native_aux(*batch._aux_plan(config))
    if not (math.isfinite(kl_sum) and math.isfinite(float(rows.sum()))):
        return None
    if batch._aux_metrics(config, {"pg_loss": 0.0}, fast=True) is None:
        return None
    n_drawn = 0
    if len(cand):
        sel = torch.randperm(len(cand))[: min(max(int(config.clip_cov_ratio * n), 1), len(cand))]
        batch.native.clip_cov_fix(rows, r, cand, cand_q, sel, lo, hi)
        n_drawn = len(sel)
    return _finish(
        batch,
        config,
        rows.tolist(),
        pg_clipfrac=_fraction(n_drawn, n),
        ppo_kl=_ppo_kl(batch, kl_sum),
    )


def _clip_cov_token_loss(adv: Tensor, ratio: Tensor, lo: float, hi: float) -> Tensor:
    """verl's clip_cov per-token loss before its draw: ``max(-A r, -A clamp(r, lo, hi))``."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, lo, hi))


def _fused_clip_cov(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # vanilla clip without the dual clip or the +-20 clamp; then min(k, n) of the n unclipped valid tokens
    # with lb < cov < ub, cov = (A - mean A)(logp - mean logp), drawn with verl's torch.randperm(n), lose
    # their loss. The candidates come out of the pass in verl's row-major order, so the draw is verl's.
    if not config.clip_cov_ratio > 0:
        raise ValueError("clip_cov_ratio must be > 0 for loss_mode 'clip_cov'")
    lo, hi = 1 - config.clip_low, 1 + config.clip_high
    # both passes multiply A by the mask before the loss: in a dense batch the masked tokens' own loss
    # (verl's; the draw never picks them) must be finite, else verl's op sequence
    if batch.dense and not _masked_losses_finite(
        batch,
        ("clip_cov", lo, hi),
        lambda lp, old, adv: _clip_cov_token_loss(adv, torch.exp(lp - old), lo, hi),
        lambda a, r, lp: a * max(r, hi, 1.0),
    ):
        return None
    if batch.native:
        return _native_clip_cov(batch, config)
    mean_a = _masked_mean_exact(batch, "advantages")
    mean_lp = _masked_mean_exact(batch, "log_prob")
    lb, ub = config.clip_cov_lb, config.clip_cov_ub
    kl_sum = 0.0
    found: list[Tensor] = []
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            lp, adv = p.x("log_prob"), p.x("advantages")
            r, kl = _ratio_block(p, m, clamp=False)
            kl_sum += kl
            a, a_pos, a_neg = _signs(p, m)
            loss = torch.clamp(r, min=lo, out=p.buf("l")).mul_(a_neg)
            loss.addcmul_(torch.clamp(r, max=hi, out=p.buf("w")), a_pos, value=-1.0)
            p.row_sum(loss, 0)
            # candidates: valid, not clipped (z = A r + l <= 0), lb < cov < ub
            keep = torch.mul(a, r, out=p.buf("w")).add_(loss)
            keep = torch.le(keep, 0.0, out=p.buf("w")).mul_(m)
            cov = torch.sub(adv, mean_a, out=p.buf("c")).mul_(torch.sub(lp, mean_lp, out=p.buf("a")))
            keep.mul_(torch.lt(cov, ub, out=p.buf("a+"))).mul_(torch.gt(cov, lb, out=p.buf("a-")))
            idx = torch.nonzero(keep)
            if len(idx):
                idx[:, 0] += p.s
                found.append(idx)
            p.aux_block(m)
        (rows,) = p.rows()
    # nothing drawn unless every sum is finite (else verl's own function draws, once)
    if not (math.isfinite(kl_sum) and math.isfinite(_total(rows))):
        return None
    if batch._aux_metrics(config, {"pg_loss": 0.0}, fast=True) is None:
        return None
    candidates = torch.cat(found) if found else torch.empty((0, 2), dtype=torch.long)
    clip_num = max(int(config.clip_cov_ratio * batch.n_tokens), 1)
    if len(candidates) > 0:
        chosen = candidates[torch.randperm(len(candidates))[: min(clip_num, len(candidates))]]
    else:
        chosen = candidates
    if len(chosen):
        i, j = chosen[:, 0], chosen[:, 1]
        adv = batch._t("advantages")[i, j]
        ratio = torch.exp(batch._t("log_prob")[i, j] - batch._t("old_log_prob")[i, j])
        dropped = _clip_cov_token_loss(adv, ratio, lo, hi)
        row_t = torch.tensor(rows, dtype=batch.dtype).index_add_(0, i, -dropped)
        rows = row_t.tolist()
    return _finish(
        batch,
        config,
        rows,
        pg_clipfrac=_fraction(len(chosen), batch.n_tokens),
        ppo_kl=_ppo_kl(batch, kl_sum),
    )


def _native_kl_cov(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # the loops: |log r| sum and verl's compaction of A, logp (and log r) under the mask, then the loss row
    # sums and the covariance of the compacted tokens; torch: exp of the valid tokens' log r, the two means
    # and the top-k (verl's ops on the same vectors); then the loop again: the top-k's positions and losses
    if batch.dense and not _masked_losses_finite(  # verl's -A r there (no clamp; never the KL term)
        batch, ("kl_cov",), lambda lp, old, adv: -adv * torch.exp(lp - old), lambda a, r, lp: a * r
    ):
        return None
    n = batch.n_tokens
    abs_sum, adv_finite, va, vl, r = batch.native.kl_cov_pack(n)
    if not adv_finite:  # (the loss sums no longer see the masked tokens' A)
        return None
    r.exp_()
    rows, cov = batch.native.kl_cov_rows(va, vl, r, batch.n_row, float(va.mean()), float(vl.mean()))
    if n and math.isfinite(abs_sum) and math.isfinite(float(rows.sum())):
        large = torch.topk(cov, max(1, int(n * config.kl_cov_ratio)), largest=True).indices
        batch.native.kl_cov_fix(rows, r, batch.n_row, large, config.ppo_kl_coef)
    batch._native_aux(*batch._aux_plan(config))
    return _finish(batch, config, rows.tolist(), ppo_kl=abs_sum / _eps_count(n))


def _fused_kl_cov(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -A r (no clip, no clamp), + ppo_kl_coef |log r| on the top-k valid tokens by covariance
    # (A - mean A)(logp - mean logp) over the valid tokens in row-major order (verl's torch.topk, on
    # the same compacted vectors, so the same tokens and the same means bit for bit)
    if not config.kl_cov_ratio > 0:
        raise ValueError("kl_cov_ratio must be > 0 for loss_mode 'kl_cov'")
    if batch.native:
        return _native_kl_cov(batch, config)
    n = batch.n_tokens
    valid_adv = torch.empty(n, dtype=batch.dtype)
    valid_lp = torch.empty(n, dtype=batch.dtype)
    offsets = [0, *torch.cumsum(batch.n_row, 0).tolist()]
    abs_sum = 0.0
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            lp, adv = p.x("log_prob"), p.x("advantages")
            d = torch.sub(lp, p.x("old_log_prob"), out=p.buf("d"))
            r = torch.exp(d, out=p.buf("r"))
            abs_sum += float(torch.dot(d.abs_().view(-1), m.view(-1)))
            p.row_sum(torch.mul(r, adv, out=p.buf("l")).mul_(m), 0)
            valid = batch.mask[p.s : p.e]
            start, stop = offsets[p.s], offsets[p.e]
            torch.masked_select(adv, valid, out=valid_adv[start:stop])
            torch.masked_select(lp, valid, out=valid_lp[start:stop])
            p.aux_block(m)
        (rows,) = p.rows()
    rows = [-v for v in rows]
    if n and math.isfinite(abs_sum):
        cov = (valid_adv - valid_adv.mean()) * (valid_lp - valid_lp.mean())
        k = max(1, int(len(cov) * config.kl_cov_ratio))
        large = torch.topk(cov, k, largest=True).indices
        # flat position of the q-th valid token: the first index where the running count reaches q + 1
        running = torch.cumsum(batch._mask_u8.reshape(-1), 0, dtype=torch.int64)
        flat = torch.searchsorted(running, large + 1)
        i, j = flat // batch.width, flat % batch.width
        adv = batch._t("advantages")[i, j]
        d = batch._t("log_prob")[i, j] - batch._t("old_log_prob")[i, j]
        base = -adv * torch.exp(d)
        extra = (base + config.ppo_kl_coef * d.abs()) - base
        # the rows as the pass summed them (float64 for a float32 batch's token modes)
        held = torch.float64 if batch.dtype == torch.float32 and not batch.float32_rows else batch.dtype
        rows = torch.tensor(rows, dtype=held).index_add_(0, i, extra.to(held)).tolist()
    return _finish(batch, config, rows, ppo_kl=abs_sum / _eps_count(n))


def _fused_bypass(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # ppo_clip: the rollout correction between log_prob and the rollout's log-probs (old_log_prob here),
    # then vanilla on the mask after rejection (the IS weights are not applied: the clip bounds the ratio)
    rc = config.rollout_correction_settings
    if rc["loss_type"] != "ppo_clip":
        return batch.policy_metrics(config)  # reinforce: verl's op sequence
    if batch.empty:
        raise ValueError("response_mask must contain at least one valid token (1).")
    t = batch.tensors
    _, mask, rollout_metrics = rollout_correction(
        t["log_prob"],
        t["old_log_prob"],
        batch.mask,
        rollout_is=rc["rollout_is"],
        rollout_is_threshold=rc["rollout_is_threshold"],
        rollout_is_batch_normalize=rc["rollout_is_batch_normalize"],
        rollout_rs=rc["rollout_rs"],
        rollout_rs_threshold=rc["rollout_rs_threshold"],
    )
    if rc["rollout_rs"] is None:
        pg = _fused_vanilla(batch, config)
    else:
        rejected = type(batch)(  # a TokenBatch
            log_prob=t["log_prob"],
            old_log_prob=t["old_log_prob"],
            advantages=t["advantages"],
            response_mask=mask,
            dense=batch.dense,
        )
        pg = _fused_vanilla(rejected, config)
        if pg is not None:  # the counterfactuals re-aggregate the rows of the mask after rejection
            batch._cache[("pg_rows", _rows_key(config))] = rejected.pg_rows(config)
    if pg is None:
        return None
    return {**pg, **{k: float(v) for k, v in rollout_metrics.items()}}
