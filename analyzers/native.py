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
    # Each returns row sums of the mode's torch-op pass (kernels._fused_<mode>) before its sign, as
    # floats, and the masked sum of the log-ratio where the mode reports ppo_kl. The passes that read
    # logp compute the entropy / KL-estimator terms of :meth:`aux` in the same loop (``side``, from
    # :meth:`side_terms`) and return them last, as :meth:`aux` does.

    def side_terms(
        self, *, entropy: bool = False, kl: str | None = None, check: bool = False, e: Tensor | None = None
    ) -> tuple[tuple, Tensor | None, Tensor | None]:
        """The aux loop's arguments for a losses-A pass (checked as :meth:`aux` checks them)."""
        code = KL_CODES[kl]
        need = code or check
        if need and "ref_log_prob" not in self.tensors:
            raise ValueError("the KL row sums need ref_log_prob")
        if code == 4 and e is None:
            raise ValueError("k3 needs exp(clamp(ref - lp, -20, 20))")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        ent_out = torch.empty(self.rows, dtype=torch.float64) if entropy else None
        kl_out = torch.empty(self.rows, dtype=torch.float64) if code else None
        args = (
            self._p("entropy" if entropy else None), self._p("ref_log_prob" if need else None),
            self.scratch(e).data_ptr() if code == 4 else 0, code, check,
            0 if ent_out is None else ent_out.data_ptr(), 0 if kl_out is None else kl_out.data_ptr(),
        )  # fmt: skip
        return args, ent_out, kl_out

    _NO_SIDE = ((0, 0, 0, 0, False, 0, 0), None, None)

    @staticmethod
    def _side_out(side, k2: float) -> tuple[list[float] | None, list[float] | None, float]:
        _, ent_out, kl_out = side
        return (
            None if ent_out is None else ent_out.tolist(),
            None if kl_out is None else kl_out.tolist(),
            k2,
        )

    def logratios(self, r: Tensor | None, e: Tensor | None) -> None:
        """Fill ``r`` with ``clamp(logp - old, -20, 20)`` and ``e`` with ``clamp(ref - logp, -20, 20)``
        (either may be None), for torch's exp."""
        if e is not None and "ref_log_prob" not in self.tensors:
            raise ValueError("e needs ref_log_prob")
        _MODULE.logratios(
            self.f64, self._p("log_prob"), self._p("old_log_prob"),
            self._p("ref_log_prob" if e is not None else None), self.rows, self.width,
            0 if r is None else self.scratch(r).data_ptr(), 0 if e is None else self.scratch(e).data_ptr(),
        )  # fmt: skip

    def _rows_out(self, n: int = 1) -> Tensor:
        return torch.empty((n, self.rows), dtype=torch.float64)

    def _per_row(self, values: Tensor) -> Tensor:
        """``values`` if the loops may read it as one float per row, in the inputs' dtype."""
        if (
            values.shape != (self.rows,)
            or values.dtype != (torch.float64 if self.f64 else torch.float32)
            or not values.is_contiguous()
            or values.device.type != "cpu"
        ):
            raise ValueError("per-row values do not match the inputs")
        return values

    def gpg(self, side=_NO_SIDE) -> tuple[list[float], tuple]:
        """Row sums of ``logp A m``."""
        out = self._rows_out()
        k2 = _MODULE.gpg(
            self.f64, self._p("log_prob"), self._p("advantages"), self.mask.data_ptr(), self.rows, self.width,
            out.data_ptr(), *side[0],
        )  # fmt: skip
        return out[0].tolist(), self._side_out(side, k2)

    def dro(self, half_beta: float, side=_NO_SIDE) -> tuple[list[float], float, tuple]:
        """Row sums of ``(logp A - half_beta (logp - old)^2) m`` and the masked sum of ``logp - old``."""
        out = self._rows_out()
        kl, k2 = _MODULE.dro(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, half_beta, out.data_ptr(), *side[0],
        )  # fmt: skip
        return out[0].tolist(), kl, self._side_out(side, k2)

    def cispo(self, r: Tensor, lo: float, hi: float, side=_NO_SIDE) -> tuple[list[float], float, int, tuple]:
        """Row sums of ``clamp(r, lo, hi) A logp m``, the masked sum of ``clamp(logp - old, -20, 20)``
        and the count of valid tokens with ``r != clamp(r, lo, hi)``; ``r`` holds the exp of that."""
        r = self.scratch(r)
        out = self._rows_out()
        kl, hits, k2 = _MODULE.cispo(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), r.data_ptr(), self._p("advantages"),
            self.mask.data_ptr(), self.rows, self.width, lo, hi, out.data_ptr(), *side[0],
        )  # fmt: skip
        return out[0].tolist(), kl, hits, self._side_out(side, k2)

    def sapo_gate(self, r: Tensor, tau_pos: float, tau_neg: float, side=_NO_SIDE) -> tuple[float, tuple]:
        """Overwrite ``r`` (``exp(clamp(logp - old, -20, 20))``) with ``(r - 1) tau`` (``tau_pos``
        where ``A > 0``, else ``tau_neg``); return the masked sum of the clamped log-ratio."""
        r = self.scratch(r)
        kl, k2 = _MODULE.sapo_gate(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), r.data_ptr(), self._p("advantages"),
            self.mask.data_ptr(), self.rows, self.width, tau_pos, tau_neg, r.data_ptr(), *side[0],
        )  # fmt: skip
        return kl, self._side_out(side, k2)

    def sapo(self, gates: Tensor, q_pos: float, q_neg: float) -> list[float]:
        """Row sums of ``((gates q) A) m``, ``q = q_pos`` where ``A > 0``, else ``q_neg``."""
        gates = self.scratch(gates)
        out = self._rows_out()
        _MODULE.sapo(
            self.f64, gates.data_ptr(), self._p("advantages"), self.mask.data_ptr(), self.rows, self.width,
            q_pos, q_neg, out.data_ptr(),
        )  # fmt: skip
        return out[0].tolist()

    def gspo_logratio(self, d: Tensor, side=_NO_SIDE) -> tuple[Tensor, tuple]:
        """``d`` filled with ``(logp - old) m``."""
        d = self.scratch(d)
        k2 = _MODULE.gspo_logratio(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self.mask.data_ptr(), self.rows,
            self.width, d.data_ptr(), *side[0],
        )  # fmt: skip
        return d, self._side_out(side, k2)

    def gspo(self, s: Tensor, lo: float, hi: float) -> tuple[list[float], int]:
        """Row sums of GSPO's loss for the sequence ratios ``s`` (one per row) and the count of tokens
        it clips."""
        s = self._per_row(s)
        out = self._rows_out()
        hits = _MODULE.gspo(
            self.f64, self._p("advantages"), self.mask.data_ptr(), s.data_ptr(), self.rows, self.width, lo, hi,
            out.data_ptr(),
        )  # fmt: skip
        return out[0].tolist(), hits

    def geo_mean(
        self, lo: float, hi: float, side=_NO_SIDE
    ) -> tuple[list[float], list[float], float, int, int, tuple]:
        """Row sums of the sign-clipped log-ratio and of ``A m``, the masked sum of ``logp - old`` and
        the counts of clipped valid tokens with ``A > 0`` and with ``A < 0`` (bounds ``-lo``, ``hi``)."""
        out = self._rows_out(2)
        kl, pos, neg, k2 = _MODULE.geo_mean(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, -lo, hi, out[0].data_ptr(), out[1].data_ptr(), *side[0],
        )  # fmt: skip
        v, a = out.tolist()
        return v, a, kl, pos, neg, self._side_out(side, k2)

    # -- losses B (dppo_tv, dppo_kl, clip_cov, kl_cov): csrc/losses_b.h --------------------------------

    # -- rollout correction: csrc/rollout.h -------------------------------------------------------------
