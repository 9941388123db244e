"""The fused passes of vanilla, gpg, dro, cispo, gspo, sapo and geo_mean: verl's per-token floats, reduced
to row sums in one pass (see :mod:`rlvitals.analyzers.fast.kernels` for how they stay exact)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..contract.config import AggMode, LossConfig
from .passes import _finish, _four_over, _ppo_kl, _ratio_block, _scalar, _Side, _signs
from .workspace import _batch_info, _fraction, _give, _rows_key, _take

if TYPE_CHECKING:  # annotations only: no import at run time
    from .token_batch import TokenBatch


def _fused_vanilla(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    pol = batch.policy(config.clip_low, config.clip_high, config.clip_ratio_c, config=config)
    if not batch.finite or not math.isfinite(pol.rows.total):
        return None
    batch._cache[("pg_rows", _rows_key(config))] = (pol.rows, None)
    return {
        "pg_loss": batch.aggregate(pol.rows, config.loss_agg_mode, **_batch_info(config)),
        "pg_clipfrac": _fraction(pol.n_clipped, batch.n_tokens),
        "ppo_kl": batch.ppo_kl,
        "pg_clipfrac_lower": _fraction(pol.n_dual_clipped, batch.n_tokens),
    }


def _fused_gpg(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -logp * A  (verl's op order; -(x) * y == -(x * y) exactly), masked row sums
    if batch.native:
        with _Side(batch, config) as side:
            rows, aux = batch.native.gpg(side.args)
        side.store(aux)
        return _finish(batch, config, [-v for v in rows])
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            p.row_sum(torch.mul(p.x("log_prob"), p.x("advantages"), out=p.buf("l")).mul_(m), 0)
            p.aux_block(m)
        (rows,) = p.rows()
    return _finish(batch, config, [-v for v in rows])


def _fused_dro(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -(logp * A - (0.5 beta) * (logp - logp_old)^2); ppo_kl = masked mean of -(logp - logp_old), no clamp
    half_beta = 0.5 * config.dro_beta
    if batch.native:
        with _Side(batch, config) as side:
            rows, kl_sum, aux = batch.native.dro(half_beta, side.args)
        side.store(aux)
        return _finish(batch, config, [-v for v in rows], ppo_kl=_ppo_kl(batch, kl_sum))
    kl_sum = 0.0
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            lp = p.x("log_prob")
            d = torch.sub(lp, p.x("old_log_prob"), out=p.buf("d"))
            kl_sum += float(torch.dot(d.view(-1), m.view(-1)))
            d.square_().mul_(half_beta)
            loss = torch.mul(lp, p.x("advantages"), out=p.buf("l")).sub_(d).mul_(m)
            p.row_sum(loss, 0)
            p.aux_block(m)
        (rows,) = p.rows()
    return _finish(batch, config, [-v for v in rows], ppo_kl=_ppo_kl(batch, kl_sum))


def _fused_cispo(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -clip(r, 1 - eps_low, 1 + eps_high) * A * logp; pg_clipfrac = share of valid tokens with r outside
    lo, hi = 1 - config.clip_low, 1 + config.clip_high
    if batch.native:
        with _Side(batch, config, ratio=True) as side:
            rows, kl_sum, hits, aux = batch.native.cispo(side.r, lo, hi, side.args)
        side.store(aux)
        return _finish(
            batch,
            config,
            [-v for v in rows],
            pg_clipfrac=_fraction(hits, batch.n_tokens),
            ppo_kl=_ppo_kl(batch, kl_sum),
            pg_clipfrac_lower=0.0,
        )
    kl_sum = hits = 0.0
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            r, kl = _ratio_block(p, m, clamp=True)
            kl_sum += kl
            clipped = torch.clamp(r, lo, hi, out=p.buf("c"))
            loss = torch.mul(clipped, p.x("advantages"), out=p.buf("l")).mul_(p.x("log_prob")).mul_(m)
            p.row_sum(loss, 0)
            out = torch.ne(r, clipped, out=p.buf("w")).view(-1)
            hits += float(torch.dot(out, m.view(-1)))
            p.aux_block(m)
        (rows,) = p.rows()
    return _finish(
        batch,
        config,
        [-v for v in rows],
        pg_clipfrac=_fraction(int(hits), batch.n_tokens),
        ppo_kl=_ppo_kl(batch, kl_sum),
        pg_clipfrac_lower=0.0,
    )


def _fused_gspo(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # one ratio per row: s_i = exp(min(sum_t m (logp - logp_old) / max(T_i, 1), 10)) (verl's forward value);
    # l = max(-A s_i, -A clip(s_i)) = A- max(s_i, clip(s_i)) - A+ min(s_i, clip(s_i)) (monotone rounding)
    lo, hi = 1 - config.clip_low, 1 + config.clip_high
    lengths = batch.n_row.clamp(min=1)
    if batch.native:
        # (logp - old) m by the loop; its row sums, the sequence ratios and their exp by torch
        d = _take(batch.shape, batch.dtype, batch.mask.device)
        try:
            with _Side(batch, config) as side:
                _, aux = batch.native.gspo_logratio(d, side.args)
            row_kl = d.sum(dim=-1)
        finally:
            _give(d)
        side.store(aux)
        s = torch.exp(torch.clamp(row_kl / lengths, max=10.0))
        rows, hits = batch.native.gspo(s, lo, hi)
        return _finish(
            batch,
            config,
            rows,
            pg_clipfrac=_fraction(hits, batch.n_tokens),
            ppo_kl=_ppo_kl(batch, float(row_kl.sum(dtype=torch.float64))),
            pg_clipfrac_lower=0.0,
        )
    kl_sum = hits = 0.0
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            d = torch.sub(p.x("log_prob"), p.x("old_log_prob"), out=p.buf("d")).mul_(m)
            row_kl = d.sum(dim=-1)
            kl_sum += float(row_kl.sum(dtype=torch.float64))
            s = torch.exp(torch.clamp(row_kl / lengths[p.s : p.e], max=10.0))
            c = torch.clamp(s, lo, hi)
            s_hi, s_lo, s = torch.maximum(s, c)[:, None], torch.minimum(s, c)[:, None], s[:, None]
            a, a_pos, a_neg = _signs(p, m)
            loss = torch.mul(a_neg, s_hi, out=p.buf("l"))
            loss.addcmul_(a_pos, s_lo.expand_as(loss), value=-1.0)
            p.row_sum(loss, 0)
            # z = A s + l >= 0, and > 0 exactly where verl's pg_losses2 > pg_losses1
            z = torch.mul(a, s, out=p.buf("w")).add_(loss).sign_()
            hits += float(z.sum())
            p.aux_block(m)
        (rows,) = p.rows()
    return _finish(
        batch,
        config,
        rows,
        pg_clipfrac=_fraction(int(hits), batch.n_tokens),
        ppo_kl=_ppo_kl(batch, kl_sum),
        pg_clipfrac_lower=0.0,
    )


def _fused_sapo(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -(sigmoid(tau (r - 1)) * (4 / tau)) * A,  tau = tau_pos where A > 0 else tau_neg; verl's
    # 4.0 / taus is reciprocal(taus) * 4, and where(A > 0, x, y) = g x + (1 - g) y exactly for g in {0, 1}
    dtype = batch.dtype
    tau_pos, tau_neg = _scalar(config.tau_pos, dtype), _scalar(config.tau_neg, dtype)
    q_pos, q_neg = _four_over(tau_pos, dtype), _four_over(tau_neg, dtype)
    if batch.native:
        # r (the log-ratio by a loop, exp by torch); (r - 1) tau over it by the loop; sigmoid by torch;
        # the loss row sums by the loop
        with _Side(batch, config, ratio=True) as side:
            gates = side.r if side.r is not None else _take(batch.shape, dtype, batch.mask.device)
            try:
                kl_sum, aux = batch.native.sapo_gate(side.r, gates, tau_pos, tau_neg, side.args)
                rows = batch.native.sapo(gates.sigmoid_(), q_pos, q_neg)
            finally:
                if side.r is None:
                    _give(gates)
        side.store(aux)
    else:
        rows, kl_sum = _sapo_torch(batch, config, tau_pos, tau_neg, q_pos, q_neg)
    return _finish(
        batch,
        config,
        [-v for v in rows],
        AggMode.SEQ_MEAN_TOKEN_MEAN,
        pg_clipfrac=0.0,
        ppo_kl=_ppo_kl(batch, kl_sum),
        pg_clipfrac_lower=0.0,
    )


def _sapo_torch(
    batch: TokenBatch, config: LossConfig, tau_pos: float, tau_neg: float, q_pos: float, q_neg: float
) -> tuple[list[float], float]:
    """The torch-op pass of :func:`_fused_sapo`: the row sums of ``(gates q) A m`` and the kl sum."""
    kl_sum = 0.0
    with batch._pass(1) as p:
        p.aux(config)
        for m in p.blocks():
            r, kl = _ratio_block(p, m, clamp=True)
            kl_sum += kl
            adv = p.x("advantages")
            g = torch.gt(adv, 0.0, out=p.buf("g"))
            h = torch.le(adv, 0.0, out=p.buf("h"))  # NaN in A: both 0, and the loss is NaN anyway
            taus = torch.mul(h, tau_neg, out=p.buf("t")).add_(g, alpha=tau_pos)
            gates = r.sub_(1.0).mul_(taus).sigmoid_()
            gates.mul_(torch.mul(h, q_neg, out=p.buf("t")).add_(g, alpha=q_pos))
            p.row_sum(gates.mul_(adv).mul_(m), 0)
            p.aux_block(m)
        (rows,) = p.rows()
    return rows, kl_sum


def _fused_geo_mean(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # sgn(A) min(sgn(A) d, sgn(A) clamp(d, -lo, hi)) = min(d, hi) (A > 0), max(d, -lo) (A < 0), 0 (A = 0);
    # row means of it and of A, then pg_loss = mean_i(-adv_i exp(mean_i)); clipped = (d != clamp(d))
    lo, hi = config.clip_low, config.clip_high
    if batch.native:
        with _Side(batch, config) as side:
            kl_rows, adv_rows, kl_sum, hits_pos, hits_neg, aux = batch.native.geo_mean(lo, hi, side.args)
        side.store(aux)
    else:
        kl_rows, adv_rows, kl_sum, hits_pos, hits_neg = _geo_mean_torch(batch, config, lo, hi)
    if not all(map(math.isfinite, kl_rows)) or not all(map(math.isfinite, adv_rows)):
        return None
    dtype = batch.dtype
    lengths = batch.n_row + 1e-8
    ratio = torch.exp(torch.tensor(kl_rows, dtype=dtype) / lengths)
    pg_losses = -(torch.tensor(adv_rows, dtype=dtype) / lengths) * ratio
    pg_loss = float(torch.mean(pg_losses))
    if not (math.isfinite(pg_loss) and math.isfinite(kl_sum)):
        return None
    return {
        "pg_loss": pg_loss,
        "pg_clipfrac": _fraction(int(hits_pos), batch.n_tokens),
        "ppo_kl": _ppo_kl(batch, kl_sum),
        "pg_clipfrac_lower": _fraction(int(hits_neg), batch.n_tokens),
    }


def _geo_mean_torch(
    batch: TokenBatch, config: LossConfig, lo: float, hi: float
) -> tuple[list[float], list[float], float, float, float]:
    """The torch-op pass of :func:`_fused_geo_mean`: row sums of the clipped log-ratio and of ``A m``,
    the kl sum and the two clip counts."""
    kl_sum = hits_pos = hits_neg = 0.0
    with batch._pass(2) as p:
        p.aux(config)
        for m in p.blocks():
            adv = p.x("advantages")
            d = torch.sub(p.x("log_prob"), p.x("old_log_prob"), out=p.buf("d"))
            kl_sum += float(torch.dot(d.view(-1), m.view(-1)))
            g = torch.gt(adv, 0.0, out=p.buf("g")).mul_(m)
            n = torch.lt(adv, 0.0, out=p.buf("n")).mul_(m)
            v = torch.clamp(d, max=hi, out=p.buf("l")).mul_(g)
            v.addcmul_(torch.clamp(d, min=-lo, out=p.buf("w")), n)
            p.row_sum(v, 0)
            p.row_sum(torch.mul(adv, m, out=p.buf("w")), 1)
            clipped = torch.ne(d, torch.clamp(d, -lo, hi, out=p.buf("w")), out=p.buf("w")).view(-1)
            hits_pos += float(torch.dot(clipped, g.view(-1)))
            hits_neg += float(torch.dot(clipped, n.view(-1)))
            p.aux_block(m)
        kl_rows, adv_rows = p.rows()
    return kl_rows, adv_rows, kl_sum, hits_pos, hits_neg
