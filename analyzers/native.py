"""The compiled token passes (``analyzers/csrc``), behind checked wrappers.

verl computes each loss as a dozen or more full-tensor torch ops; rlvitals computes the same per-token
floats in one C loop per loss (``_fused``, GCC vector extensions, an AVX2 copy picked at import when the
CPU has it), reading each input once and writing only per-row sums. Only what C cannot reproduce bit for
bit, ``exp`` (and ``sigmoid``/``log`` in the losses that use them), is computed by torch first, into a
buffer the loop reads. See ``csrc/_fused.c`` for how the floats stay verl's.

The extension is optional: ``pip install`` builds it when a C compiler is there, and without it (or with
``RLVITALS_NATIVE=0``, or a build older than the sources beside it) every pass runs as torch ops, with
the same results to within float32 summation order. :data:`STATUS` says which, and why.

The wrappers check every tensor a pointer is taken from (CPU, contiguous, the dtype and shape the loop
reads): the C code trusts them, so nothing reaches it that could make it read out of bounds.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path

import torch

Tensor = torch.Tensor
# KL estimator codes of the aux loop (KLType.base)
KL_CODES = {None: 0, "k1": 1, "abs": 2, "k2": 3, "k3": 4}


CSRC = Path(__file__).with_name("csrc")


def _load(csrc: Path = CSRC):
    if os.environ.get("RLVITALS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled (RLVITALS_NATIVE=0): torch ops"
    try:
        from . import _fused
    except ImportError as exc:
        return None, f"not built ({exc}): torch ops; `pip install -e .` with a C compiler builds it"
    if csrc.is_dir():  # a source checkout: refuse a build older than the sources
        # setup.py compiles in the same hash: every .c and .h file of csrc, in name order
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(csrc.glob("*.[ch]")))).hexdigest()
        if digest != _fused.SOURCE_SHA:
            return (
                None,
                "stale build (analyzers/csrc changed since it was built): torch ops; rebuild with `pip install -e .`",
            )
    return _fused, f"compiled ({_fused.ISA})"


_MODULE, STATUS = _load()
_enabled = _MODULE is not None


def module():
    """The extension when it is built, current and enabled; else None."""
    return _MODULE if _enabled else None


@contextmanager
def disabled():
    """Run the torch-op passes inside the block (the tests run both paths)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


class Inputs:
    """One micro-batch's tensors as the loops read them, checked once: CPU, contiguous, one float
    dtype (float32 or float64), one 2-D shape, and the mask as 0/1 bytes of that shape. Every method
    passes the C loops only pointers into these tensors or into buffers it checks the same way."""

    __slots__ = ("f64", "mask", "rows", "shape", "tensors", "width")

    def __init__(self, tensors: dict[str, Tensor], mask_u8: Tensor) -> None:
        if _MODULE is None or not tensors:
            raise ValueError("the compiled passes are not available")
        first = next(iter(tensors.values()))
        if first.dtype not in (torch.float32, torch.float64) or first.dim() != 2:
            raise ValueError("the compiled passes read 2-D float32 / float64 tensors")
        for name, t in tensors.items():
            if (
                t.device.type != "cpu"
                or not t.is_contiguous()
                or t.dtype != first.dtype
                or t.shape != first.shape
            ):
                raise ValueError(
                    f"{name}: the compiled passes read CPU, contiguous tensors of one dtype and shape"
                )
        if (
            mask_u8.dtype != torch.uint8
            or mask_u8.shape != first.shape
            or not mask_u8.is_contiguous()
            or mask_u8.device.type != "cpu"
        ):
            raise ValueError("the compiled passes read the mask as contiguous CPU bytes of the same shape")
        self.tensors, self.mask = tensors, mask_u8
        self.f64 = first.dtype == torch.float64
        self.shape = tuple(first.shape)
        self.rows, self.width = self.shape

    @classmethod
    def of(cls, tensors: dict[str, Tensor], mask_u8: Tensor) -> Inputs | None:
        """The checked inputs, or None when the loops cannot read them in place (or are off)."""
        if not _enabled:
            return None
        try:
            return cls(tensors, mask_u8)
        except ValueError:
            return None

    def scratch(self, buf: Tensor) -> Tensor:
        """``buf`` if the loops may read it as a token-sized tensor of these inputs."""
        if (
            buf.shape != self.shape
            or buf.dtype != next(iter(self.tensors.values())).dtype
            or not buf.is_contiguous()
            or buf.device.type != "cpu"
        ):
            raise ValueError("scratch buffer does not match the inputs")
        return buf

    def _p(self, name: str | None) -> int:
        return 0 if name is None else self.tensors[name].data_ptr()

    def vanilla(self, r: Tensor, lo: float, hi: float, c: float) -> tuple[list[float], float, int, int]:
        """Row sums of verl's vanilla per-token loss, the masked sum of the clamped log-ratio, and the
        counts of clipped and dual-clipped tokens. ``r`` holds ``exp(clamp(lp - old, -20, 20))``."""
        r = self.scratch(r)
        out = torch.empty(self.rows, dtype=torch.float64)
        kl, pos, neg = _MODULE.vanilla(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), r.data_ptr(), self._p("advantages"),
            self.mask.data_ptr(), self.rows, self.width, lo, hi, c, out.data_ptr(),
        )  # fmt: skip
        return out.tolist(), kl, pos, neg

    def aux(
        self, *, entropy: bool, kl: str | None, check: bool, e: Tensor | None = None
    ) -> tuple[list[float] | None, list[float] | None, float]:
        """Entropy row sums, KL-estimator row sums (``kl``: ``KLType.base``; ``e`` holds
        ``exp(clamp(ref - lp, -20, 20))`` for k3) and the sum of ``(lp - ref)^2`` when ``check``."""
        code = KL_CODES[kl]
        need = code or check
        if need and not {"log_prob", "ref_log_prob"} <= self.tensors.keys():
            raise ValueError("the KL row sums need log_prob and ref_log_prob")
        if code == 4 and e is None:
            raise ValueError("k3 needs exp(clamp(ref - lp, -20, 20))")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        e_ptr = self.scratch(e).data_ptr() if code == 4 else 0
        ent_out = torch.empty(self.rows, dtype=torch.float64) if entropy else None
        kl_out = torch.empty(self.rows, dtype=torch.float64) if code else None
        k2 = _MODULE.aux(
            self.f64, self.mask.data_ptr(), self._p("entropy" if entropy else None),
            self._p("log_prob" if need else None), self._p("ref_log_prob" if need else None), e_ptr,
            self.rows, self.width, code, check,
            0 if ent_out is None else ent_out.data_ptr(), 0 if kl_out is None else kl_out.data_ptr(),
        )  # fmt: skip
        return (
            None if ent_out is None else ent_out.tolist(),
            None if kl_out is None else kl_out.tolist(),
            k2,
        )

    # -- losses A (gpg, dro, cispo, sapo, gspo, geo_mean): csrc/losses_a.h ----------------------------

    # -- losses B (dppo_tv, dppo_kl, clip_cov, kl_cov): csrc/losses_b.h --------------------------------

    # -- rollout correction: csrc/rollout.h -------------------------------------------------------------
    # Inputs of rollout.py: tensors {"old_log_prob", "rollout_log_prob"}. Row outputs are float64 tensors
    # (rollout.py rounds them to the token dtype, as verl's sums are); counts are exact.
    def _rows(self, k: int) -> Tensor:
        return torch.empty((k, self.rows), dtype=torch.float64)

    def _vector(self, v: Tensor) -> Tensor:
        """``v`` if the loops may read it as one value per row in the token dtype."""
        if (
            v.shape != (self.rows,)
            or v.dtype != next(iter(self.tensors.values())).dtype
            or not v.is_contiguous()
            or v.device.type != "cpu"
        ):
            raise ValueError("per-row vector does not match the inputs")
        return v

    def rc_off(self, e: Tensor, rho: Tensor, dm: Tensor) -> tuple[Tensor, Tensor, list[float], bool]:
        """Off-policy sums: rows ``(3, rows)`` of sum(old m), sum(rollout m), sum(d m) (d = old -
        rollout; ``dm`` receives d m), valid tokens per row, totals [sum((e - d - 1) m), sum(rho^2 m)],
        and whether some |d| > 20 (then ``rho`` must be ``exp(clamp(d, -20, 20))``, not ``e = exp(d)``)."""
        e, rho, dm = self.scratch(e), self.scratch(rho), self.scratch(dm)
        rows, counts, tot = (
            self._rows(3),
            torch.empty(self.rows, dtype=torch.int64),
            torch.empty(2, dtype=torch.float64),
        )
        big = _MODULE.rc_off(
            self.f64, self._p("old_log_prob"), self._p("rollout_log_prob"), e.data_ptr(), rho.data_ptr(),
            self.mask.data_ptr(), self.rows, self.width, dm.data_ptr(), rows.data_ptr(), counts.data_ptr(),
            tot.data_ptr(),
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
        _MODULE.rc_ist(
            self.f64, rho.data_ptr(), self.mask.data_ptr(), self.rows, self.width, icepop, lower, upper,
            w.data_ptr(), sq.data_ptr(), rows.data_ptr(), tot.data_ptr(), cnt.data_ptr(), mm.data_ptr(),
        )  # fmt: skip
        return w, rows, tot.tolist(), cnt.tolist(), mm.tolist()

    def rc_ess(self, w: Tensor, upper: float, c: float, bn: float | None) -> float:
        """sum(((clamp(w, 0, upper) / c)^2) m); with ``bn``, ``w /= bn`` in place."""
        w = self.scratch(w)
        return _MODULE.rc_ess(
            self.f64, w.data_ptr(), self.mask.data_ptr(), self.rows, self.width, upper, c, bn is not None,
            0.0 if bn is None else bn,
        )  # fmt: skip

    def rc_fill(self, values: Tensor) -> Tensor:
        """``values[i] * m`` on every token of row i (a new tensor of the token dtype)."""
        values = self._vector(values)
        out = torch.empty(self.shape, dtype=values.dtype)
        _MODULE.rc_fill(
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
            or keep.device.type != "cpu"
        ):  # fmt: skip
            raise ValueError("keep must be contiguous CPU bytes of the inputs' shape")
        if token and (x1 is None or x2 is None):
            raise ValueError("a token-level option writes cl m and (cl cl) m into x1, x2")
        x1 = None if x1 is None else self.scratch(x1)
        x2 = None if x2 is None or not token else self.scratch(x2)
        rows = self._rows(2)
        rej = torch.empty(self.rows, dtype=torch.int64) if token else None
        tot, cnt, mm = (torch.empty(2, dtype=d) for d in (torch.float64, torch.int64, torch.float64))
        _MODULE.rc_rs(
            self.f64, self._p("old_log_prob"), self._p("rollout_log_prob"), rho.data_ptr(), self.mask.data_ptr(),
            self.rows, self.width, kind, token, k1, lower, upper, clamp_lower,
            keep.data_ptr() if token else 0, 0 if x1 is None else x1.data_ptr(), 0 if x2 is None else x2.data_ptr(),
            rows.data_ptr(), rej.data_ptr() if token else 0, tot.data_ptr(), cnt.data_ptr(), mm.data_ptr(),
        )  # fmt: skip
        return rows, rej, tot.tolist(), cnt.tolist(), mm.tolist()

    def rc_dbg(self, a: Tensor, r: Tensor) -> list[float]:
        """``a = exp(old)``, ``r = exp(rollout)``, ``diff = |a - r|``: [sum(a m), sum(r m), sum(diff m), max
        diff over valid tokens, valid tokens, and with x, y, e = a, r, diff less their values at the first
        valid token: sum(x m), sum(y m), sum(e m), sum(e^2 m), sum(x y m), sum(x^2 m), sum(y^2 m)]."""
        a, r = self.scratch(a), self.scratch(r)
        out = torch.empty(12, dtype=torch.float64)
        _MODULE.rc_dbg(
            self.f64, a.data_ptr(), r.data_ptr(), self.mask.data_ptr(), self.rows, self.width, out.data_ptr()
        )
        return out.tolist()
