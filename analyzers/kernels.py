"""Fast, autograd-free recomputation of verl's loss metrics over one micro-batch.

:class:`TokenBatch` validates the tensors once, then reduces every per-token quantity to *row sums*
``(batch,)`` plus a few counts. Every aggregation mode, every global-normalisation variant and every
coefficient what-if is then scalar arithmetic on those row sums, so an audit that tries dozens of
alternatives pays for the token pass once per distinct clip setting and once per KL estimator.

How the token pass stays exact (the same per-token floats verl computes, in fewer passes):

- signs are folded up front into the masked advantages ``A+ = max(A m, 0)`` and ``A- = -min(A m, 0)``
  (``m`` the 0/1 mask). Because rounding is monotone, verl's ``max(-A r, -A clip(r))`` and
  ``min(-A c, ...)`` equal ``l = A- clamp(r, 1 - eps_low, c) - A+ min(r, 1 + eps_high)`` bit for bit.
- both clip fractions come from one tensor ``z = (A m) r + l``: ``z > 0`` exactly where verl's
  ``pg_losses2 > pg_losses1`` (clipped on either side), ``z < 0`` exactly where the dual clip bound won
  (``A < 0``, ``(-A) r > (-A) c``), comparing the same rounded products verl compares. Counted from
  the sum of ``sign(z)`` and its dot with itself (no bool tensors, no ``where``, no ``count_nonzero``).
- masked sums are sums of products with ``m`` (or dots): identical to verl's ``masked_sum`` whenever
  every value is finite. A non-finite value anywhere (even under the mask) makes some sum non-finite;
  the batch then falls back to the op-for-op reference in :mod:`.losses`, which is what verl does with
  NaN/inf. Half precision always takes the reference ops, in the input dtype, as verl would.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .config import AggMode, KLType, LossConfig

Tensor = torch.Tensor
_FAST_DTYPES = (torch.float32, torch.float64)


class _Workspace(threading.local):
    """Per-thread free lists of token-sized CPU buffers, keyed by (shape, dtype, device).

    Fresh multi-megabyte tensors cost more in first-touch page faults than the arithmetic done in
    them; reusing a few buffers across audits of same-shaped batches removes that cost. Bounded by
    ``POOL_BYTES`` per thread; buffers never escape a :class:`TokenBatch`.
    """

    def __init__(self) -> None:
        self.free: dict[tuple, list[Tensor]] = {}
        self.nbytes = 0


POOL_BYTES = 128 << 20  # per thread; a module attribute, so a server can lower it
_WORKSPACE = _Workspace()


def _take(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    free = _WORKSPACE.free.get((shape, dtype, device))
    if free:
        buf = free.pop()
        _WORKSPACE.nbytes -= buf.nbytes
        return buf
    return torch.empty(shape, dtype=dtype, device=device)


def _give(*buffers: Tensor) -> None:
    for buf in buffers:
        if buf.device.type == "cpu" and _WORKSPACE.nbytes + buf.nbytes <= POOL_BYTES:
            _WORKSPACE.free.setdefault((tuple(buf.shape), buf.dtype, buf.device), []).append(buf)
            _WORKSPACE.nbytes += buf.nbytes


def _total(values: list[float] | tuple[float, ...]) -> float:
    """Exact sum (``math.fsum``), with IEEE results where fsum raises (inf - inf, overflow)."""
    try:
        return math.fsum(values)
    except ValueError:  # +inf and -inf
        return math.nan
    except OverflowError:  # finite values whose sum overflows
        return sum(values)


def ieee_div(a: float, b: float) -> float:
    """``a / b`` with IEEE semantics (x/0 -> +-inf, 0/0 -> NaN) instead of ZeroDivisionError."""
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _eps_count(count: int) -> float:
    """verl's ``mask.sum() + 1e-8``: an int64 count plus a python float gives a float32 scalar."""
    return float(np.float32(count) + np.float32(1e-8))


def _fraction(hits: int, count: int) -> float:
    """verl's clip fractions: a float32 0/1 indicator's masked mean, so float32 whatever the input dtype."""
    return float(np.float32(hits) / (np.float32(count) + np.float32(1e-8)))


@dataclass(frozen=True)
class RowSums:
    """Per-row masked sums of a per-token quantity (``rows``, one float per sequence), with the two
    totals every aggregation mode is made of: ``total = sum_i rows_i`` and ``seq_mean_total =
    sum_i rows_i / (T_i + 1e-8)`` (T_i + 1e-8 in float32, as verl computes it; empty rows add 0)."""

    rows: tuple[float, ...]
    total: float
    seq_mean_total: float


@dataclass(frozen=True)
class PolicyStats:
    """Token-pass result for one clip setting: row sums of the clipped loss and the clip counts."""

    rows: RowSums
    n_clipped: int
    n_dual_clipped: int


class TokenBatch:
    """One micro-batch, validated; computes verl's metrics for any :class:`LossConfig`.

    Tensors are ``(batch, response_len)``. ``response_mask`` is bool or numeric (non-zero = valid).
    Float inputs of mixed dtype are promoted to a common dtype, as torch would promote them in verl.
    """

    def __init__(
        self,
        *,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        ref_log_prob: Tensor | None = None,
        entropy: Tensor | None = None,
        rollout_is_weights: Tensor | None = None,
    ) -> None:
        given = {
            "log_prob": log_prob,
            "old_log_prob": old_log_prob,
            "advantages": advantages,
            "ref_log_prob": ref_log_prob,
            "entropy": entropy,
            "rollout_is_weights": rollout_is_weights,
        }
        floats = {k: v for k, v in given.items() if v is not None}
        for name, value in (*floats.items(), ("response_mask", response_mask)):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
            if value.dim() != 2:
                raise ValueError(f"{name} must be 2-D (batch, response_len); got shape {tuple(value.shape)}")
            if value.shape != response_mask.shape:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)} but response_mask has {tuple(response_mask.shape)}"
                )
            if value.device != response_mask.device:
                raise ValueError(
                    f"{name} is on {value.device} but response_mask is on {response_mask.device}"
                )
        for name, value in floats.items():
            if not value.is_floating_point():
                raise ValueError(
                    f"{name} must be float16, bfloat16, float32 or float64; got {str(value.dtype).replace('torch.', '')}"
                )
        if response_mask.is_complex():
            raise ValueError("response_mask must be bool or 0/1 numbers; got a complex tensor")
        self.shape = tuple(response_mask.shape)
        self.width = self.shape[1]
        self.tensors = {k: v.detach() for k, v in floats.items()}
        self.mask = response_mask.detach()
        self.mask = self.mask if self.mask.dtype == torch.bool else self.mask != 0
        dtype = floats["log_prob"].dtype
        for value in floats.values():
            dtype = torch.promote_types(dtype, value.dtype)
        self.dtype = dtype
        self.fast = dtype in _FAST_DTYPES
        self._cache: dict = {}
        self._lengths: list[float] | None = None
        if self.fast:
            self._prepare()
        else:
            self._count(self.mask.sum(dim=-1))

    def _count(self, n_row: Tensor) -> None:
        self.n_row = n_row  # (batch,) int64: valid tokens per row
        self.n_tokens = int(n_row.sum())
        self.n_seqs = int(torch.count_nonzero(n_row))

    @property
    def empty(self) -> bool:
        return self.n_tokens == 0

    # -- fast path -------------------------------------------------------------------------------
    def _t(self, name: str) -> Tensor:
        value = self.tensors[name]
        return value if value.dtype == self.dtype else value.to(self.dtype)

    def _buffer(self) -> Tensor:
        return _take(self.shape, self.dtype, self.mask.device)

    def _prepare(self) -> None:
        """The float 0/1 mask and the per-row counts (every fused quantity is a dot with the mask)."""
        m = self._buffer()
        weakref.finalize(self, _give, m)
        m.copy_(self.mask)
        # valid tokens per row; a float sum of 0/1 is exact below 2^24 (and skips bool -> int64 copies)
        self._count(m.sum(dim=-1).to(torch.int64) if self.width < 2**24 else self.mask.sum(dim=-1))
        self._m = m
        self.finite = True  # until a fused sum says otherwise
        self._ratio: Tensor | None = None

    def _prepare_advantages(self) -> None:
        """``A m`` and its positive and negative parts ``A+ = max(A m, 0)``, ``A- = A+ - A m``."""
        if getattr(self, "_adv_m", None) is not None:
            return
        adv_m, a_pos, a_neg = (self._buffer() for _ in range(3))
        weakref.finalize(self, _give, adv_m, a_pos, a_neg)
        torch.mul(self._t("advantages"), self._m, out=adv_m)  # A on valid tokens, 0 elsewhere
        torch.clamp(adv_m, min=0.0, out=a_pos)  # A+  (A > 0)
        torch.sub(a_pos, adv_m, out=a_neg)  # -A  (A < 0), exactly: A+ - A is 0 or -A
        self._adv_m, self._a_pos, self._a_neg = adv_m, a_pos, a_neg

    def _prepare_policy(self) -> None:
        """Mask-folded advantages, the ratio and ppo_kl: the shared first half of the clipped-loss pass
        (made on first use: the losses that need no ratio skip it)."""
        if self._ratio is not None:
            return
        self._prepare_advantages()
        m = self._m
        ratio = self._buffer()
        weakref.finalize(self, _give, ratio)
        # log-ratio, clamped to +-20 as verl does before exp; ppo_kl = masked mean of (old - new)
        torch.sub(self._t("log_prob"), self._t("old_log_prob"), out=ratio).clamp_(-20.0, 20.0)
        kl_sum = float(torch.dot(ratio.view(-1), m.view(-1)))
        ratio.exp_()
        self._ratio = ratio
        self.ppo_kl = -kl_sum / _eps_count(self.n_tokens)
        self.finite = self.finite and math.isfinite(kl_sum)

    def _row_sums(self, values: Tensor) -> RowSums:
        """Row sums, summed in the token dtype (float32 cascade sums are good to ~1e-7 relative;
        converting first would cost a float64 copy of the batch); the totals over rows are exact
        (``math.fsum`` in python: one list per batch beats several tiny tensor ops)."""
        rows = tuple(values.sum(dim=-1).tolist())
        if self._lengths is None:
            self._lengths = (self.n_row.to(torch.float32) + 1e-8).tolist()
        return RowSums(rows, _total(rows), _total(list(map(operator.truediv, rows, self._lengths))))

    def policy(self, low: float, high: float, c: float) -> PolicyStats:
        """Row sums of the clipped per-token loss and the clip counts for ratio bounds
        ``[1 - low, 1 + high]`` and dual-clip bound ``c`` (cached per setting)."""
        key = ("pg", low, high, c)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        self._prepare_policy()
        lo, hi = 1 - low, 1 + high  # python floats, rounded to the tensor dtype like verl's clamp
        r = self._ratio
        loss, work = self._buffer(), self._buffer()
        # l = (-A) clamp(r, lo, c) for A < 0,  -(A min(r, hi)) for A > 0   (one of the terms is 0)
        torch.clamp(r, lo, c, out=loss).mul_(self._a_neg)
        # one of the two terms is exactly 0 per token, so a fused multiply-add rounds like verl
        loss.addcmul_(torch.clamp(r, max=hi, out=work), self._a_pos, value=-1.0)
        rows = self._row_sums(loss)
        # z = A r + l:  z > 0 <=> verl's pg_losses2 > pg_losses1 (clipped, either side);
        #               z < 0 <=> A < 0 and (-A) r > (-A) c (dual clip), compared on the rounded products
        z = torch.mul(self._adv_m, r, out=work).add_(loss).sign_()
        # sign sums are exact small integers: (n+ - n-) and (n+ + n-)
        if z.numel() < 2**24:  # float32 accumulation is exact for these integer counts
            balance = int(z.sum())
            flat = z.view(-1)
            nonzero = int(torch.dot(flat, flat))  # sign^2 is 1 exactly where z != 0
        else:
            balance = int(z.sum(dtype=torch.float64))
            nonzero = int(z.abs_().sum(dtype=torch.float64))
        _give(loss, work)
        n_clipped = (nonzero + balance) // 2
        stats = PolicyStats(rows=rows, n_clipped=n_clipped, n_dual_clipped=nonzero - n_clipped)
        self._cache[key] = stats
        return stats

    def kl_rows(self, kind: KLType | str) -> RowSums:
        """Row sums ``(batch,)`` float64 of the forward value of a KL estimator (``+`` has k's value)."""
        kind = KLType(kind)
        if kind.straight_through and not self._k2_finite():
            # verl's k2 - k2.detach() + f.detach() is NaN wherever k2 is not finite, even where the
            # clamped forward estimator is: NaN rows send the batch to the reference path
            return RowSums((math.nan,) * self.shape[0], math.nan, math.nan)
        base = kind.base
        key = ("kl", base)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        lp, ref = self._t("log_prob"), self._t("ref_log_prob")
        value = self._buffer()
        if base == "k3":
            # delta = clamp(ref - logp, +-20); k3 = clamp(e^delta - delta - 1, +-10)
            delta = torch.sub(ref, lp, out=self._buffer()).clamp_(-20.0, 20.0)
            torch.exp(delta, out=value).sub_(delta).sub_(1.0).clamp_(-10.0, 10.0)
            _give(delta)
        else:
            torch.sub(lp, ref, out=value)
            if base == "abs":
                value.abs_()
            elif base == "k2":
                value.square_().mul_(0.5)
        rows = self._row_sums(value.mul_(self._m))
        _give(value)
        self._cache[key] = rows
        return rows

    def _k2_finite(self) -> bool:
        hit = self._cache.get("k2_finite")
        if hit is None:
            diff = torch.sub(self._t("log_prob"), self._t("ref_log_prob"), out=self._buffer())
            flat = diff.view(-1)
            hit = math.isfinite(float(torch.dot(flat, flat)))
            _give(diff)
            self._cache["k2_finite"] = hit
        return hit

    def entropy_rows(self) -> RowSums:
        hit = self._cache.get("entropy")
        if hit is None:
            buf = torch.mul(self._t("entropy"), self._m, out=self._buffer())
            hit = self._row_sums(buf)
            _give(buf)
            self._cache["entropy"] = hit
        return hit

    def aggregate(
        self,
        rows: RowSums,
        mode: AggMode | str,
        *,
        dp_size: int = 1,
        batch_num_tokens: int | None = None,
        global_batch_size: int | None = None,
        loss_scale_factor: float | None = None,
    ) -> float:
        """verl's ``agg_loss`` from row sums: scalar arithmetic, no token pass (built-in modes only)."""
        mode = AggMode(mode)
        if mode is AggMode.TOKEN_MEAN:
            if batch_num_tokens is None:
                if dp_size > 1:
                    raise ValueError(
                        "batch_num_tokens (global, across data-parallel ranks) is required when dp_size > 1"
                    )
                batch_num_tokens = self.n_tokens
            return ieee_div(rows.total, batch_num_tokens) * dp_size
        if mode is AggMode.TOKEN_SUM:
            return rows.total * dp_size
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(
                    "global_batch_size (global, across data-parallel ranks) is required when dp_size > 1"
                )
            global_batch_size = self.n_seqs
        total = rows.seq_mean_total if mode is AggMode.SEQ_MEAN_TOKEN_MEAN else rows.total
        loss = ieee_div(total, global_batch_size) * dp_size
        if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM:
            loss = ieee_div(loss, self.width if loss_scale_factor is None else loss_scale_factor)
        return loss

    def metrics(self, config: LossConfig) -> dict[str, float]:
        """verl's metrics for ``config`` (see :func:`rlvitals.analyzers.recompute`).

        Routes: the fused token pass for the built-in ``vanilla`` loss without IS weights; for any other
        registered loss (or with ``rollout_is_weights``) the loss's own function, with the entropy and
        KL terms still from fused row sums; verl's op sequence for everything in half precision, with
        non-finite values, or with a user-registered aggregation mode or KL estimator (the fused pass
        only implements the built-ins)."""
        if config.use_kl_loss and "ref_log_prob" not in self.tensors:
            raise ValueError("ref_log_prob is required when use_kl_loss is True")
        from .policy_losses import POLICY_LOSSES, compute_policy_loss_vanilla, get_policy_loss

        entry = get_policy_loss(config.loss_mode)
        builtin = isinstance(config.loss_agg_mode, AggMode) and isinstance(config.kl_loss_type, KLType)
        if self.fast and self.finite and builtin:
            fused = _FUSED.get(entry.fn) if "rollout_is_weights" not in self.tensors else None
            if (
                POLICY_LOSSES["vanilla"] is entry
                and entry.fn is compute_policy_loss_vanilla
                and ("rollout_is_weights" not in self.tensors)
            ):
                out = self._fast_metrics(config)
            elif fused is not None:
                pg = fused(self, config)
                out = None if pg is None else self._aux_metrics(config, pg, fast=True)
            else:
                out = self._aux_metrics(config, self.policy_metrics(config), fast=True)
            if out is not None:
                return out
            self.finite = False  # a non-finite sum: every later config takes the reference path too
        return self._reference_metrics(config)

    def policy_metrics(self, config: LossConfig, *, raw: bool = False) -> dict[str, float]:
        """``pg_loss`` and the loss mode's own metrics from its registered function (no autograd),
        memoised per setting except for losses that draw random numbers (``clip_cov``). ``raw``: as the
        0-dim tensors the loss returned (half precision combines them in its own dtype)."""
        from .policy_losses import get_policy_loss

        entry = get_policy_loss(config.loss_mode)
        key = ("policy", _policy_key(config))
        hit = None if entry.random else self._cache.get(key)
        if hit is None:
            from .losses import capture_agg_inputs

            t = self.tensors
            with torch.no_grad(), capture_agg_inputs() as captured:
                pg_loss, metrics = entry.fn(
                    t["old_log_prob"],
                    t["log_prob"],
                    t["advantages"],
                    self.mask,
                    config.loss_agg_mode,
                    config,
                    t.get("rollout_is_weights"),
                )
            hit = {"pg_loss": pg_loss, **metrics}
            self._cache[("policy_agg_inputs", *key[1:])] = captured[-1] if len(captured) == 1 else None
            if not entry.random:
                self._cache[key] = hit
        return dict(hit) if raw else {k: float(v) for k, v in hit.items()}

    def policy_agg_inputs(self, config: LossConfig) -> tuple[Tensor, Tensor, str] | None:
        """The ``(loss_mat, mask, mode)`` the loss aggregated for ``config`` (after :meth:`policy_metrics`);
        None when it made no single ``agg_loss`` call (``geo_mean`` averages rows itself)."""
        key = ("policy_agg_inputs", _policy_key(config))
        if key not in self._cache:
            self.policy_metrics(config)
        return self._cache.get(key)

    def _aux_metrics(
        self, config: LossConfig, out: dict[str, float], *, fast: bool
    ) -> dict[str, float] | None:
        """Add ``entropy_loss``, ``kl_loss`` and ``policy_loss`` to the policy metrics ``out``; None when a
        fused sum is not finite (the caller then takes the reference path)."""
        info = config.global_batch_info
        policy_loss = out["pg_loss"]
        if fast:
            sums = []
            if "entropy" in self.tensors:
                rows = self.entropy_rows()
                sums.append(rows.total)
                out["entropy_loss"] = self.aggregate(rows, config.loss_agg_mode, **info)
            if "ref_log_prob" in self.tensors:
                rows = self.kl_rows(config.kl_loss_type)
                sums.append(rows.total)
                out["kl_loss"] = self.aggregate(rows, config.loss_agg_mode, **info)
            if not all(math.isfinite(x) for x in sums):
                return None
        else:
            out.update(self._reference_aux(config))
        if "entropy_loss" in out:
            policy_loss = policy_loss - config.entropy_coeff * out["entropy_loss"]
        if "kl_loss" in out and config.use_kl_loss:
            policy_loss = policy_loss + out["kl_loss"] * config.kl_loss_coef
        out["policy_loss"] = policy_loss
        return {k: float(v) for k, v in out.items()}

    def _fast_metrics(self, config: LossConfig) -> dict[str, float] | None:
        info = config.global_batch_info
        pol = self.policy(config.clip_low, config.clip_high, config.clip_ratio_c)
        if not self.finite or not math.isfinite(pol.rows.total):
            return None
        out = {
            "pg_loss": self.aggregate(pol.rows, config.loss_agg_mode, **info),
            "pg_clipfrac": _fraction(pol.n_clipped, self.n_tokens),
            "ppo_kl": self.ppo_kl,
            "pg_clipfrac_lower": _fraction(pol.n_dual_clipped, self.n_tokens),
        }
        return self._aux_metrics(config, out, fast=True)

    # -- reference path --------------------------------------------------------------------------
    def _reference_metrics(self, config: LossConfig) -> dict[str, float]:
        """verl's own op sequence (``losses.ppo_loss``), in the input dtype. The per-token matrices and
        their aggregations are memoised, so an audit trying many configs pays once per clip setting,
        KL estimator and aggregation."""
        from .losses import agg_loss, clipped_token_losses
        from .policy_losses import POLICY_LOSSES, compute_policy_loss_vanilla

        t, mask = self.tensors, self.mask
        info = config.global_batch_info
        mode = config.loss_agg_mode
        entry = POLICY_LOSSES.get(config.loss_mode)
        if entry is None or entry.fn is not compute_policy_loss_vanilla or "rollout_is_weights" in t:
            return self._aux_metrics(config, self.policy_metrics(config, raw=True), fast=False)
        with torch.no_grad():
            clip = (config.clip_low, config.clip_high, config.clip_ratio_c)
            pg_losses, pg_metrics = self._memo(
                ("ref_pg", *clip),
                lambda: clipped_token_losses(
                    t["old_log_prob"],
                    t["log_prob"],
                    t["advantages"],
                    mask,
                    clip_low=clip[0],
                    clip_high=clip[1],
                    clip_ratio_c=clip[2],
                ),
            )
            pg_loss = self._memo(
                ("ref_agg", f"pg{clip}", str(mode), *info.values()),
                lambda: agg_loss(pg_losses, mask, mode, **info),
            )
        return self._aux_metrics(config, {"pg_loss": pg_loss, **pg_metrics}, fast=False)

    def _memo(self, key, compute):
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = compute()
        return hit

    def _reference_aux(self, config: LossConfig) -> dict[str, Tensor]:
        from .losses import agg_loss, kl_penalty

        t, mask = self.tensors, self.mask
        info = config.global_batch_info
        mode = config.loss_agg_mode
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            if "entropy" in t:
                out["entropy_loss"] = self._memo(
                    ("ref_agg", "entropy", str(mode), *info.values()),
                    lambda: agg_loss(t["entropy"], mask, mode, **info),
                )
            if "ref_log_prob" in t:
                kind = config.kl_loss_type
                kld = self._memo(
                    ("ref_kl", str(kind)), lambda: kl_penalty(t["log_prob"], t["ref_log_prob"], kind)
                )
                out["kl_loss"] = self._memo(
                    ("ref_agg", f"kl-{kind}", str(mode), *info.values()),
                    lambda: agg_loss(kld, mask, mode, **info),
                )
        return out


def _policy_key(config: LossConfig) -> tuple:
    """Every setting a policy loss may read (all of LossConfig but the entropy / KL-term ones)."""
    return (
        config.loss_mode,
        config.clip_low,
        config.clip_high,
        config.clip_ratio_c,
        str(config.loss_agg_mode),
        *config.global_batch_info.values(),
        config.clip_cov_ratio,
        config.clip_cov_lb,
        config.clip_cov_ub,
        config.kl_cov_ratio,
        config.ppo_kl_coef,
        config.dro_beta,
        config.tau_pos,
        config.tau_neg,
        config.rollout_correction,
    )


# -- fused token passes for other built-in losses (identity of verl's function -> pass) ----------------
def _fused_gpg(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -logp * A  (verl's op order), masked row sums
    buf = torch.mul(batch._t("log_prob"), batch._t("advantages"), out=batch._buffer()).neg_().mul_(batch._m)
    rows = batch._row_sums(buf)
    _give(buf)
    if not math.isfinite(rows.total):
        return None
    return {"pg_loss": batch.aggregate(rows, config.loss_agg_mode, **config.global_batch_info)}


def _fused_dro(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -(logp * A - (0.5 beta) * (logp - logp_old)^2); ppo_kl = masked mean of -(logp - logp_old), no clamp
    lp = batch._t("log_prob")
    d = torch.sub(lp, batch._t("old_log_prob"), out=batch._buffer())
    kl_sum = float(torch.dot(d.view(-1), batch._m.view(-1)))
    d.square_().mul_(0.5 * config.dro_beta)
    loss = torch.mul(lp, batch._t("advantages"), out=batch._buffer()).sub_(d).neg_().mul_(batch._m)
    rows = batch._row_sums(loss)
    _give(d, loss)
    if not (math.isfinite(rows.total) and math.isfinite(kl_sum)):
        return None
    return {
        "pg_loss": batch.aggregate(rows, config.loss_agg_mode, **config.global_batch_info),
        "ppo_kl": -kl_sum / _eps_count(batch.n_tokens),
    }


def _fused_cispo(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # l = -clip(r, 1 - eps_low, 1 + eps_high) * A * logp; pg_clipfrac = share of valid tokens with r outside
    batch._prepare_policy()
    if not batch.finite:
        return None
    r = batch._ratio
    clipped = torch.clamp(r, 1 - config.clip_low, 1 + config.clip_high, out=batch._buffer())
    loss = torch.mul(clipped, batch._t("advantages"), out=batch._buffer()).neg_()
    loss.mul_(batch._t("log_prob")).mul_(batch._m)
    rows = batch._row_sums(loss)
    hits = int(torch.count_nonzero(torch.sub(r, clipped, out=loss).mul_(batch._m)))
    _give(clipped, loss)
    if not math.isfinite(rows.total):
        return None
    return {
        "pg_loss": batch.aggregate(rows, config.loss_agg_mode, **config.global_batch_info),
        "pg_clipfrac": _fraction(hits, batch.n_tokens),
        "ppo_kl": batch.ppo_kl,
        "pg_clipfrac_lower": 0.0,
    }


def _fused_gspo(batch: TokenBatch, config: LossConfig) -> dict[str, float] | None:
    # one ratio per row: s_i = exp(min(sum_t m (logp - logp_old) / max(T_i, 1), 10)) (verl's forward value);
    # l = max(-A s_i, -A clip(s_i)) = A- max(s_i, clip(s_i)) - A+ min(s_i, clip(s_i)) (monotone rounding)
    batch._prepare_advantages()
    d = torch.sub(batch._t("log_prob"), batch._t("old_log_prob"), out=batch._buffer()).mul_(batch._m)
    row_kl = d.sum(dim=-1)
    kl_sum = float(row_kl.sum(dtype=torch.float64))
    lengths = batch.n_row.clamp(min=1)
    s = torch.exp(torch.clamp(row_kl / lengths, max=10.0))
    c = torch.clamp(s, 1 - config.clip_low, 1 + config.clip_high)
    s_hi, s_lo = torch.maximum(s, c)[:, None], torch.minimum(s, c)[:, None]
    loss = torch.mul(batch._a_neg, s_hi, out=d)
    work = torch.mul(batch._a_pos, s_lo, out=batch._buffer())
    loss.sub_(work)
    rows = batch._row_sums(loss)
    # z = A s + l > 0 exactly where verl's pg_losses2 > pg_losses1 (the sign of a rounded difference is exact)
    z = torch.mul(batch._adv_m, s[:, None], out=work).add_(loss)
    hits = int(torch.count_nonzero(z.clamp_(min=0.0)))
    _give(loss, work)
    if not (math.isfinite(rows.total) and math.isfinite(kl_sum)):
        return None
    return {
        "pg_loss": batch.aggregate(rows, config.loss_agg_mode, **config.global_batch_info),
        "pg_clipfrac": _fraction(hits, batch.n_tokens),
        "ppo_kl": -kl_sum / _eps_count(batch.n_tokens),
        "pg_clipfrac_lower": 0.0,
    }


class _FusedPasses(dict):
    """verl's function -> its fused pass; filled on first use (policy_losses imports .losses first)."""

    def get(self, key, default=None):
        if not self:
            from . import policy_losses as pl

            self.update(
                {
                    pl.compute_policy_loss_gpg: _fused_gpg,
                    pl.compute_policy_loss_dro: _fused_dro,
                    pl.compute_policy_loss_cispo: _fused_cispo,
                    pl.compute_policy_loss_gspo: _fused_gspo,
                }
            )
        return super().get(key, default)


_FUSED = _FusedPasses()
