"""The compiled passes of dppo (tv / binary kl), clip_cov, kl_cov (``csrc/losses_b.h``) and of the rollout
correction (``csrc/rollout.h``), as methods :class:`~rlvitals.analyzers.fast.native.Inputs` inherits: the
same checked wrappers as the rest of :mod:`rlvitals.analyzers.fast.native` (every pointer handed to C is
taken from a tensor checked for device, layout, dtype and shape)."""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def _row_ptrs(out: Tensor) -> list[int]:
    """The address of each row of a contiguous 2-D tensor (no per-row view: indexing costs ~1 us)."""
    base, step = out.data_ptr(), out.stride(0) * out.element_size()
    return [base + k * step for k in range(out.shape[0])]


class CovAndRolloutCalls:
    """Methods of :class:`~rlvitals.analyzers.fast.native.Inputs` (which sets ``_lib``, the extension, and
    the checked tensors these read)."""

    __slots__ = ()

    # -- losses B (dppo_tv, dppo_kl, clip_cov, kl_cov): csrc/losses_b.h --------------------------------

    def _need(self, *names: str) -> None:
        if not set(names) <= self.tensors.keys():
            raise ValueError(f"this pass reads {', '.join(names)}")

    def dppo_pack(self, n_valid: int, out: Tensor | None = None) -> Tensor:
        """``(3, n_valid)``: the valid tokens' ``clamp(lp - old, -20, 20)``, ``lp`` and ``old`` (row-major),
        the values whose ``exp`` :meth:`dppo` reads (into ``out`` when given)."""
        self._need("log_prob", "old_log_prob")
        dtype = torch.float64 if self.f64 else torch.float32
        x = torch.empty((3, n_valid), dtype=dtype) if out is None else self._packed(out, 3)
        if x.shape[1] != n_valid:
            raise ValueError("out: one column per valid token")
        n = self._lib.dppo_pack(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self.mask.data_ptr(), self.rows, self.width,
            x.data_ptr(), n_valid,
        )  # fmt: skip
        if n != n_valid:
            raise ValueError(f"the mask has {n} valid tokens, not {n_valid}")
        return x

    def _packed(self, x: Tensor, rows: int) -> Tensor:
        if x.dtype != (torch.float64 if self.f64 else torch.float32) or x.dim() != 2 or x.shape[0] != rows:
            raise ValueError("not a packed buffer of these inputs")
        if not x.is_contiguous() or not x.is_cpu:
            raise ValueError("packed buffers are contiguous CPU tensors")
        return x

    def dppo(
        self, x: Tensor, log_frac: Tensor | None, lo: float, hi: float, c: float
    ) -> tuple[list[float], float, int, int]:
        """DPPO-Binary-TV (``log_frac`` None) or -KL: row sums of verl's per-token loss, the masked sum of
        the clamped log-ratio, the count of valid-by-divergence tokens under the mask and of those the
        ones with ``r > c``. ``x``: :meth:`dppo_pack`'s buffer after ``exp`` (r, p, q of the valid
        tokens); ``log_frac = log(dppo_frac(p, q))``; ``lo`` / ``hi`` are the divergence bounds."""
        self._need("log_prob", "old_log_prob", "advantages")
        x = self._packed(x, 3)
        n = x.shape[1]
        frac = 0 if log_frac is None else self._packed(log_frac.view(1, -1), 1).data_ptr()
        if log_frac is not None and log_frac.numel() != n:
            raise ValueError("log_frac: one value per valid token")
        out = torch.empty(self.rows, dtype=torch.float64)
        kl, kept, lower = self._lib.dppo(
            self.f64, log_frac is not None, self._p("log_prob"), self._p("old_log_prob"), x.data_ptr(), frac, n,
            self._p("advantages"), self.mask.data_ptr(), self.rows, self.width, lo, hi, c, out.data_ptr(),
        )  # fmt: skip
        return out.tolist(), kl, kept, lower

    def dppo_frac(self, x: Tensor) -> Tensor:
        """``((1 - q) + 1e-8) / ((1 - p) + 1e-8)`` (dppo_kl's log argument, verl's ops) of the packed
        ``p = x[1]``, ``q = x[2]``."""
        x = self._packed(x, 3)
        out = torch.empty(x.shape[1], dtype=x.dtype)
        _, p, q = _row_ptrs(x)
        self._lib.dppo_frac(self.f64, p, q, x.shape[1], out.data_ptr())
        return out

    def clip_cov_pack(self, n_valid: int, am: Tensor, lm: Tensor) -> tuple[float, Tensor]:
        """Clip-Cov's first pass: ``A m`` into ``am`` and ``lp m`` into ``lm`` (token-sized; their sums are
        verl's masked sums), the masked sum of ``lp - old``, and ``lp - old`` of the valid tokens packed
        (row-major, ``n_valid``)."""
        self._need("log_prob", "old_log_prob", "advantages")
        am, lm = self.scratch(am), self.scratch(lm)
        vd = torch.empty(n_valid, dtype=am.dtype)
        kl, n = self._lib.clip_cov_pack(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, am.data_ptr(), lm.data_ptr(), vd.data_ptr(), n_valid,
        )  # fmt: skip
        if n != n_valid:
            raise ValueError(f"the mask has {n} valid tokens, not {n_valid}")
        return kl, vd

    def _packed_ratio(self, r: Tensor) -> Tensor:
        dtype = torch.float64 if self.f64 else torch.float32
        if r.dtype != dtype or r.dim() != 1 or not r.is_contiguous() or not r.is_cpu:
            raise ValueError("r: the packed ratios, a contiguous CPU vector of the inputs' dtype")
        return r

    def clip_cov(
        self, r: Tensor, lo: float, hi: float, mean_a: float, mean_lp: float, lb: float, ub: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Clip-Cov's loss row sums (float64 tensor, every token) and the candidates to drop (valid, not
        clipped, ``lb < cov < ub``) as flat and as packed indices, row-major (verl's nonzero order).
        ``r``: the packed ratios (:meth:`clip_cov_pack`'s vector after exp); ``mean_*``: verl's means."""
        self._need("log_prob", "advantages")
        r = self._packed_ratio(r)
        out = torch.empty(self.rows, dtype=torch.float64)
        cap = r.numel()
        cand, cand_q = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.int64)
        n = self._lib.clip_cov(
            self.f64, self._p("log_prob"), self._p("advantages"), r.data_ptr(), r.numel(), self.mask.data_ptr(),
            self.rows, self.width, lo, hi, mean_a, mean_lp, lb, ub, out.data_ptr(), cand.data_ptr(),
            cand_q.data_ptr(), cap,
        )  # fmt: skip
        if n > cap:
            raise ValueError("more candidates than packed tokens: r is not this mask's")
        return out, cand[:n], cand_q[:n]

    def clip_cov_fix(
        self, rows: Tensor, r: Tensor, cand: Tensor, cand_q: Tensor, sel: Tensor, lo: float, hi: float
    ) -> None:
        """Take the drawn candidates ``cand[sel]``'s loss ``max(-A r, -A clamp(r, lo, hi))`` off ``rows``."""
        self._need("advantages")
        r = self._packed_ratio(r)
        if rows.dtype != torch.float64 or rows.shape != (self.rows,) or not rows.is_contiguous():
            raise ValueError("rows: clip_cov's float64 row sums")
        n = cand.numel()
        for x in (cand, cand_q):
            if x.dtype != torch.int64 or x.shape != (n,) or not x.is_contiguous():
                raise ValueError("cand / cand_q: clip_cov's index vectors")
        sel = sel.to(torch.int64).contiguous().view(-1)
        rc = self._lib.clip_cov_fix(
            self.f64, self._p("advantages"), r.data_ptr(), r.numel(), self.rows * self.width, self.width,
            cand.data_ptr(), cand_q.data_ptr(), n, sel.data_ptr(), sel.numel(), lo, hi, rows.data_ptr(),
        )  # fmt: skip
        if rc:
            raise ValueError("a drawn index out of range")

    def kl_cov_pack(self, n_valid: int) -> tuple[float, bool, Tensor, Tensor, Tensor]:
        """KL-Cov's pass over the tokens: the masked sum of ``|lp - old|``, whether every advantage is
        finite, and verl's ``advantages[mask]``, ``log_prob[mask]`` with ``lp - old`` of the same tokens
        (``n_valid`` of them, row-major, three separate vectors)."""
        self._need("log_prob", "old_log_prob", "advantages")
        dtype = torch.float64 if self.f64 else torch.float32
        va, vl, vd = (torch.empty(n_valid, dtype=dtype) for _ in range(3))
        abs_sum, a_sum, n = self._lib.kl_cov_pack(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, va.data_ptr(), vl.data_ptr(), vd.data_ptr(), n_valid,
        )  # fmt: skip
        if n != n_valid:
            raise ValueError(f"the mask has {n} valid tokens, not {n_valid}")
        return abs_sum, math.isfinite(a_sum), va, vl, vd

    def kl_cov_rows(
        self, va: Tensor, vl: Tensor, r: Tensor, n_row: Tensor, mean_a: float, mean_lp: float
    ) -> tuple[Tensor, Tensor]:
        """Row sums (float64 tensor) of ``-A r`` over each row's packed tokens (``n_row`` per row) and
        verl's covariance ``(va - mean_a) (vl - mean_lp)``, from :meth:`kl_cov_pack`'s vectors."""
        dtype = torch.float64 if self.f64 else torch.float32
        n = va.numel()
        for x in (va, vl, r):
            if x.dtype != dtype or x.shape != (n,) or not x.is_contiguous() or not x.is_cpu:
                raise ValueError(
                    "kl_cov_rows reads contiguous CPU vectors of the inputs' dtype and one length"
                )
        n_row = n_row.to(torch.int64).contiguous()
        if n_row.shape != (self.rows,) or int(n_row.min()) < 0 or int(n_row.sum()) != n:
            raise ValueError("n_row: one count per row, summing to the vectors' length")
        out, cov = torch.empty(self.rows, dtype=torch.float64), torch.empty(n, dtype=dtype)
        self._lib.kl_cov_rows(
            self.f64, va.data_ptr(), vl.data_ptr(), r.data_ptr(), n_row.data_ptr(), self.rows, mean_a, mean_lp,
            out.data_ptr(), cov.data_ptr(),
        )  # fmt: skip
        return out, cov

    def kl_cov_fix(self, rows: Tensor, r: Tensor, n_row: Tensor, sel: Tensor, coef: float) -> None:
        """Add to ``rows`` (:meth:`kl_cov_rows`'s) what verl's loss adds on the packed tokens ``sel`` (the
        top-k): ``(-A r + coef |lp - old|) - (-A r)`` per token, on its row."""
        self._need("log_prob", "old_log_prob", "advantages")
        dtype = torch.float64 if self.f64 else torch.float32
        if rows.dtype != torch.float64 or rows.shape != (self.rows,) or not rows.is_contiguous():
            raise ValueError("rows: kl_cov_rows's float64 row sums")
        if r.dtype != dtype or r.dim() != 1 or not r.is_contiguous() or not r.is_cpu:
            raise ValueError("r: the packed ratios")
        if n_row.shape != (self.rows,):
            raise ValueError("n_row: one count per row")
        offsets = torch.zeros(self.rows + 1, dtype=torch.int64)
        torch.cumsum(n_row, 0, out=offsets[1:])
        if int(offsets[-1]) != r.numel():
            raise ValueError("n_row must sum to the packed length")
        sel = sel.to(torch.int64).contiguous().view(-1)
        rc = self._lib.kl_cov_fix(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, offsets.data_ptr(), r.data_ptr(), sel.data_ptr(), sel.numel(), coef,
            rows.data_ptr(),
        )  # fmt: skip
        if rc:
            raise ValueError("a packed index out of range, or per-row counts that do not match the mask")

    # -- rollout correction: csrc/rollout.h -------------------------------------------------------------
    # Inputs of rollout.py: tensors {"old_log_prob", "rollout_log_prob"}. Row outputs are float64 tensors
    # (rollout.py rounds them to the token dtype, as verl's sums are); counts are exact.
    def _vector(self, v: Tensor) -> Tensor:
        """``v`` if the loops may read it as one value per row in the token dtype."""
        if (
            v.shape != (self.rows,)
            or v.dtype != next(iter(self.tensors.values())).dtype
            or not v.is_contiguous()
            or not v.is_cpu
        ):
            raise ValueError("per-row vector does not match the inputs")
        return v

    def rc_off(
        self, e: Tensor | None, rho: Tensor | None, dm: Tensor, rho_out: Tensor | None = None
    ) -> tuple[Tensor, Tensor, list[float], bool]:
        """Off-policy sums: rows ``(3, rows)`` of sum(old m), sum(rollout m), sum(d m) (d = old -
        rollout; ``dm`` receives d m), valid tokens per row, totals [sum((e - d - 1) m), sum(rho^2 m)],
        and whether some |d| > 20 (then ``rho`` must be ``exp(clamp(d, -20, 20))``, not ``e = exp(d)``).
        ``e`` and ``rho`` None: the pass takes ``e = rho = exp(d)`` inline over the valid spans (only with
        :func:`inline_exp`; its results are the buffers' only while it says no |d| > 20), and ``rho_out``
        (if given) receives that exp per token, 0 outside the valid spans."""
        if (e is None) != (rho is None) or (e is None and not self._inline_exp()):
            raise ValueError("rc_off takes both exp buffers, or neither with the inline exp")
        if e is not None and rho_out is not None:
            raise ValueError("rc_off writes rho_out only when it takes exp inline")
        ptrs = (0, 0) if e is None else (self.scratch(e).data_ptr(), self.scratch(rho).data_ptr())
        dm = self.scratch(dm)
        out_ptr = 0 if rho_out is None else self.scratch(rho_out).data_ptr()
        rows, counts, tot = (
            self._rows(3),
            torch.empty(self.rows, dtype=torch.int64),
            torch.empty(2, dtype=torch.float64),
        )
        big = self._lib.rc_off(
            self.f64, self._p("old_log_prob"), self._p("rollout_log_prob"), *ptrs, self.mask.data_ptr(),
            self.rows, self.width, dm.data_ptr(), rows.data_ptr(), counts.data_ptr(), tot.data_ptr(), out_ptr,
        )  # fmt: skip
        return rows, counts, tot.tolist(), big

    def rc_is_token(
        self, rho: Tensor, icepop: bool, lower: float, upper: float, sq: Tensor
    ) -> tuple[Tensor, Tensor, list[float], list[int], list[float]]:
        """Token IS weights from ``rho = exp(clamp(d, -20, 20))``: the weights (TIS: min(rho m, upper);
        IcePop: rho m inside [lower, upper], else 0), rows ``(2, rows)`` of sum(w m), sum(rho m), totals
        of the clamped weights and their squares, counts of valid raw > upper / < lower, max / min of w.
        ``sq`` (token-sized) receives (cl cl) m, cl = clamp(w, 0, upper)."""
        rho, sq = self.scratch(rho), self.scratch(sq)
        w = torch.empty(self.shape, dtype=rho.dtype)
        rows, tot = self._rows(2), torch.empty(2, dtype=torch.float64)
        cnt, mm = torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.float64)
        self._lib.rc_ist(
            self.f64, rho.data_ptr(), self.mask.data_ptr(), self.rows, self.width, icepop, lower, upper,
            w.data_ptr(), sq.data_ptr(), rows.data_ptr(), tot.data_ptr(), cnt.data_ptr(), mm.data_ptr(),
        )  # fmt: skip
        return w, rows, tot.tolist(), cnt.tolist(), mm.tolist()

    def rc_ess(self, w: Tensor, upper: float, c: float, bn: float | None) -> float:
        """sum(((clamp(w, 0, upper) / c)^2) m); with ``bn``, ``w /= bn`` in place."""
        w = self.scratch(w)
        return self._lib.rc_ess(
            self.f64, w.data_ptr(), self.mask.data_ptr(), self.rows, self.width, upper, c, bn is not None,
            0.0 if bn is None else bn,
        )  # fmt: skip

    def rc_fill(self, values: Tensor) -> Tensor:
        """``values[i] * m`` on every token of row i (a new tensor of the token dtype)."""
        values = self._vector(values)
        out = torch.empty(self.shape, dtype=values.dtype)
        self._lib.rc_fill(
            self.f64, values.data_ptr(), self.mask.data_ptr(), self.rows, self.width, out.data_ptr()
        )
        return out

    def rc_rs(
        self,
        rho: Tensor,
        kind: int,
        keep: Tensor | None = None,
        *,
        k1: bool = False,
        lower: float = 0.0,
        upper: float = 0.0,
        clamp_lower: float = 0.0,
        x1: Tensor | None = None,
        x2: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, list[float], list[int], list[float]]:
        """A rejection statistic (kind 1/2/3: k1 = -safe, k2 = safe^2 / 2, k3 = rho - 1 - safe): rows
        ``(2, rows)`` of sum(s m) and max of s over valid tokens (-inf for none). With ``keep`` (uint8 of
        the inputs' shape: a token-level option, and then token-sized ``x1``, ``x2``) also:
        ``keep &= (lower <= s if k1) & (s <= upper)``, valid tokens rejected per row, totals of
        cl = clamp(s, clamp_lower, upper) and its square (``x1`` / ``x2`` receive cl m and (cl cl) m),
        counts of valid s > upper / s < lower, max / min of s over valid tokens. Without ``keep``, ``x1``
        (if given) receives s m."""
        rho = self.scratch(rho)
        token = keep is not None
        if token and (
            keep.shape != self.shape or keep.dtype != torch.uint8 or not keep.is_contiguous()
            or not keep.is_cpu
        ):  # fmt: skip
            raise ValueError("keep must be contiguous CPU bytes of the inputs' shape")
        if token and (x1 is None or x2 is None):
            raise ValueError("a token-level option writes cl m and (cl cl) m into x1, x2")
        x1 = None if x1 is None else self.scratch(x1)
        x2 = None if x2 is None or not token else self.scratch(x2)
        rows = self._rows(2)
        rej = torch.empty(self.rows, dtype=torch.int64) if token else None
        tot, cnt, mm = (torch.empty(2, dtype=d) for d in (torch.float64, torch.int64, torch.float64))
        self._lib.rc_rs(
            self.f64, self._p("old_log_prob"), self._p("rollout_log_prob"), rho.data_ptr(), self.mask.data_ptr(),
            self.rows, self.width, kind, token, k1, lower, upper, clamp_lower,
            keep.data_ptr() if token else 0, 0 if x1 is None else x1.data_ptr(), 0 if x2 is None else x2.data_ptr(),
            rows.data_ptr(), rej.data_ptr() if token else 0, tot.data_ptr(), cnt.data_ptr(), mm.data_ptr(),
        )  # fmt: skip
        return rows, rej, tot.tolist(), cnt.tolist(), mm.tolist()

    def rc_dbg(self, a: Tensor | None = None, r: Tensor | None = None) -> list[float]:
        """``a = exp(old)``, ``r = exp(rollout)``, ``diff = |a - r|``: [sum(a m), sum(r m), sum(diff m), max
        diff over valid tokens, valid tokens, and with x, y, e = a, r, diff less their values at the first
        valid token: sum(x m), sum(y m), sum(e m), sum(e^2 m), sum(x y m), sum(x^2 m), sum(y^2 m)].
        ``a`` and ``r`` None: the pass takes both exps inline (only with :func:`inline_exp`), of
        ``old_log_prob`` and ``rollout_log_prob``, on the valid spans only."""
        if (a is None) != (r is None) or (a is None and not self._inline_exp()):
            raise ValueError("rc_dbg takes both exp buffers, or neither with the inline exp")
        ptrs = (0, 0) if a is None else (self.scratch(a).data_ptr(), self.scratch(r).data_ptr())
        out = torch.empty(12, dtype=torch.float64)
        self._lib.rc_dbg(
            self.f64, *ptrs, self._p("old_log_prob"), self._p("rollout_log_prob"), self.mask.data_ptr(),
            self.rows, self.width, out.data_ptr(),
        )  # fmt: skip
        return out.tolist()
