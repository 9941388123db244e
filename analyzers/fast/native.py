"""The compiled token passes (``analyzers/csrc``), behind checked wrappers.

verl computes each loss as a dozen or more full-tensor torch ops; rlvitals computes the same per-token
floats in one C loop per loss (``_fused``, GCC vector extensions, an AVX2 copy picked at import when the
CPU has it), reading each input once and writing only per-row sums. What C cannot reproduce bit for bit,
``exp`` (and ``sigmoid``/``log`` in the losses that use them), is torch's: its own exp called from inside
the loops where :func:`inline_exp` holds (vanilla, gpg, dro, cispo, sapo's ratio, gspo, geo_mean, k3,
the rollout debug metrics), else computed by torch first into a buffer the loop reads. See
``csrc/_fused.c`` for how the floats stay verl's.

The extension is optional: ``pip install`` builds it when a C compiler is there, and without it (or with
``RLVITALS_NATIVE=0``, or a build older than the sources beside it) every pass runs as torch ops, with
the same results to within float32 summation order. :data:`STATUS` says which, and why.

The wrappers check every tensor a pointer is taken from (CPU, contiguous, the dtype and shape the loop
reads): the C code trusts them, so nothing reaches it that could make it read out of bounds.

``skip`` (vanilla's :meth:`Inputs.vfused`, :meth:`Inputs.aux`, and gpg / dro / cispo through
:meth:`Inputs.side_terms`): the loop does not read the groups of 8 (float64: 4) tokens with none valid.
Their values then reach no sum, which is what verl's ``masked_sum`` (``where(mask, x, 0)``) gives in the
token-mean / token-sum aggregations and masked means; the seq-mean aggregations multiply by the mask, so
a NaN, an inf or an overflowing product there counts, and those run without ``skip``
(``token_batch.TokenBatch``'s dense batches).
"""

from __future__ import annotations

import hashlib
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from .native_calls import CovAndRolloutCalls

Tensor = torch.Tensor
# KL estimator codes of the aux loop (KLType.base)
KL_CODES = {None: 0, "k1": 1, "abs": 2, "k2": 3, "k3": 4}


CSRC = Path(__file__).parents[1] / "csrc"  # analyzers/csrc: the extension sits at the package root


def _load(csrc: Path = CSRC):
    if os.environ.get("RLVITALS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled (RLVITALS_NATIVE=0): torch ops"
    try:
        from .. import _fused
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


def _exp_test_values(dtype: torch.dtype) -> Tensor:
    """What the loops feed exp: clamped log-ratios in [-20, 20] (a spread, random values, values near
    0), plus the edges a NaN or an infinity becomes. ~65k values: a few ms at import. (Offline, every
    float32 in [-20, 20] was compared, in chunks of 7, 256 and all at once: no difference.)"""
    g = torch.Generator().manual_seed(0)
    spread = torch.linspace(-20.0, 20.0, 1 << 15, dtype=torch.float64).to(dtype)
    random = (torch.rand(1 << 14, generator=g, dtype=torch.float64) * 40 - 20).to(dtype)
    small = torch.randn(1 << 14, generator=g, dtype=torch.float64).to(dtype) * 1e-3
    edges = torch.tensor([0.0, -0.0, 20.0, -20.0, 1e-30, -1e-30, math.nan], dtype=dtype)
    return torch.cat([spread, random, small, edges])


def _inline_exp() -> tuple[bool, str]:
    """Resolve torch's exp (MKL's vsExp / vdExp on an MKL build) from the library torch loaded, and keep
    it only if, called in the loops' chunks, it gives torch.exp's bits on every test value in both
    dtypes. Then the loops can take exp inline (one pass over the batch)."""
    if _MODULE is None:
        return False, ""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    found = _MODULE.set_exp(str(lib) if lib.exists() else None)
    if not all(found):
        _MODULE.set_exp(None)
        return False, "exp by torch between passes (its exp is not MKL's here)"
    for dtype, bits in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        x = _exp_test_values(dtype)
        got = torch.empty_like(x)
        _MODULE.exp_chunks(dtype == torch.float64, x.data_ptr(), got.data_ptr(), x.numel())
        if not torch.equal(got.view(bits), torch.exp(x).view(bits)):
            _MODULE.set_exp(None)
            return False, "exp by torch between passes (MKL's exp differs from torch.exp here)"
    return True, "exp inline (torch's own, MKL's vsExp/vdExp, checked bit for bit at import)"


_INLINE_EXP, _exp_status = _inline_exp()
if _exp_status:
    STATUS = f"{STATUS}; {_exp_status}"


def inline_exp() -> bool:
    """Whether the loops may take exp inline (see :func:`_inline_exp`)."""
    return _INLINE_EXP and _enabled


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


@contextmanager
def exp_between_passes():
    """Run the compiled loops with torch's exp between passes, not inline (the tests run both)."""
    global _INLINE_EXP
    before, _INLINE_EXP = _INLINE_EXP, False
    try:
        yield
    finally:
        _INLINE_EXP = before


def count_rows(mask_u8: Tensor) -> tuple[list[int], list[float], int] | None:
    """Per-row valid-token counts, verl's ``T_i + 1e-8`` per row (float32, as floats) and the total, in
    one pass over a contiguous CPU uint8 ``(rows, width)`` mask (the loop returns the lists itself);
    None when the loops are off or cannot read it."""
    if (
        _MODULE is None
        or not _enabled
        or mask_u8.dtype != torch.uint8
        or mask_u8.dim() != 2
        or not mask_u8.is_contiguous()
        or not mask_u8.is_cpu
    ):
        return None
    rows, width = mask_u8.shape
    return _MODULE.count_rows(mask_u8.data_ptr(), rows, width)


_MASK_KINDS = {torch.int64: 0, torch.int32: 1, torch.float32: 2, torch.float64: 3}


def mask_bytes(mask: Tensor) -> tuple[bool, Tensor | None]:
    """``(mask != 0)`` as contiguous uint8 in one pass, for a contiguous CPU int64 / int32 / float32 /
    float64 mask: (True, the bytes), or (True, None) when some value is neither 0 nor 1 (NaN included);
    (False, None) where the pass does not apply (the caller converts with torch ops)."""
    kind = _MASK_KINDS.get(mask.dtype)
    if _MODULE is None or not _enabled or kind is None or not mask.is_contiguous() or not mask.is_cpu:
        return False, None
    out = torch.empty(mask.shape, dtype=torch.uint8)
    if not _MODULE.rc_mask(kind, mask.data_ptr(), mask.numel(), out.data_ptr()):
        return True, None
    return True, out


_MASK_BYTES = (torch.uint8, torch.bool)  # one byte per token: a bool tensor's storage is its bytes


class Inputs(CovAndRolloutCalls):
    """One micro-batch's tensors as the loops read them, checked once: CPU, contiguous, one float
    dtype (float32 or float64), one non-empty 2-D shape, and the mask as 0/1 bytes of that shape (uint8, or a
    bool tensor, whose bytes are the ones a uint8 view of it would show). Every method passes the C
    loops only pointers into these tensors or into buffers it checks the same way."""

    __slots__ = ("_lib", "f64", "mask", "rows", "shape", "tensors", "width")

    def __init__(self, tensors: dict[str, Tensor], mask_u8: Tensor) -> None:
        if _MODULE is None or not tensors:
            raise ValueError("the compiled passes are not available")
        self._lib = _MODULE  # the methods of CovAndRolloutCalls call it through this
        first = next(iter(tensors.values()))
        dtype, shape = first.dtype, first.shape  # read once (each torch attribute costs ~50 ns, ~1 us cold)
        # a tensor with no elements may have data_ptr 0, which the loops read as "no such tensor"
        if dtype not in (torch.float32, torch.float64) or len(shape) != 2 or 0 in shape:
            raise ValueError("the compiled passes read non-empty 2-D float32 / float64 tensors")
        for name, t in tensors.items():
            if not t.is_cpu or not t.is_contiguous() or t.dtype != dtype or t.shape != shape:
                raise ValueError(
                    f"{name}: the compiled passes read CPU, contiguous tensors of one dtype and shape"
                )
        if (
            mask_u8.dtype not in _MASK_BYTES
            or mask_u8.shape != shape
            or not mask_u8.is_contiguous()
            or not mask_u8.is_cpu
        ):
            raise ValueError("the compiled passes read the mask as contiguous CPU bytes of the same shape")
        self.tensors, self.mask = tensors, mask_u8
        self.f64 = dtype == torch.float64
        self.shape = tuple(shape)
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

    def count_rows(self) -> tuple[list[int], list[float], int]:
        """:func:`count_rows` of the mask these inputs checked (no second check of it)."""
        return _MODULE.count_rows(self.mask.data_ptr(), self.rows, self.width)

    def scratch(self, buf: Tensor) -> Tensor:
        """``buf`` if the loops may read it as a token-sized tensor of these inputs."""
        if (
            buf.shape != self.shape
            or buf.dtype != next(iter(self.tensors.values())).dtype
            or not buf.is_contiguous()
            or not buf.is_cpu
        ):
            raise ValueError("scratch buffer does not match the inputs")
        return buf

    def _p(self, name: str | None) -> int:
        return 0 if name is None else self.tensors[name].data_ptr()

    def vfused(
        self,
        lo: float,
        hi: float,
        c: float,
        *,
        entropy: bool,
        kl: str | None,
        check: bool,
        skip: bool = False,
    ) -> tuple[list[float], int, int, list[float] | None, list[float] | None, float, float, float]:
        """Vanilla in one pass with exp inline (only when :func:`inline_exp`): row sums of the loss,
        clip counts, entropy and KL-estimator row sums, then the masked sum of the clamped log-ratio,
        the sum of ``(ref - lp)^2`` when ``check`` and the guard sum (NaN exactly when some input is
        not finite). ``skip``: the groups of tokens with none valid are not read (see the module's doc)."""
        if not inline_exp():
            raise ValueError("no checked inline exp")
        code = KL_CODES[kl]
        need_ref = code or check
        if need_ref and "ref_log_prob" not in self.tensors:
            raise ValueError("no ref_log_prob tensor")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        rows, ent_rows, kl_rows, pos, neg, kl_sum, k2, guard = _MODULE.vfused(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("ref_log_prob" if need_ref else None),
            self._p("advantages"), self._p("entropy" if entropy else None), self.mask.data_ptr(), self.rows,
            self.width, lo, hi, c, code, check, skip,
        )  # fmt: skip
        return rows, pos, neg, ent_rows, kl_rows, kl_sum, k2, guard

    def packed(self, buf: Tensor, cap: int) -> Tensor:
        """``buf`` if the loops may write / read ``cap`` packed values there (1-D, contiguous, CPU, the
        inputs' dtype)."""
        if (
            buf.dim() != 1
            or buf.numel() < cap
            or buf.dtype != next(iter(self.tensors.values())).dtype
            or not buf.is_contiguous()
            or not buf.is_cpu
        ):
            raise ValueError("packed buffer does not match the inputs")
        return buf

    def vprep(
        self, xd: Tensor, xk: Tensor | None, cap: int, *, entropy: bool, check: bool
    ) -> tuple[int, float, float, float]:
        """Vanilla's packed log-ratios: ``xd`` gets ``clamp(lp - old, -20, 20)`` of the valid tokens in
        row-major order, ``xk`` (k3) ``clamp(ref - lp, -20, 20)``. Returns the valid-token count seen,
        the masked sum of the log-ratio, the sum of ``(ref - lp)^2`` when ``check`` and a guard sum
        that is NaN exactly when some input (any token, masked or not) is not finite."""
        need_ref = xk is not None or check
        if need_ref and "ref_log_prob" not in self.tensors:
            raise ValueError("no ref_log_prob tensor")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        xd = self.packed(xd, cap)
        xk_ptr = 0 if xk is None else self.packed(xk, cap).data_ptr()
        return _MODULE.vprep(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("ref_log_prob" if need_ref else None),
            self._p("advantages"), self._p("entropy" if entropy else None), self.mask.data_ptr(), self.rows,
            self.width, check, xd.data_ptr(), xk_ptr, cap,
        )  # fmt: skip

    def vpacked(
        self,
        xr: Tensor,
        xe: Tensor | None,
        cap: int,
        lo: float,
        hi: float,
        c: float,
        *,
        entropy: bool,
        kl: str | None,
    ) -> tuple[list[float], int, int, list[float] | None, list[float] | None]:
        """:meth:`vanilla` over :meth:`vprep`'s packed vectors after torch's exp (``xr`` the ratios,
        ``xe`` k3's ``exp(delta)``); groups of tokens with none valid are skipped."""
        code = KL_CODES[kl]
        if code and not {"log_prob", "ref_log_prob"} <= self.tensors.keys():
            raise ValueError("the KL row sums need log_prob and ref_log_prob")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        if code == 4 and xe is None:
            raise ValueError("k3 needs the packed exp(clamp(ref - lp, -20, 20))")
        xr = self.packed(xr, cap)
        xe_ptr = self.packed(xe, cap).data_ptr() if code == 4 else 0
        rows, ent_rows, kl_rows, pos, neg = _MODULE.vpacked(
            self.f64, xr.data_ptr(), xe_ptr, cap, self._p("advantages"), self.mask.data_ptr(), self.rows,
            self.width, lo, hi, c, self._p("entropy" if entropy else None),
            self._p("log_prob" if code else None), self._p("ref_log_prob" if code else None), code,
        )  # fmt: skip
        return rows, pos, neg, ent_rows, kl_rows

    def aux(
        self, *, entropy: bool, kl: str | None, check: bool, e: Tensor | None = None, skip: bool = False
    ) -> tuple[list[float] | None, list[float] | None, float]:
        """Entropy row sums, KL-estimator row sums (``kl``: ``KLType.base``; ``e`` holds
        ``exp(clamp(ref - lp, -20, 20))`` for k3; none: the loop takes it inline, only with
        :func:`inline_exp`) and the sum of ``(lp - ref)^2`` when ``check``; ``skip`` as :meth:`vfused`'s."""
        code = KL_CODES[kl]
        need = code or check
        if need and not {"log_prob", "ref_log_prob"} <= self.tensors.keys():
            raise ValueError("the KL row sums need log_prob and ref_log_prob")
        if code == 4 and e is None and not inline_exp():
            raise ValueError("k3 needs exp(clamp(ref - lp, -20, 20))")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        e_ptr = self.scratch(e).data_ptr() if code == 4 and e is not None else 0
        return _MODULE.aux(
            self.f64, self.mask.data_ptr(), self._p("entropy" if entropy else None),
            self._p("log_prob" if need else None), self._p("ref_log_prob" if need else None), e_ptr,
            self.rows, self.width, code, check, skip,
        )  # fmt: skip

    # -- losses A (gpg, dro, cispo, sapo, gspo, geo_mean): csrc/losses_a.h ----------------------------
    # Each returns row sums of the mode's torch-op pass (kernels._fused_<mode>) before its sign, as
    # floats (lists the loop builds: no output tensor here), and the masked sum of the log-ratio where
    # the mode reports ppo_kl. The passes that read logp compute the entropy / KL-estimator terms of
    # :meth:`aux` in the same loop (``side``, from :meth:`side_terms`) and return them last, as
    # :meth:`aux` does.

    def side_terms(
        self,
        *,
        entropy: bool = False,
        kl: str | None = None,
        check: bool = False,
        e: Tensor | None = None,
        skip: bool = False,
    ) -> tuple:
        """The aux loop's arguments for a losses-A pass, checked as :meth:`aux` checks them (the pass
        returns the entropy row sums only with ``entropy``, the KL ones only with ``kl``). k3 with no
        ``e``: the pass takes that exp inline (only with :func:`inline_exp`). ``skip`` (as
        :meth:`vfused`'s) goes with them: gpg, dro and cispo skip, the others read every token whatever
        it says."""
        code = KL_CODES[kl]
        need = code or check
        if need and "ref_log_prob" not in self.tensors:
            raise ValueError("the KL row sums need ref_log_prob")
        if code == 4 and e is None and not inline_exp():
            raise ValueError("k3 needs exp(clamp(ref - lp, -20, 20)) (no inline exp here)")
        if entropy and "entropy" not in self.tensors:
            raise ValueError("no entropy tensor")
        return (
            self._p("entropy" if entropy else None), self._p("ref_log_prob" if need else None),
            self.scratch(e).data_ptr() if code == 4 and e is not None else 0, code, check, skip,
        )  # fmt: skip

    _NO_SIDE = (0, 0, 0, 0, False, False)

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

    def _rows(self, k: int) -> Tensor:
        """``k`` float64 per row, ``(k, rows)``: several row sums of one pass."""
        return torch.empty((k, self.rows), dtype=torch.float64)

    def _per_row(self, values: Tensor) -> Tensor:
        """``values`` if the loops may read it as one float per row, in the inputs' dtype."""
        if (
            values.shape != (self.rows,)
            or values.dtype != (torch.float64 if self.f64 else torch.float32)
            or not values.is_contiguous()
            or not values.is_cpu
        ):
            raise ValueError("per-row values do not match the inputs")
        return values

    def gpg(self, side=_NO_SIDE) -> tuple[list[float], tuple]:
        """Row sums of ``logp A m``."""
        rows, *aux = _MODULE.gpg(
            self.f64, self._p("log_prob"), self._p("advantages"), self.mask.data_ptr(), self.rows, self.width,
            *side,
        )  # fmt: skip
        return rows, tuple(aux)

    def dro(self, half_beta: float, side=_NO_SIDE) -> tuple[list[float], float, tuple]:
        """Row sums of ``(logp A - half_beta (logp - old)^2) m`` and the masked sum of ``logp - old``."""
        rows, kl, *aux = _MODULE.dro(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, half_beta, *side,
        )  # fmt: skip
        return rows, kl, tuple(aux)

    def _ratio(self, r: Tensor | None) -> int:
        """The pointer of a pass's ratio buffer, or 0: the pass takes the exp inline."""
        if r is None:
            if not inline_exp():
                raise ValueError("no ratio buffer and no inline exp")
            return 0
        return self.scratch(r).data_ptr()

    def cispo(
        self, r: Tensor | None, lo: float, hi: float, side=_NO_SIDE
    ) -> tuple[list[float], float, int, tuple]:
        """Row sums of ``clamp(r, lo, hi) A logp m``, the masked sum of ``clamp(logp - old, -20, 20)``
        and the count of valid tokens with ``r != clamp(r, lo, hi)``; ``r`` holds the exp of that (None:
        the pass takes it inline)."""
        r_ptr = self._ratio(r)
        rows, kl, hits, *aux = _MODULE.cispo(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), r_ptr, self._p("advantages"),
            self.mask.data_ptr(), self.rows, self.width, lo, hi, *side,
        )  # fmt: skip
        return rows, kl, hits, tuple(aux)

    def sapo_gate(
        self, r: Tensor | None, x: Tensor, tau_pos: float, tau_neg: float, side=_NO_SIDE
    ) -> tuple[float, tuple]:
        """Write ``(r - 1) tau`` (``tau_pos`` where ``A > 0``, else ``tau_neg``) into ``x`` (which may be
        ``r``), ``r`` being ``exp(clamp(logp - old, -20, 20))`` (None: the pass takes it inline); return
        the masked sum of the clamped log-ratio."""
        r_ptr, x = self._ratio(r), self.scratch(x)
        kl, *aux = _MODULE.sapo_gate(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), r_ptr, self._p("advantages"),
            self.mask.data_ptr(), self.rows, self.width, tau_pos, tau_neg, x.data_ptr(), *side,
        )  # fmt: skip
        return kl, tuple(aux)

    def sapo(self, gates: Tensor, q_pos: float, q_neg: float) -> list[float]:
        """Row sums of ``((gates q) A) m``, ``q = q_pos`` where ``A > 0``, else ``q_neg``."""
        gates = self.scratch(gates)
        return _MODULE.sapo(
            self.f64, gates.data_ptr(), self._p("advantages"), self.mask.data_ptr(), self.rows, self.width,
            q_pos, q_neg,
        )  # fmt: skip

    def gspo_logratio(self, d: Tensor, side=_NO_SIDE) -> tuple[Tensor, tuple]:
        """``d`` filled with ``(logp - old) m``."""
        d = self.scratch(d)
        aux = _MODULE.gspo_logratio(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self.mask.data_ptr(), self.rows,
            self.width, d.data_ptr(), *side,
        )  # fmt: skip
        return d, aux

    def gspo(self, s: Tensor, lo: float, hi: float) -> tuple[list[float], int]:
        """Row sums of GSPO's loss for the sequence ratios ``s`` (one per row) and the count of tokens
        it clips."""
        s = self._per_row(s)
        rows, hits = _MODULE.gspo(
            self.f64, self._p("advantages"), self.mask.data_ptr(), s.data_ptr(), self.rows, self.width, lo, hi
        )
        return rows, hits

    def geo_mean(
        self, lo: float, hi: float, side=_NO_SIDE
    ) -> tuple[list[float], list[float], float, int, int, tuple]:
        """Row sums of the sign-clipped log-ratio and of ``A m``, the masked sum of ``logp - old`` and
        the counts of clipped valid tokens with ``A > 0`` and with ``A < 0`` (bounds ``-lo``, ``hi``)."""
        v, a, kl, pos, neg, *aux = _MODULE.geo_mean(
            self.f64, self._p("log_prob"), self._p("old_log_prob"), self._p("advantages"), self.mask.data_ptr(),
            self.rows, self.width, -lo, hi, *side,
        )  # fmt: skip
        return v, a, kl, pos, neg, tuple(aux)

    @staticmethod
    def _inline_exp() -> bool:
        return inline_exp()  # read per call: exp_between_passes() changes it
