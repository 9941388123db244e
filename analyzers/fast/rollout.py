"""Rollout correction by the compiled passes (``analyzers/csrc/rollout.h``) and blocked torch passes, with
the reference ops of :mod:`rlvitals.analyzers.reference.rollout` wherever they do not apply.

:func:`rollout_correction`, :func:`rollout_corr_metrics` and :func:`rollout_debug_metrics` take the same
arguments and give the same results as the reference functions of the same names (the formulas are in
that module's docstring); they are what the audit calls.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..contract.rollout_config import parse_is_threshold, parse_rs_thresholds, rs_options
from ..reference import rollout as reference
from ..reference.rollout import (
    NO_VALID_TOKEN,
    PREFIX,
    SAFETY_BOUND,
    _check_shapes,
    _is_seq_metrics,
    _reciprocal,
    _rs_seq_metrics,
)
from . import native, workspace
from .offpolicy import offpolicy_metrics

Tensor = torch.Tensor


# -- the compiled passes (analyzers/csrc/rollout.h) ----------------------------------------------------------
# The same statistics from a few loops over the tokens: the loops compute verl's per-token floats (exp is
# torch's own: called by the off-policy pass on the valid spans where native.inline_exp() holds, else
# torch.exp of the whole tensor as verl does; every exp a valid token sees is the one verl's op gives) and
# return float64 row sums, exact counts and exact max / min. The arithmetic after runs in verl's dtypes: each sum is rounded to
# the dtype verl's sum has, then divided and combined with numpy scalars of verl's 0-dim dtypes (IEEE ops
# like torch's), and the per-row vectors go through the torch ops verl applies to them. Only the summation
# order differs from verl's float32 sums (float64 here: closer to the exact value); every count and every
# clamp / threshold decision on a token is the same.
_NP: dict = {torch.float32: np.float32, torch.float64: np.float64}


def _mask_bytes(mask: Tensor) -> Tensor | None:
    """The mask as contiguous 0/1 bytes, or None when it holds other values (verl weighs by them)."""
    if mask.dtype == torch.bool:
        return mask.contiguous().view(torch.uint8)
    if mask.is_complex() or mask.dim() != 2:
        return None
    done, out = native.mask_bytes(mask)  # int64 / int32 / float32 / float64: check and convert in one pass
    if done:
        return out
    if mask.dtype.is_floating_point:
        if not bool(((mask == 0) | (mask == 1)).all()):
            return None
        return (mask != 0).view(torch.uint8)
    lo, hi = torch.aminmax(mask)
    if int(lo) < 0 or int(hi) > 1:
        return None
    return mask.to(torch.uint8).contiguous()


class _Native:
    """One call's inputs as the compiled loops read them, with the off-policy pass already run (it is
    always needed, and its sums say whether every input is finite: if not, verl's op sequence runs)."""

    def __init__(self, inputs: native.Inputs, mask: Tensor, bufs: list[Tensor], need_rho: bool) -> None:
        self.inputs, self.bufs = inputs, bufs
        self.dtype = inputs.tensors["old_log_prob"].dtype
        self.t = _NP[self.dtype]  # verl's sums and 0-dim results of the token dtype
        # verl's counts: mask.sum() + 1e-8 is float32 for an integer mask, the mask's dtype for a float one
        self.count_dtype = mask.dtype if mask.dtype.is_floating_point else torch.float32
        self.c = _NP[self.count_dtype]
        self.flag = np.promote_types(np.float32, self.c).type  # (x > bound).float() under the mask
        self.dm = bufs[0]
        # exp(clamp(d, -20, 20)) per token, when need_rho (a masked token's only ever meets a 0 mask)
        self.rho: Tensor | None = None
        big = True
        if native.inline_exp():  # exp inline, of the valid spans: the buffers' results while no |d| > 20
            if need_rho:
                self.rho = self.token_buffer()
            rows, counts, tot, big = inputs.rc_off(None, None, self.dm, self.rho)
        if big:  # torch's exp of every token between passes (verl's ops: e and rho differ where |d| > 20)
            d, e = self.token_buffer(), self.token_buffer()
            torch.sub(inputs.tensors["old_log_prob"], inputs.tensors["rollout_log_prob"], out=d)
            torch.exp(d, out=e)
            rows, counts, tot, big = inputs.rc_off(e, e, self.dm)
            self.rho = e  # exp(clamp(d, -20, 20)) is exp(d) when no |d| > 20
            if big:
                rho = self.token_buffer()
                torch.exp(torch.clamp(d, -SAFETY_BOUND, SAFETY_BOUND, out=rho), out=rho)
                rows, counts, tot, _ = inputs.rc_off(e, rho, self.dm)
                self.rho = rho
        self.finite = bool(torch.isfinite(rows).all()) and all(math.isfinite(v) for v in tot)
        self.off_rows, self.off_tot = rows, tot
        self.counts = counts
        self.n = int(counts.sum())
        self.den = self.c(self.n) + self.c(1e-8)
        self.per_row = (
            counts + 1e-8 if self.count_dtype == torch.float32 else counts.to(self.count_dtype) + 1e-8
        )
        self.seq_valid = counts > 0
        self.mask_u8 = inputs.mask
        self.mask_t: Tensor | None = None  # the mask in the token dtype, made when needed
        self._counts_f64: Tensor | None = None
        self._lr_rows: Tensor | None = None

    @classmethod
    def of(cls, old: Tensor, rollout: Tensor, mask: Tensor, need_rho: bool = True) -> _Native | None:
        """The passes' view of one call (None where they do not apply); ``need_rho``: the IS weights or
        rejection statistics will read ``rho`` (else it may stay None)."""
        dtype = old.dtype
        if (
            native.module() is None
            or dtype not in _NP
            or rollout.dtype != dtype
            or old.dim() != 2
            or not old.is_cpu
            or not mask.is_cpu
            or torch.promote_types(dtype, mask.dtype) != dtype
        ):
            return None
        mask_u8 = _mask_bytes(mask)
        if mask_u8 is None:
            return None
        inputs = native.Inputs.of(
            {"old_log_prob": old.contiguous(), "rollout_log_prob": rollout.contiguous()}, mask_u8
        )
        if inputs is None:
            return None
        bufs = [workspace._take(inputs.shape, dtype, old.device)]
        try:
            self = cls(inputs, mask, bufs, need_rho)
        except BaseException:
            workspace._give(*bufs)
            raise
        if not self.finite:
            self.close()
            return None
        if self.n == 0:
            self.close()
            raise ValueError(NO_VALID_TOKEN)
        return self

    def close(self) -> None:
        workspace._give(*self.bufs)
        self.bufs = []

    # verl's masked_mean of a full-tensor sum: the sum in the values' dtype over mask.sum() + 1e-8
    def mean(self, total: float) -> np.floating:
        return self.t(total) / self.den

    def flag_mean(self, count: int) -> np.floating:
        return self.flag(count) / self.den

    def moment_std(self, x1: Tensor, x2: Tensor) -> tuple[np.floating, float]:
        """verl's mean of x and sqrt(clamp(E[x^2] - E[x]^2, min=0)) (0.0 for one valid token) from x m and
        (x x) m (token-sized, as verl's masked sums see them). The difference cancels (weights near their
        bound lose most digits), so both sums are torch's own float32 / float64 sums of the same tensors
        as verl's, bit for bit, not the loops' float64 ones."""
        mean = self.mean(x1.sum().item())
        if self.n <= 1:
            return mean, 0.0
        var = self.mean(x2.sum().item()) - mean * mean
        return mean, float(np.sqrt(var if var > 0 else self.t(0)))

    @property
    def counts_f64(self) -> Tensor:
        if self._counts_f64 is None:
            self._counts_f64 = self.counts.to(torch.float64)
        return self._counts_f64

    def log_ratio_rows(self) -> Tensor:
        """masked_sum(log_ratio, axis=-1) as torch sums it, bit for bit verl's: exp(2 x) (chi2_seq) and
        the sequence IS weights multiply a row sum's rounding by up to 40, and IcePop keeps rows by it."""
        if self._lr_rows is None:
            self._lr_rows = self.dm.sum(dim=-1)  # d m from the off-policy loop
        return self._lr_rows

    def mask_tensor(self) -> Tensor:
        """The mask in the token dtype (verl's ``x * mask`` multiplier), made once."""
        if self.mask_t is None:
            self.mask_t = self.mask_u8.to(self.dtype)
        return self.mask_t

    def token_buffer(self) -> Tensor:
        buf = workspace._take(self.inputs.shape, self.dtype, self.dm.device)
        self.bufs.append(buf)
        return buf

    def row_moments(self, per_row: Tensor) -> tuple[np.floating, float]:
        """:meth:`moment_std` of a per-row value on the row's valid tokens (verl's expanded tensor)."""
        x1 = self.inputs.rc_fill(per_row.contiguous())
        return self.moment_std(x1, self.inputs.rc_fill((per_row * per_row).contiguous()))

    def dot_counts(self, per_row: Tensor) -> float:
        """The sum over tokens of a per-row value on the row's valid tokens, correctly rounded (so that a
        value shared by every token, e.g. one clamped bound, gives the mean and variance verl's sum of
        equal values gives): each value split in two halves (Veltkamp) whose products with a count
        below 2^26 are exact, then ``math.fsum``."""
        v = per_row.to(torch.float64).numpy()
        t = v * 134217729.0  # 2^27 + 1
        high = t - (t - v)
        low = v - high
        c = self.counts_f64.numpy()
        return math.fsum(np.concatenate((high * c, low * c)))

    def rows_t(self, rows: Tensor) -> Tensor:
        return rows.to(self.dtype)

    # -- off-policy metrics --------------------------------------------------------------------------------
    def offpolicy(self) -> dict[str, float]:
        rows = self.rows_t(self.off_rows)
        lp_rows, ro_rows = rows[0], rows[1]
        m: dict[str, float] = {}
        mean_train = lp_rows / self.per_row
        neg = torch.neg(mean_train)  # one negation for both uses (the same floats as two)
        m["training_ppl"] = torch.exp(neg).mean().item()
        m["training_log_ppl"] = neg.mean().item()
        m["kl"] = float(self.mean(-float(self.off_rows[2].sum())))  # rollout - old is exactly -d
        m["k3_kl"] = float(self.mean(self.off_tot[0]))
        mean_rollout = ro_rows / self.per_row
        neg = torch.neg(mean_rollout)
        m["rollout_ppl"] = torch.exp(neg).mean().item()
        m["rollout_log_ppl"] = neg.mean().item()
        diff = mean_rollout - mean_train
        m["log_ppl_diff"] = diff.mean().item()
        m["log_ppl_abs_diff"] = diff.abs().mean().item()
        m["log_ppl_diff_max"] = diff.max().item()
        m["log_ppl_diff_min"] = diff.min().item()
        m["ppl_ratio"] = torch.exp(diff).mean().item()
        m["chi2_token"] = float(self.mean(self.off_tot[1]) - self.t(1.0))
        seq_log = self.log_ratio_rows().clamp(-SAFETY_BOUND, SAFETY_BOUND)
        m["chi2_seq"] = (torch.exp(2.0 * seq_log).mean() - 1.0).item()
        return m

    # -- IS weights --------------------------------------------------------------------------------------
    def is_weights(self, level: str, threshold: float | str, batch_normalize: bool) -> tuple[Tensor, dict]:
        upper, lower = parse_is_threshold(threshold)
        low = 1.0 / upper if lower is None else lower
        if level == "token":
            return self._is_token(upper, lower, low, batch_normalize)
        return self._is_sequence(upper, lower, low, batch_normalize)

    def _is_token(self, upper: float, lower: float | None, low: float, batch_normalize: bool):
        sq = self.token_buffer()
        w, _, _, cnt, mm = self.inputs.rc_is_token(self.rho, lower is not None, low, upper, sq)
        m: dict[str, float] = {}
        # the clamped weights are the weights (0 <= w <= upper, 0 where masked): one mean for
        # rollout_is_mean, the std, the ESS and the batch norm, each of them verl's masked_mean(weights)
        mean, std = self.moment_std(w, sq)
        m["rollout_is_mean"] = float(mean)
        m["rollout_is_ratio_fraction_high"] = float(self.flag_mean(cnt[0]))
        m["rollout_is_ratio_fraction_low"] = float(self.flag_mean(cnt[1]))
        m["rollout_is_max"], m["rollout_is_min"] = mm
        m["rollout_is_std"] = std
        # the per-sequence means as verl's masked_mean(., axis=-1) sums them, in the token dtype (before
        # rc_ess normalises w in place): the fractions compare them with thresholds, where a float64
        # row sum's rounding can flip a row
        seq_w = w.sum(dim=-1) / self.per_row  # w is 0 where masked: verl's (weights * mask) row sums
        seq_raw = torch.mul(self.rho, self.mask_tensor()).sum(dim=-1) / self.per_row
        c = mean + self.t(1e-8)
        norm = batch_normalize and mean > self.t(1e-8)
        ess = self.inputs.rc_ess(w, upper, float(c), float(mean) if norm else None)
        m["rollout_is_eff_sample_size"] = _reciprocal(float(self.mean(ess)))
        _is_seq_metrics(m, seq_w, seq_raw, upper, low)
        if lower is not None:
            m["rollout_is_oob_ratio"] = float(self.flag_mean(cnt[0] + cnt[1]))
        if batch_normalize:
            m["rollout_is_batch_norm_factor"] = float(mean) if norm else 1.0
        return w, m

    def _is_sequence(self, upper: float, lower: float | None, low: float, batch_normalize: bool):
        # every valid token of row i carries the row's weight v_i, every other token 0: the full-tensor
        # sums are sums of v_i (and of functions of it) times the row's count
        stat = self.log_ratio_rows()
        raw = torch.exp(stat.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        if lower is None:
            v = raw.clamp(max=upper)
        else:
            v = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        m: dict[str, float] = {}
        m["rollout_is_max"] = torch.exp(torch.clamp(stat.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(stat.min()).item()
        clipped = v.clamp(min=0.0, max=upper)  # v itself (0 <= v <= upper): verl's weights_for_std
        mean, std = self.row_moments(clipped)
        m["rollout_is_mean"] = float(mean)
        log_upper = torch.log(torch.tensor(upper))
        log_lower = torch.log(torch.tensor(low))
        m["rollout_is_ratio_fraction_high"] = (stat > log_upper).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (stat < log_lower).float().mean().item()
        m["rollout_is_std"] = std
        c = mean + self.t(1e-8)
        q = clipped / torch.tensor(c, dtype=self.dtype)
        m["rollout_is_eff_sample_size"] = _reciprocal(float(self.mean(self.dot_counts(q.square()))))
        # verl's masked_mean(weights, axis=-1): torch's float32 sum of the row's copies of v_i, whose
        # rounding a float64 v_i * T_i does not reproduce (IcePop / the fraction metrics compare the
        # result with thresholds an ulp away); the filled rows are verl's weights * mask exactly
        filled = self.inputs.rc_fill(v.contiguous())
        seq_mean = filled.sum(dim=-1) / self.per_row
        raw_seq_mean = self.inputs.rc_fill(raw.contiguous()).sum(dim=-1) / self.per_row
        _is_seq_metrics(m, seq_mean, raw_seq_mean, upper, low)
        if lower is not None:
            m["rollout_is_oob_ratio"] = float(
                self.flag_mean(int(self.counts[(raw < lower) | (raw > upper)].sum()))
            )
        if batch_normalize:
            seq_mask = self.seq_valid.to(dtype=self.dtype)
            bn = (seq_mean * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
            if bn > 1e-8:
                m["rollout_is_batch_norm_factor"] = bn.item()
                return self.inputs.rc_fill((v / bn).contiguous()), m
            m["rollout_is_batch_norm_factor"] = 1.0
        return filled, m

    # -- rejection ---------------------------------------------------------------------------------------
    def rejection(self, rollout_rs: str, threshold, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        options = rs_options(rollout_rs)
        bounds = parse_rs_thresholds(options, threshold)
        keep = None  # the token options' verdicts, ANDed (bytes)
        rejected_rows = None  # rows a sequence option rejects
        row_stats: dict[int, Tensor] = {}  # kind -> (2, rows) float64: sum(s m), max of s
        n_valid_rows = self.t(int(self.seq_valid.sum()))
        m: dict[str, float] = {}
        for option in options:
            lower, upper = bounds[option]
            k1 = option.endswith("k1")
            lo_log = math.log(lower) if k1 else 0.0
            hi = math.log(upper) if k1 else upper
            kind = int(option[-1])
            p = f"rollout_rs_{option}"
            if option.startswith("token_"):
                if keep is None:
                    keep = self.mask_u8.clone()
                x1, x2 = self.token_buffer(), self.token_buffer()
                rows64, rej, _, cnt, mm = self.inputs.rc_rs(
                    self.rho, kind, keep, k1=k1, lower=lo_log, upper=hi, clamp_lower=lo_log, x1=x1, x2=x2
                )
                m[f"{p}_mean"] = float(self.mean(float(rows64[0].sum())))
                m[f"{p}_max"], m[f"{p}_min"] = mm
                m[f"{p}_fraction_high"] = float(self.flag_mean(cnt[0]))
                m[f"{p}_fraction_low"] = float(self.flag_mean(cnt[1])) if k1 else 0.0
                m[f"{p}_std"] = self.moment_std(x1, x2)[1]
                seq_values = (self.rows_t(rows64[0]) / self.per_row)[self.seq_valid]
                _rs_seq_metrics(m, p, seq_values, hi, lo_log, k1)
                n_rejected = int(rej.sum())
                rows_rejected = int(torch.count_nonzero(rej))
            else:
                if (
                    kind not in row_stats
                ):  # s m by the loop, its row sums by torch: verl's masked_sum, bit for bit
                    x1 = self.token_buffer()
                    rows64 = self.inputs.rc_rs(self.rho, kind, x1=x1)[0]
                    row_stats[kind] = (rows64, x1.sum(dim=-1))
                rows64, row_sums = row_stats[kind]
                if option.startswith("seq_sum"):
                    stat = row_sums
                elif option.startswith("seq_mean"):
                    stat = row_sums / self.per_row
                else:
                    top = self.rows_t(rows64[1])
                    stat = torch.where(top == -math.inf, torch.zeros_like(top), top)
                row_keep = (stat >= lo_log) & (stat <= hi) if k1 else stat <= hi
                seq_values = stat[self.seq_valid]
                m[f"{p}_mean"] = float(self.mean(self.dot_counts(stat)))
                m[f"{p}_max"] = seq_values.max().item()
                m[f"{p}_min"] = seq_values.min().item()
                m[f"{p}_fraction_high"] = (seq_values > hi).float().mean().item()
                m[f"{p}_fraction_low"] = (seq_values < lo_log).float().mean().item() if k1 else 0.0
                clamped = stat.clamp(min=lo_log, max=hi)
                m[f"{p}_std"] = self.row_moments(clamped)[1]
                _rs_seq_metrics(m, p, seq_values, hi, lo_log, k1)
                row_rejected = ~row_keep
                n_rejected = int(self.counts[row_rejected].sum())
                rows_rejected = int((row_rejected & self.seq_valid).sum())
                rejected_rows = row_rejected if rejected_rows is None else rejected_rows | row_rejected
            m[f"{p}_masked_fraction"] = float(self.mean(n_rejected))
            m[f"{p}_seq_masked_fraction"] = float(self.t(rows_rejected) / n_valid_rows)
        out = self.mask_u8.clone() if keep is None else keep
        if rejected_rows is not None:
            out[rejected_rows] = 0
        kept = out.sum(dim=-1, dtype=torch.int64)
        m["rollout_rs_masked_fraction"] = float(self.mean(self.n - int(kept.sum())))
        n_rows = int(torch.count_nonzero(kept < self.counts))
        m["rollout_rs_seq_masked_fraction"] = float(np.float32(n_rows) / np.float32(self.inputs.rows))
        new_mask = out.view(torch.bool) if mask.dtype == torch.bool else out.to(mask.dtype)
        return new_mask, m


def _native_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: str | None,
    rollout_is_threshold: float | str,
    rollout_is_batch_normalize: bool,
    rollout_rs: str | None,
    rollout_rs_threshold: float | str | None,
) -> tuple[Tensor | None, Tensor, dict[str, float]] | None:
    """:func:`rollout_correction` by the compiled passes; None where they do not apply (verl's ops then)."""
    if rollout_is is not None and rollout_is not in ("token", "sequence"):
        return None  # verl's error, from the op path
    need_rho = rollout_is == "token" or rollout_rs is not None  # the token weights / rejection read rho
    nat = _Native.of(old_log_prob, rollout_log_prob, response_mask, need_rho)
    if nat is None:
        return None
    try:
        metrics: dict[str, float] = {}
        weights = None
        if rollout_is is not None and rollout_is_threshold is not None:
            weights, is_metrics = nat.is_weights(rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
            metrics.update(is_metrics)
        if rollout_rs is not None:
            mask, rs_metrics = nat.rejection(rollout_rs, rollout_rs_threshold, response_mask)
            metrics.update(rs_metrics)
        else:
            mask = response_mask.clone()
        metrics.update(nat.offpolicy())
    finally:
        nat.close()
    return weights, mask, metrics


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
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """:func:`rlvitals.analyzers.reference.rollout.rollout_correction`, by the compiled passes where they apply.

    IS weights, rejection mask and ``rollout_corr/*`` metrics, as verl 0.9.1's
    ``compute_rollout_correction_and_rejection_mask`` (see the module docstring for the formulas).

    Args (all ``(batch, response_len)``): ``old_log_prob`` (the trainer's), ``rollout_log_prob`` (the
    rollout engine's), ``response_mask`` (0/1, the mask before rejection).

    Returns ``(weights or None, response_mask after rejection, metrics)``; ``weights`` is None unless
    ``rollout_is`` is set and is 0 on masked tokens; the mask keeps ``response_mask``'s dtype.
    """
    _check_shapes(old_log_prob, rollout_log_prob, response_mask)
    with torch.no_grad():
        fast = _native_correction(
            old_log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold,
            rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold,
        )  # fmt: skip
        if fast is not None:
            weights, mask, metrics = fast
            return weights, mask, {PREFIX + k: v for k, v in metrics.items()}
    return reference.rollout_correction(
        old_log_prob, rollout_log_prob, response_mask, rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold, rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold, offpolicy_metrics=offpolicy_metrics,
    )  # fmt: skip


def rollout_corr_metrics(
    log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """The off-policy diagnostics alone (verl's ``compute_rollout_corr_metrics_from_logprobs``):
    ``rollout_corr/{training_ppl, training_log_ppl, kl, k3_kl, rollout_ppl, rollout_log_ppl,
    log_ppl_diff, log_ppl_abs_diff, log_ppl_diff_max, log_ppl_diff_min, ppl_ratio, chi2_token, chi2_seq}``.
    """
    _check_shapes(log_prob, rollout_log_prob, response_mask)
    with torch.no_grad():
        nat = _Native.of(log_prob, rollout_log_prob, response_mask, need_rho=False)
        if nat is not None:
            try:
                return {PREFIX + k: v for k, v in nat.offpolicy().items()}
            finally:
                nat.close()
    return reference.rollout_corr_metrics(
        log_prob, rollout_log_prob, response_mask, offpolicy_metrics=offpolicy_metrics
    )


def rollout_debug_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """verl's ``calculate_debug_metrics`` (``training/*``): on token probabilities ``p = exp(log_prob)``
    of valid tokens, ``|p_actor - p_rollout|`` max / mean / std (unbiased) and the Pearson correlation
    of ``p_actor`` and ``p_rollout`` (arXiv:2506.13585). No valid token: ``valid`` 0 and NaNs.
    """
    if old_log_prob.shape != rollout_log_prob.shape or response_mask.shape != old_log_prob.shape:
        raise ValueError("old_log_prob, rollout_log_prob and response_mask must have the same shape")
    with torch.no_grad():
        fast = _native_debug(old_log_prob, rollout_log_prob, response_mask)
    if fast is not None:
        return fast
    return reference.rollout_debug_metrics(old_log_prob, rollout_log_prob, response_mask)


def _native_debug(old: Tensor, rollout: Tensor, mask: Tensor) -> dict[str, float] | None:
    """:func:`rollout_debug_metrics` by the compiled pass (one look at ``exp`` of both inputs, which torch
    computes as verl does): the max exact, the mean a float64 sum rounded to the dtype over the count
    (verl's sum is in the dtype), the std and the correlation from float64 moments about the first valid
    token's values, rounded to the dtype (torch.std accumulates in float64 too; torch.corrcoef in the
    dtype). None where it does not apply."""
    if (
        native.module() is None
        or old.dtype not in _NP
        or rollout.dtype != old.dtype
        or old.dim() != 2
        or old.numel() == 0
        or not old.is_cpu
        or not mask.is_cpu
    ):
        return None
    mask_u8 = _mask_bytes(mask)  # 0/1 only (a multiplier below); masked_select takes any non-zero as valid
    if mask_u8 is None:
        return None
    inputs = native.Inputs.of(
        {"old_log_prob": old.contiguous(), "rollout_log_prob": rollout.contiguous()}, mask_u8
    )
    if inputs is None:
        return None
    t = _NP[old.dtype]
    if native.inline_exp():  # the pass takes exp of the valid spans itself
        sa, sr, sd, top, n, sx, sy, se, qe, cxy, qx, qy = inputs.rc_dbg()
    else:
        a, r = (workspace._take(inputs.shape, old.dtype, old.device) for _ in range(2))
        try:
            torch.exp(inputs.tensors["old_log_prob"], out=a)
            torch.exp(inputs.tensors["rollout_log_prob"], out=r)
            sa, sr, sd, top, n, sx, sy, se, qe, cxy, qx, qy = inputs.rc_dbg(a, r)
        finally:
            workspace._give(a, r)
    n = int(n)
    if not all(math.isfinite(v) for v in (sa, sr, sd, qe, cxy, qx, qy)) or n == 0:
        return None  # NaN / inf somewhere (masked_select drops the masked ones) or no valid token
    if n > 1:  # centred sums from the shifted ones (the shift keeps them from cancelling)
        var = max(qe - se * se / n, 0.0) / (n - 1)
        std = float(t(math.sqrt(var)))
        va, vr = qx - sx * sx / n, qy - sy * sy / n
        pearson = (
            float(t(max(-1.0, min(1.0, (cxy - sx * sy / n) / math.sqrt(va * vr)))))
            if va > 0 and vr > 0
            else math.nan
        )
    else:
        std = pearson = math.nan
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": top,
        "training/rollout_probs_diff_mean": float(t(sd) / t(n)),
        "training/rollout_probs_diff_std": std,
        "training/rollout_actor_probs_pearson_corr": pearson,
    }
