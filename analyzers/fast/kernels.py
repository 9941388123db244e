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
  every value is finite. A non-finite value in a sum makes it non-finite; the batch then falls back to
  the op-for-op reference in :mod:`.losses`, which is what verl does with NaN/inf. Half precision always
  takes the reference ops, in the input dtype, as verl would.
- what lies under the mask: verl's token-mean / token-sum aggregations and its masked means take
  ``where(mask, x, 0)``, so a masked value never counts, NaN or not; its seq-mean aggregations sum
  ``loss * mask``, so a masked NaN, inf or overflowing product does. A batch made for one
  :func:`~rlvitals.analyzers.recompute` is *sparse*: the compiled passes skip every group of tokens with
  none valid, unread (right-padded responses are often half padding). Anything that aggregates by a
  seq-mean mode needs a *dense* batch, whose passes read every token as above: :meth:`TokenBatch.metrics`
  makes the batch dense first for such a config, an audit's batch is dense from the start, and
  :meth:`TokenBatch.aggregate` refuses a seq-mean mode on a sparse batch. Where a dense pass would
  still miss a masked token's overflowing loss (vanilla and clip_cov fold the mask into ``A`` first;
  clip_cov, kl_cov and dppo compute the valid tokens' loss only), it checks verl's loss there too
  (vanilla's guard; :func:`_masked_losses_finite`) and falls back when one is not finite.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..contract.config import AggMode, KLType, LossConfig
from ..reference import policy_losses as pl
from ..reference.losses import agg_loss, capture_agg_inputs, clipped_token_losses, kl_penalty
from . import native

Tensor = torch.Tensor
_FAST_DTYPES = (torch.float32, torch.float64)
# the aggregations that take masked_sum (where(mask, x, 0)): what lies under the mask never counts
_TOKEN_MODES = (AggMode.TOKEN_MEAN, AggMode.TOKEN_SUM)


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
        if buf.is_cpu and _WORKSPACE.nbytes + buf.nbytes <= POOL_BYTES:
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


class RowSums(NamedTuple):
    """Per-row masked sums of a per-token quantity (``rows``, one float per sequence), with the two
    totals every aggregation mode is made of: ``total = sum_i rows_i`` and ``seq_mean_total =
    sum_i rows_i / (T_i + 1e-8)`` (T_i + 1e-8 in float32, as verl computes it; empty rows add 0).
    In float32, ``seq_mean_total``'s quotients are float32 quotients of float32 rows, as verl's
    tensors hold them: where rows of opposite sign cancel, that rounding is a visible part of the result.
    A named tuple: a call builds several, and a frozen dataclass costs ~0.4 us more each."""

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
    """One micro-batch; computes verl's metrics for any :class:`LossConfig`.

    Build it with :func:`rlvitals.analyzers.contract.batch.token_batch`, which checks the tensors against the
    batch contract once (``recompute`` and ``audit`` do); this class does not check them again (the
    compiled loops check what they read themselves: :class:`~rlvitals.analyzers.fast.native.Inputs`).
    Tensors are ``(batch, response_len)``. ``response_mask`` is bool or numeric (non-zero = valid).
    Float inputs of mixed dtype are promoted to a common dtype, as torch would promote them in verl.
    ``dense``: the compiled passes read every token, masked or not (see the module's doc); a sparse
    batch (the default) becomes dense when a config needs it.
    """

    float32_rows = False  # True: the torch-op passes keep float32 row sums (see _float32_rows)

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
        dense: bool = False,
    ) -> None:
        self.dense = dense
        given = (
            ("log_prob", log_prob),
            ("old_log_prob", old_log_prob),
            ("advantages", advantages),
            ("ref_log_prob", ref_log_prob),
            ("entropy", entropy),
            ("rollout_is_weights", rollout_is_weights),
        )
        self.shape = tuple(response_mask.shape)
        self.width = self.shape[1]
        # one loop reads each tensor's metadata once (a torch attribute costs ~50 ns, ~1 us cold)
        self.tensors = {}
        dtype = log_prob.dtype
        one_dtype = True
        for name, value in given:
            if value is None:
                continue
            self.tensors[name] = value.detach() if value.requires_grad else value
            if value.dtype != dtype:  # promote_types costs ~0.3 us a call; one dtype is the usual case
                dtype = torch.promote_types(dtype, value.dtype)
                one_dtype = False
        self.mask = response_mask.detach() if response_mask.requires_grad else response_mask
        self.mask = self.mask if self.mask.dtype == torch.bool else self.mask != 0
        self.dtype = dtype
        self.fast = dtype in _FAST_DTYPES
        self._cache: dict = {}
        self._lengths: list[float] | None = None
        self.native: native.Inputs | None = None  # the compiled loops' view of the inputs, when usable
        if self.fast:
            self._prepare(one_dtype)
        else:
            self._count(self.mask.sum(dim=-1))

    def densify(self) -> None:
        """From now on the compiled passes read every token (a seq-mean aggregation counts what lies
        under the mask): what the sparse passes left is dropped, to be computed again."""
        if not self.dense:
            self.dense = True
            self._cache.clear()
            if self.fast:
                self.ppo_kl = None

    def _count(self, n_row: Tensor) -> None:
        self.n_row = n_row  # (batch,) int64: valid tokens per row
        self.n_tokens = int(n_row.sum())
        self.n_seqs = int(torch.count_nonzero(n_row))

    @functools.cached_property
    def n_row(self) -> Tensor:
        """``(batch,)`` int64: valid tokens per row. :meth:`_count` sets it; after the compiled count it
        is built from that count's list when a loss first reads it (a tensor costs ~3 us to build, and
        most losses never read it)."""
        return torch.tensor(self._counts, dtype=torch.int64)

    @property
    def empty(self) -> bool:
        return self.n_tokens == 0

    # -- fast path -------------------------------------------------------------------------------
    # Every fused pass walks the batch in blocks of whole rows small enough that the block's inputs
    # and a dozen same-sized scratch buffers stay in the core's L2 cache (a full 64x4096 float32
    # tensor is 1 MiB: three of them already spill to L3, and an elementwise op then costs ~10x
    # more). The per-token values are the same floats whatever the blocking (elementwise ops), and
    # row sums reduce the same contiguous rows, so blocking changes no result.
    def _t(self, name: str) -> Tensor:
        value = self.tensors[name]
        return value if value.dtype == self.dtype else value.to(self.dtype)

    def _prepare(self, one_dtype: bool) -> None:
        """The per-row counts, from the mask's bytes (a bool -> float copy costs ~6x a uint8 one), and
        the inputs the compiled loops read (one dtype, contiguous: no copy when they already are).
        ``one_dtype``: every float tensor has the batch's dtype already."""
        self.finite = True  # until a fused sum says otherwise
        self.ppo_kl: float | None = None
        counted = None
        if native.module() is not None and self.mask.is_cpu:
            # the loops read the bool mask's own bytes (no uint8 view: ~1 us, ~4 us cold)
            mask = self.mask if self.mask.is_contiguous() else self.mask.contiguous()
            # the tensors as they are when Inputs can read them so (it checks them: the usual case
            # costs no second look at every tensor here), else converted to one contiguous dtype
            self.native = native.Inputs.of(self.tensors, mask) if one_dtype else None
            if self.native is None:
                self.native = native.Inputs.of(
                    {k: v if v.dtype == self.dtype and v.is_contiguous() else v.to(self.dtype).contiguous()
                     for k, v in self.tensors.items()},
                    mask,
                )  # fmt: skip
            counted = self.native.count_rows() if self.native is not None else None
        if counted is None:
            self._count(self._mask_u8.sum(dim=-1, dtype=torch.int32).to(torch.int64))
        else:  # one loop: the counts, verl's T + 1e-8 per row and the total (no torch op)
            self._counts, self._lengths, self.n_tokens = counted
            self.n_seqs = len(self._counts) - self._counts.count(0)

    @functools.cached_property
    def _mask_u8(self) -> Tensor:
        """The mask's bytes as a contiguous uint8 tensor, for the torch-op passes (built when one first
        reads it: the compiled loops read the bool mask itself)."""
        return self.mask.view(torch.uint8).contiguous()

    def _native_aux(self, entropy: bool, kl: str | None, check: bool) -> None:
        """The planned entropy / KL row sums and the k2 check by the compiled loop, into the cache
        (what a torch-op pass's :meth:`_Pass.rows` stores)."""
        if not (entropy or kl or check):
            return
        e = None
        if kl == "k3" and not native.inline_exp():  # exp by torch, between passes (else the loop's own)
            nt = self.native.tensors
            e = _take(self.shape, self.dtype, self.mask.device)
            torch.sub(nt["ref_log_prob"], nt["log_prob"], out=e).clamp_(-20.0, 20.0).exp_()
        try:
            ent_rows, kl_rows, k2 = self.native.aux(
                entropy=entropy, kl=kl, check=check, e=e, skip=not self.dense
            )
        finally:
            if e is not None:
                _give(e)
        self._store_aux(entropy, kl, check, ent_rows, kl_rows, k2)

    def _store_aux(self, entropy: bool, kl: str | None, check: bool, ent_rows, kl_rows, k2: float) -> None:
        """Cache what a compiled pass computed of the entropy / KL terms (what a torch-op pass's
        :meth:`_Pass.rows` stores): their row sums and whether the straight-through k2 is finite."""
        if entropy:
            self._cache["entropy"] = self._row_sums(ent_rows)
        if kl is not None:
            self._cache[("kl", kl)] = self._row_sums(kl_rows)
        if check:
            self._cache["k2_finite"] = math.isfinite(k2)

    def _pass(self, n_rows: int) -> _Pass:
        return _Pass(self, n_rows)

    def _row_sums(self, rows: list[float]) -> RowSums:
        """Row sums (summed in the token dtype per row: float32 cascade sums are good to ~1e-7
        relative); the totals over rows are exact (``math.fsum``)."""
        if self._lengths is None:
            self._lengths = (self.n_row.to(torch.float32) + 1e-8).tolist()
        rows = tuple(rows)
        if self.dtype == torch.float32:
            return self._row_sums_f32(rows)
        try:  # _total's fsum inline: this runs for every row-sum vector
            return RowSums(rows, math.fsum(rows), math.fsum(map(operator.truediv, rows, self._lengths)))
        except (ValueError, OverflowError):  # inf - inf, or an overflowing sum: _total's IEEE results
            return RowSums(rows, _total(rows), _total(list(map(operator.truediv, rows, self._lengths))))

    def _row_sums_f32(self, rows: tuple[float, ...]) -> RowSums:
        """:meth:`_row_sums` of a float32 batch: verl's seq-mean-token-mean divides the float32 row
        sums by ``T + 1e-8`` in float32 (``seq_losses``, a float32 tensor); where rows of opposite
        sign cancel (GRPO: one advantage per response, of either sign) the rounding of each quotient
        is a visible part of the result, so the quotients are float32 ones. An overflow is inf."""
        with np.errstate(over="ignore", invalid="ignore"):
            means32 = np.asarray(rows, dtype=np.float32) / np.asarray(self._lengths, dtype=np.float32)
        return RowSums(rows, _total(rows), _total(means32.tolist()))

    def _aux_plan(self, config: LossConfig | None) -> tuple[bool, str | None, bool]:
        """What a pass for ``config`` should compute on the side, not cached yet: the entropy row
        sums, the KL estimator's row sums (its base name) and the straight-through finiteness check."""
        if config is None:
            return False, None, False
        entropy = "entropy" in self.tensors and "entropy" not in self._cache
        kl, check = None, False
        if "ref_log_prob" in self.tensors and isinstance(config.kl_loss_type, KLType):
            kind = config.kl_loss_type if type(config.kl_loss_type) is KLType else KLType(config.kl_loss_type)
            base = kind.base
            kl = base if ("kl", base) not in self._cache else None
            check = kind.straight_through and "k2_finite" not in self._cache
        return entropy, kl, check

    def policy(self, low: float, high: float, c: float, *, config: LossConfig | None = None) -> PolicyStats:
        """Row sums of the clipped per-token loss and the clip counts for ratio bounds
        ``[1 - low, 1 + high]`` and dual-clip bound ``c`` (cached per setting). ``config``: also
        compute its entropy and KL row sums in the same pass."""
        key = ("pg", low, high, c)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        lo, hi = 1 - low, 1 + high  # python floats, rounded to the tensor dtype like verl's clamp
        need_kl = self.ppo_kl is None
        if self.native:
            stats = self._native_policy(key, lo, hi, c, config)
            if stats is not None:
                return stats
        with self._pass(1) as p:
            p.aux(config)
            kl_sum = bal = nonzero = guard = 0.0
            for m in p.blocks():
                lp, old, adv = p.x("log_prob"), p.x("old_log_prob"), p.x("advantages")
                # log-ratio, clamped to +-20 as verl does before exp; ppo_kl = masked mean of (old - new)
                r = torch.sub(lp, old, out=p.buf("r")).clamp_(-20.0, 20.0)
                if need_kl:
                    kl_sum += float(torch.dot(r.view(-1), m.view(-1)))
                r.exp_()
                # signs folded once: A m, A+ = max(A m, 0), A- = A+ - A m (exactly -A or 0)
                a = torch.mul(adv, m, out=p.buf("a"))
                a_pos = torch.clamp(a, min=0.0, out=p.buf("a+"))
                a_neg = torch.sub(a_pos, a, out=p.buf("a-"))
                # l = (-A) clamp(r, lo, c) for A < 0,  -(A min(r, hi)) for A > 0   (one term is 0, so
                # the fused multiply-add rounds like verl's separate ops)
                loss = torch.clamp(r, lo, c, out=p.buf("l")).mul_(a_neg)
                loss.addcmul_(torch.clamp(r, max=hi, out=p.buf("w")), a_pos, value=-1.0)
                p.row_sum(loss, 0)
                if self.dense:  # verl's loss with A unmasked: an inf under the mask is NaN in seq-mean
                    up = adv.clamp(min=0.0)
                    unmasked = torch.clamp(r, lo, c).mul_(up - adv).sub_(torch.clamp(r, max=hi).mul_(up))
                    guard += float(unmasked.mul_(0.0).sum())
                # z = A r + l:  z > 0 <=> verl's pg_losses2 > pg_losses1 (clipped, either side);
                #               z < 0 <=> A < 0 and (-A) r > (-A) c (dual clip), on the rounded products
                z = torch.mul(a, r, out=p.buf("w")).add_(loss).sign_().view(-1)
                bal += float(z.sum())  # exact small integers: (n+ - n-) and (n+ + n-)
                nonzero += float(torch.dot(z, z))
                p.aux_block(m)
            rows = p.rows()
        if need_kl:
            self.ppo_kl = -kl_sum / _eps_count(self.n_tokens)
            self.finite = self.finite and math.isfinite(kl_sum)
        self.finite = self.finite and math.isfinite(guard)
        n_clipped = (int(nonzero) + int(bal)) // 2
        stats = PolicyStats(
            rows=self._row_sums(rows[0]), n_clipped=n_clipped, n_dual_clipped=int(nonzero) - n_clipped
        )
        self._cache[key] = stats
        return stats

    def _native_policy(
        self, key: tuple, lo: float, hi: float, c: float, config: LossConfig | None
    ) -> PolicyStats | None:
        """Vanilla's row sums and clip counts by the compiled loops, with the entropy / KL terms
        ``config`` still needs in the same loop: one pass for the log-ratios, one torch ``exp`` over
        the ratio (and k3's ref ratio) buffer, one pass for the rest."""
        entropy, kl, check = self._aux_plan(config)
        if self.dense and not native.inline_exp():
            return None  # the packed passes see the valid tokens' loss only: the torch ops (see policy)
        if native.inline_exp():  # torch's own exp callable from the loop: one pass over the batch
            rows, n_clipped, n_dual, ent_rows, kl_rows, kl_sum, k2, guard = self.native.vfused(
                lo, hi, c, entropy=entropy, kl=kl, check=check, skip=not self.dense
            )
            # the guard: NaN where some input is not finite, and in a dense batch where verl's loss of
            # some token is not (it depends on the clip setting: checked on every pass)
            return self._native_policy_done(
                key, rows, n_clipped, n_dual, ent_rows, kl_rows, kl_sum, k2, entropy, kl, check, guard
            )
        k3 = kl == "k3"
        cap = self.n_tokens
        # sized by the batch's shape, not its valid count, so same-shaped batches reuse one buffer
        buf = _take(((1 + k3) * self.shape[0] * self.width,), self.dtype, self.mask.device)
        try:
            xd, xk = buf[:cap], (buf[cap : 2 * cap] if k3 else None)
            seen, kl_sum, k2, guard = self.native.vprep(xd, xk, cap, entropy=entropy, check=check)
            if seen != cap:  # mask bytes other than 0/1 (a bool view of other bytes): the torch ops
                return None
            buf[: (1 + k3) * cap].exp_()  # the valid tokens' ratios (and k3's exp(delta)): torch's exp
            rows, n_clipped, n_dual, ent_rows, kl_rows = self.native.vpacked(
                xd, xk, cap, lo, hi, c, entropy=entropy, kl=kl
            )
        finally:
            _give(buf)
        kl_sum += guard  # a non-finite input anywhere (guard is 0 otherwise) sends the batch to verl's ops
        return self._native_policy_done(
            key, rows, n_clipped, n_dual, ent_rows, kl_rows, kl_sum, k2, entropy, kl, check
        )

    def _native_policy_done(
        self, key, rows, n_clipped, n_dual, ent_rows, kl_rows, kl_sum, k2, entropy, kl, check, guard=0.0
    ) -> PolicyStats:
        if self.ppo_kl is None:
            self.ppo_kl = -kl_sum / _eps_count(self.n_tokens)
            self.finite = self.finite and math.isfinite(kl_sum)
        self.finite = self.finite and math.isfinite(guard)
        self._store_aux(entropy, kl, check, ent_rows, kl_rows, k2)
        stats = PolicyStats(rows=self._row_sums(rows), n_clipped=n_clipped, n_dual_clipped=n_dual)
        self._cache[key] = stats
        return stats

    def kl_rows(self, kind: KLType | str) -> RowSums:
        """Row sums ``(batch,)`` of the forward value of a KL estimator (``+`` has k's value)."""
        kind = kind if type(kind) is KLType else KLType(kind)
        key, straight_through = ("kl", kind.base), kind.straight_through  # properties: read once
        cache = self._cache
        missing, unchecked = key not in cache, straight_through and "k2_finite" not in cache
        if self.native and (missing or unchecked):
            self._native_aux(False, key[1] if missing else None, unchecked)
        if key not in cache or (straight_through and "k2_finite" not in cache):
            with self._pass(0) as p:
                p.plan(False, key[1] if key not in cache else None, straight_through)
                for m in p.blocks():
                    p.aux_block(m)
                p.rows()
        if straight_through and not cache["k2_finite"]:
            # verl's k2 - k2.detach() + f.detach() is NaN wherever k2 is not finite, even where the
            # clamped forward estimator is: NaN rows send the batch to the reference path
            return RowSums((math.nan,) * self.shape[0], math.nan, math.nan)
        return cache[key]

    def entropy_rows(self) -> RowSums:
        if "entropy" not in self._cache and self.native:
            self._native_aux(True, None, False)
        if "entropy" not in self._cache:
            with self._pass(0) as p:
                p.plan(True, None, False)
                for m in p.blocks():
                    p.aux_block(m)
                p.rows()
        return self._cache["entropy"]

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
        """verl's ``agg_loss`` from row sums: scalar arithmetic, no token pass (built-in modes only). A
        seq-mean mode needs a dense batch's row sums (:meth:`densify`)."""
        mode = mode if type(mode) is AggMode else AggMode(mode)
        if mode not in _TOKEN_MODES and not self.dense:
            raise RuntimeError(f"{mode} aggregates what lies under the mask: densify() the batch first")
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
        entry = pl.get_policy_loss(config.loss_mode)
        builtin = isinstance(config.loss_agg_mode, AggMode) and isinstance(config.kl_loss_type, KLType)
        seq_rows = config.loss_agg_mode not in _TOKEN_MODES or not entry.uses_agg_mode
        if not self.dense and seq_rows:
            self.densify()  # a seq-mean aggregation (sapo and geo_mean fix their own)
        if self.fast and self.finite and builtin:
            # a loss that draws (clip_cov) draws again on the float32 rows: from the same RNG state
            rng = torch.get_rng_state() if entry.random and seq_rows else None
            fused = _FUSED.get(entry.fn) if "rollout_is_weights" not in self.tensors else None
            if fused is not None:
                key = ("fused", _policy_key(config))
                pg = None if entry.random else self._cache.get(key)
                if pg is None:
                    pg = fused(self, config)
                    if pg is not None and not entry.random:
                        self._cache[key] = pg
                out = None if pg is None else self._aux_metrics(config, dict(pg), fast=True)
            else:
                out = self._aux_metrics(config, self.policy_metrics(config), fast=True)
            if out is not None:
                if seq_rows and self.dtype == torch.float32 and self._rows_cancel(config, entry):
                    if rng is not None:
                        torch.set_rng_state(rng)
                    return self._float32_rows().metrics(config)
                return out
            self.finite = False  # a non-finite sum: every later config takes the reference path too
        return self._reference_metrics(config)

    def _rows_cancel(self, config: LossConfig, entry) -> bool:
        """Whether the row sums a seq-mean aggregation of ``config`` adds (the loss's, the entropy's,
        the KL's) cancel so much that verl's float32 rounding of each row shows in the result: the sum
        of their magnitudes over ``CANCELLATION`` times the magnitude of their sum. (A row verl holds
        is within about an ulp of the float64 row here, so the result is then within
        ``CANCELLATION`` ulps of verl's, well inside the 1e-5 it is held to.)"""
        if self.float32_rows:
            return False
        mode = config.loss_agg_mode if entry.uses_agg_mode else AggMode.SEQ_MEAN_TOKEN_MEAN
        found = [self._cache.get(("pg_rows", _rows_key(config)))]
        found += [(self._cache.get("entropy"), None), (self._cache.get(("kl", _kl_base(config))), None)]
        for rows, fixed in (f for f in found if f is not None and f[0] is not None):
            by = mode if fixed is None else fixed
            terms = rows.rows
            if by is AggMode.SEQ_MEAN_TOKEN_MEAN:
                terms = tuple(map(operator.truediv, terms, self._lengths))
            magnitude = math.fsum(map(abs, terms))
            if magnitude > CANCELLATION * abs(math.fsum(terms)):
                return True
        return False

    def _float32_rows(self) -> TokenBatch:
        """This batch's twin whose passes are torch ops, for the configs that aggregate row by row.

        verl's seq-mean modes sum each row into a float32 tensor (``sum(loss * mask, -1)``) and add
        those up; the compiled loops sum rows in float64. Where rows (or a row's tokens) of opposite
        sign cancel, the float32 rounding of each row is a visible part of verl's result (relative
        errors of 1e-4 and more on a loss near 0), and only torch's own float32 row reduction
        reproduces it. So a float32 batch aggregated by a seq-mean mode whose rows cancel
        (:meth:`_rows_cancel`) takes the torch-op passes with float32 row sums; the token modes (verl: one float32 total over every token, close to the exact
        one) take float64 row sums, compiled or not. Float64 rows round below any tolerance. Built once
        per batch (its own cache)."""
        twin = self._cache.get("float32_rows")
        if twin is None:
            with native.disabled():
                twin = TokenBatch(**{**self.tensors, "response_mask": self.mask}, dense=True)
            twin.float32_rows = True
            self._cache["float32_rows"] = twin
        return twin

    def policy_metrics(self, config: LossConfig, *, raw: bool = False) -> dict[str, float]:
        """``pg_loss`` and the loss mode's own metrics from its registered function (no autograd),
        memoised per setting except for losses that draw random numbers (``clip_cov``). ``raw``: as the
        0-dim tensors the loss returned (half precision combines them in its own dtype)."""
        entry = pl.get_policy_loss(config.loss_mode)
        key = ("policy", _policy_key(config))
        hit = None if entry.random else self._cache.get(key)
        if hit is None:
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

    def pg_rows(self, config: LossConfig) -> tuple[RowSums, AggMode | None] | None:
        """The loss row sums the fused pass for ``config`` left (after :meth:`metrics`) and the
        aggregation the loss fixes (None: ``loss_agg_mode``'s); None when no fused pass ran (verl's op
        sequence, or a loss that averages its own way). Any aggregation is then :meth:`aggregate`."""
        return self._cache.get(("pg_rows", _rows_key(config)))

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
        info = _batch_info(config)
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
            if not all(map(math.isfinite, sums)):
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
        pg = _fused_vanilla(self, config)
        return None if pg is None else self._aux_metrics(config, pg, fast=True)

    # -- reference path --------------------------------------------------------------------------
    @property
    def empty_reference(self) -> bool:
        """True when the metrics already came from the reference path (nothing to arbitrate):
        half precision, or a batch a non-finite sum sent there."""
        return not (self.fast and self.finite)

    def reference_metrics(self, config: LossConfig) -> dict[str, float]:
        """``config``'s metrics by verl's own op sequence only (no compiled or fused pass): what an
        audit recomputes to decide when the fast path's numbers disagree with the trainer's.
        ``clip_cov`` draws its tokens again (an audit checks its pg_loss as a range)."""
        if config.use_kl_loss and "ref_log_prob" not in self.tensors:
            raise ValueError("ref_log_prob is required when use_kl_loss is True")
        return self._reference_metrics(config)

    def _reference_metrics(self, config: LossConfig) -> dict[str, float]:
        """verl's own op sequence (``losses.ppo_loss``), in the input dtype. The per-token matrices and
        their aggregations are memoised, so an audit trying many configs pays once per clip setting,
        KL estimator and aggregation."""
        t, mask = self.tensors, self.mask
        info = config.global_batch_info
        mode = config.loss_agg_mode
        entry = pl.POLICY_LOSSES.get(config.loss_mode)
        if entry is None or entry.fn is not pl.compute_policy_loss_vanilla or "rollout_is_weights" in t:
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


def _rows_key(config: LossConfig) -> tuple:
    """The settings a loss's per-token values depend on: :func:`_policy_key` less the aggregation.
    Memoised on the (frozen) config: the fast path asks for it several times a call."""
    key = config.__dict__.get("_rows_key")
    if key is None:
        key = config.__dict__["_rows_key"] = _make_rows_key(config)
    return key


def _batch_info(config: LossConfig) -> dict:
    """``config.global_batch_info`` (a property that builds a new dict) memoised on the config as
    :func:`_rows_key` is; only ever unpacked, never changed."""
    info = config.__dict__.get("_batch_info")
    if info is None:
        info = config.__dict__["_batch_info"] = config.global_batch_info
    return info


def _make_rows_key(config: LossConfig) -> tuple:
    return (
        config.loss_mode,
        config.clip_low,
        config.clip_high,
        config.clip_ratio_c,
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


def _policy_key(config: LossConfig) -> tuple:
    """Every setting a policy loss may read (all of LossConfig but the entropy / KL-term ones); memoised
    on the config as :func:`_rows_key` is."""
    key = config.__dict__.get("_policy_key")
    if key is None:
        key = (*_rows_key(config), str(config.loss_agg_mode), *config.global_batch_info.values())
        config.__dict__["_policy_key"] = key
    return key


# a float32 seq-mean aggregation takes verl's float32 row sums (TokenBatch._float32_rows) where the rows'
# magnitudes exceed their sum's this many times (TokenBatch._rows_cancel)
CANCELLATION = 100.0


def _kl_base(config: LossConfig) -> str | None:
    kind = config.kl_loss_type
    return kind.base if isinstance(kind, KLType) else None


# -- one fused pass over row blocks ---------------------------------------------------------------------
BLOCK_ELEMS = 1 << 15  # tokens per block (128 KiB of float32): inputs + scratch stay in L2


class _Pass:
    """Scratch for one fused pass of a :class:`TokenBatch`: blocks of whole rows, named block-sized
    buffers from the per-thread pool, and ``n_rows`` row-sum outputs (plus the entropy / KL row sums
    asked for with :meth:`plan`, cached on the batch when the pass ends)."""

    def __init__(self, batch: TokenBatch, n_rows: int) -> None:
        self.batch = batch
        b, width = batch.shape
        self.step = max(1, min(b, BLOCK_ELEMS // max(width, 1)))
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


def _masked_mean_exact(batch: TokenBatch, name: str) -> Tensor:
    """verl's ``masked_mean(x, mask)`` as a 0-dim tensor, bit for bit: the same full-tensor
    reduction of the same values (``x`` times the 0/1 mask equals ``where(mask, x, 0) * mask``
    for finite ``x``)."""
    values = torch.mul(batch._t(name), batch._mask_u8)
    count = torch.tensor(_eps_count(batch.n_tokens), dtype=torch.float32)
    return values.sum() / count


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
    from .rollout import rollout_correction

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
        rejected = TokenBatch(
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


# verl's function -> its fused pass
_FUSED = {
    pl.compute_policy_loss_vanilla: _fused_vanilla,
    pl.compute_policy_loss_gpg: _fused_gpg,
    pl.compute_policy_loss_dro: _fused_dro,
    pl.compute_policy_loss_cispo: _fused_cispo,
    pl.compute_policy_loss_gspo: _fused_gspo,
    pl.compute_policy_loss_sapo: _fused_sapo,
    pl.compute_policy_loss_geo_mean: _fused_geo_mean,
    pl.compute_policy_loss_dppo_tv: lambda b, c: _fused_dppo(b, c, binary_kl=False),
    pl.compute_policy_loss_dppo_kl: lambda b, c: _fused_dppo(b, c, binary_kl=True),
    pl.compute_policy_loss_clip_cov: _fused_clip_cov,
    pl.compute_policy_loss_kl_cov: _fused_kl_cov,
    pl.compute_policy_loss_bypass_mode: _fused_bypass,
}
