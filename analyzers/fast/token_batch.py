"""A micro-batch of token tensors, reduced once to row sums (:class:`TokenBatch`): every aggregation mode,
global-normalisation variant and coefficient what-if is then scalar arithmetic on them (see
:mod:`rlvitals.analyzers.fast.kernels` for how the passes stay exact)."""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import torch

from ..contract.config import AggMode, KLType, LossConfig
from ..reference import policy_losses as pl
from ..reference.losses import agg_loss, capture_agg_inputs, clipped_token_losses, kl_penalty
from . import native
from .kernels import _FUSED
from .modes import _fused_vanilla
from .passes import _Pass
from .workspace import (
    _FAST_DTYPES,
    _TOKEN_MODES,
    CANCELLATION,
    PolicyStats,
    RowSums,
    Tensor,
    _batch_info,
    _eps_count,
    _give,
    _kl_base,
    _policy_key,
    _rows_key,
    _take,
    _total,
    ieee_div,
)


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
