"""One fused pass over blocks of whole rows (:class:`_Pass`), the entropy / KL terms a compiled loss pass
computes beside the loss (:class:`_Side`), and the guards every pass shares."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from ..contract.config import LossConfig
from . import native, workspace
from .workspace import Tensor, _batch_info, _eps_count, _give, _rows_key, _take

if TYPE_CHECKING:  # annotations only: no import at run time
    from .token_batch import TokenBatch


class _Pass:
    """Scratch for one fused pass of a :class:`TokenBatch`: blocks of whole rows, named block-sized
    buffers from the per-thread pool, and ``n_rows`` row-sum outputs (plus the entropy / KL row sums
    asked for with :meth:`plan`, cached on the batch when the pass ends)."""

    def __init__(self, batch: TokenBatch, n_rows: int) -> None:
        self.batch = batch
        b, width = batch.shape
        self.step = max(1, min(b, workspace.BLOCK_ELEMS // max(width, 1)))  # read per pass: tests lower it
        self.n_rows = n_rows
        self.entropy, self.kl, self.check = False, None, False
        self._bufs: dict[str, Tensor] = {}
        self._out: Tensor | None = None
        self.s = self.e = 0
        self.k2 = 0.0

    def __enter__(self) -> _Pass:
        return self

    def __exit__(self, *exc) -> None:
        _give(*self._bufs.values())
        self._bufs.clear()

    def aux(self, config: LossConfig | None) -> None:
        self.plan(*self.batch._aux_plan(config))

    def plan(self, entropy: bool, kl: str | None, check: bool) -> None:
        self.entropy, self.kl, self.check = entropy, kl, check

    def _outputs(self) -> Tensor:
        if self._out is None:
            n = self.n_rows + (0 if self.batch.native else self.entropy + (self.kl is not None))
            # float32 rows are summed in float64 (as the compiled loops do) unless the batch keeps
            # verl's float32 row tensors (:meth:`TokenBatch._float32_rows`)
            dtype = self.batch.dtype
            if dtype == torch.float32 and not self.batch.float32_rows:
                dtype = torch.float64
            self._out = torch.empty((max(n, 1), self.batch.shape[0]), dtype=dtype)
        return self._out

    def blocks(self):
        """Yield the float 0/1 mask of each block (rows ``self.s:self.e``)."""
        batch = self.batch
        self._outputs()
        for s in range(0, batch.shape[0], self.step):
            self.s, self.e = s, min(s + self.step, batch.shape[0])
            m = self.buf("m")
            m.copy_(batch._mask_u8[self.s : self.e])
            yield m

    def buf(self, name: str) -> Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            b = self.batch
            buf = self._bufs[name] = _take((self.step, b.width), b.dtype, b.mask.device)
        return buf[: self.e - self.s]

    def x(self, name: str) -> Tensor:
        """Input ``name``'s rows of this block, in the batch's dtype."""
        value = self.batch.tensors[name][self.s : self.e]
        return value if value.dtype == self.batch.dtype else value.to(self.batch.dtype)

    def row_sum(self, values: Tensor, j: int) -> None:
        out = self._out[j, self.s : self.e]
        torch.sum(values, dim=-1, dtype=out.dtype, out=out)

    def aux_block(self, m: Tensor) -> None:
        """This block's share of the planned entropy and KL row sums (the compiled loop computes them
        all at once in :meth:`rows` instead)."""
        if self.batch.native:
            return
        j = self.n_rows
        if self.entropy:
            self.row_sum(torch.mul(self.x("entropy"), m, out=self.buf("aux")), j)
            j += 1
        if self.kl is None and not self.check:
            return
        lp, ref = self.x("log_prob"), self.x("ref_log_prob")
        value = self.buf("aux")
        if self.kl == "k3":
            # delta = clamp(ref - logp, +-20); k3 = clamp(e^delta - delta - 1, +-10)
            delta = torch.sub(ref, lp, out=self.buf("aux2"))
            if self.check:  # (ref - logp)^2 == (logp - ref)^2 exactly
                self.k2 += float(torch.dot(delta.view(-1), delta.view(-1)))
            delta.clamp_(-20.0, 20.0)
            torch.exp(delta, out=value).sub_(delta).sub_(1.0).clamp_(-10.0, 10.0)
        else:
            torch.sub(lp, ref, out=value)
            if self.check:
                self.k2 += float(torch.dot(value.view(-1), value.view(-1)))
            if self.kl == "abs":
                value.abs_()
            elif self.kl == "k2":
                value.square_().mul_(0.5)
        if self.kl is not None:
            self.row_sum(value.mul_(m), j)

    def rows(self) -> list[list[float]]:
        """The row sums as lists (the pass's own first, then entropy / KL, which go to the cache)."""
        out = self._outputs().tolist()
        batch, j = self.batch, self.n_rows
        if batch.native:
            batch._native_aux(self.entropy, self.kl, self.check)
            return out[: self.n_rows]
        if self.entropy:
            batch._cache["entropy"] = batch._row_sums(out[j])
            j += 1
        if self.kl is not None:
            batch._cache[("kl", self.kl)] = batch._row_sums(out[j])
        if self.check:
            batch._cache["k2_finite"] = math.isfinite(self.k2)
        return out[: self.n_rows]


def _scalar(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (what ``torch.as_tensor(value, dtype=dtype)`` holds); memoized:
    the tensor round trip costs microseconds, and a config's values repeat call after call."""
    return _scalar_cached(value, math.copysign(1.0, value), dtype)


def _four_over(tau: float, dtype: torch.dtype) -> float:
    """verl's ``4.0 / tau`` for a ``dtype`` tau: ``reciprocal(tau) * 4`` in ``dtype`` (memoized)."""
    return _four_over_cached(tau, math.copysign(1.0, tau), dtype)


# keyed by the sign too: 0.0 == -0.0 (one dict key), but 4 / -0.0 is -inf
@functools.lru_cache(maxsize=256)
def _scalar_cached(value: float, _sign: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


@functools.lru_cache(maxsize=256)
def _four_over_cached(tau: float, _sign: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(tau, dtype=dtype).reciprocal() * 4.0)


def _ratio_block(p: _Pass, m: Tensor, *, clamp: bool) -> tuple[Tensor, float]:
    """``r = exp(logp - logp_old)`` (log-ratio clamped to +-20 when ``clamp``, as the loss does) and
    this block's masked sum of the (clamped) log-ratio."""
    r = torch.sub(p.x("log_prob"), p.x("old_log_prob"), out=p.buf("r"))
    if clamp:
        r.clamp_(-20.0, 20.0)
    kl = float(torch.dot(r.view(-1), m.view(-1)))
    return r.exp_(), kl


def _signs(p: _Pass, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``A m``, ``A+ = max(A m, 0)`` and ``A- = A+ - A m`` (exactly ``-A`` or 0) of this block."""
    a = torch.mul(p.x("advantages"), m, out=p.buf("a"))
    a_pos = torch.clamp(a, min=0.0, out=p.buf("a+"))
    return a, a_pos, torch.sub(a_pos, a, out=p.buf("a-"))


def _finish(batch: TokenBatch, config: LossConfig, rows: list[float], mode=None, **metrics):
    """``pg_loss`` from the loss row sums, with ``metrics``; None when anything is not finite. The row
    sums stay cached for :meth:`TokenBatch.pg_loss_by_agg_mode` (``mode``: the aggregation the loss
    fixes whatever ``loss_agg_mode`` says, as sapo's seq-mean-token-mean)."""
    row_sums = batch._row_sums(rows)
    if not math.isfinite(row_sums.total) or not all(map(math.isfinite, metrics.values())):
        return None
    batch._cache[("pg_rows", _rows_key(config))] = (row_sums, mode)
    mode = config.loss_agg_mode if mode is None else mode
    return {"pg_loss": batch.aggregate(row_sums, mode, **_batch_info(config)), **metrics}


def _ppo_kl(batch: TokenBatch, kl_sum: float) -> float:
    return -kl_sum / _eps_count(batch.n_tokens)


class _Side:
    """The entropy / KL row sums ``config`` still needs, computed inside a compiled loss pass (the loops
    of csrc/losses_a.h run the aux loop's body too, so the batch is read once): ``args`` for the pass;
    :meth:`store` caches what it returned (:meth:`TokenBatch._store_aux`). ``ratio``: the pass also
    reads ``r = exp(clamp(logp - old, -20, 20))``. With the checked inline exp (:func:`native.inline_exp`)
    the pass takes that exp, and k3's ``exp(clamp(ref - logp, -20, 20))``, itself, chunk by chunk: no
    buffers (``r`` and ``e`` are None). Otherwise they are pool buffers: their log-ratios by one loop, the
    exp by torch (one op per tensor, as verl takes it); they go back to the pool when the block ends."""

    def __init__(self, batch: TokenBatch, config: LossConfig, *, ratio: bool = False) -> None:
        self.batch, self.plan = batch, batch._aux_plan(config)
        entropy, kl, check = self.plan
        self.r = self.e = None
        if not native.inline_exp():
            self.r = _take(batch.shape, batch.dtype, batch.mask.device) if ratio else None
            self.e = _take(batch.shape, batch.dtype, batch.mask.device) if kl == "k3" else None
            if ratio or self.e is not None:
                batch.native.logratios(self.r, self.e)
            for buf in (self.r, self.e):
                if buf is not None:
                    buf.exp_()
        self.args = batch.native.side_terms(
            entropy=entropy, kl=kl, check=check, e=self.e, skip=not batch.dense
        )

    def __enter__(self) -> _Side:
        return self

    def __exit__(self, *exc) -> None:
        if self.r is not None or self.e is not None:  # none with the inline exp
            _give(*(buf for buf in (self.r, self.e) if buf is not None))
            self.r = self.e = None

    def store(self, result: tuple) -> None:
        self.batch._store_aux(*self.plan, *result)


def _masked_losses_finite(batch: TokenBatch, key: tuple, loss, bound) -> bool:
    """Whether verl's per-token loss ``loss(lp, old, A)`` is finite at every masked token, cached per
    ``key``. For the passes that compute the valid tokens' loss only: in a dense batch a seq-mean
    aggregation sums ``loss * mask``, where an inf under the mask is NaN. First a bound from three
    reductions over every token, shared by the losses that ask: ``bound(max |A|, exp(max (lp - old)),
    max(max |lp|, 1))`` bounds ``|loss|`` and its partial products; far below the dtype's maximum (the
    usual case) nothing can overflow. Else torch's ops on the masked tokens' values (elementwise: the
    same floats as over the whole tensors)."""
    hit = batch._cache.get(("masked_finite", *key))
    if hit is None:
        extremes = batch._cache.get("extremes")
        if extremes is None:
            lp, old, adv = (batch._t(name) for name in ("log_prob", "old_log_prob", "advantages"))
            (a_lo, a_hi), (lp_lo, lp_hi) = torch.aminmax(adv), torch.aminmax(lp)
            extremes = batch._cache["extremes"] = (
                max(-float(a_lo), float(a_hi)),
                float((lp - old).max()),
                max(-float(lp_lo), float(lp_hi)),
            )
        amax, dmax, lpmax = extremes
        limit = torch.finfo(batch.dtype).max / 4
        r = math.exp(min(dmax, 700.0))  # bounds every ratio (a 0 A times an inf ratio is NaN too)
        if all(map(math.isfinite, extremes)) and r < limit and bound(amax, r, max(lpmax, 1.0)) < limit:
            hit = True
        else:
            masked = ~batch.mask
            values = (batch._t(name)[masked] for name in ("log_prob", "old_log_prob", "advantages"))
            hit = bool(torch.isfinite(loss(*values)).all())
        batch._cache[("masked_finite", *key)] = hit
    return hit


def _masked_mean_exact(batch: TokenBatch, name: str) -> Tensor:
    """verl's ``masked_mean(x, mask)`` as a 0-dim tensor, bit for bit: the same full-tensor
    reduction of the same values (``x`` times the 0/1 mask equals ``where(mask, x, 0) * mask``
    for finite ``x``)."""
    values = torch.mul(batch._t(name), batch._mask_u8)
    count = torch.tensor(_eps_count(batch.n_tokens), dtype=torch.float32)
    return values.sum() / count
