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
(``kernels.TokenBatch``'s dense batches).
"""

from __future__ import annotations

import hashlib
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch

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


def _row_ptrs(out: Tensor) -> list[int]:
    """The address of each row of a contiguous 2-D tensor (no per-row view: indexing costs ~1 us)."""
    base, step = out.data_ptr(), out.stride(0) * out.element_size()
    return [base + k * step for k in range(out.shape[0])]


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


class Inputs:
    """One micro-batch's tensors as the loops read them, checked once: CPU, contiguous, one float
    dtype (float32 or float64), one non-empty 2-D shape, and the mask as 0/1 bytes of that shape (uint8, or a
    bool tensor, whose bytes are the ones a uint8 view of it would show). Every method passes the C
    loops only pointers into these tensors or into buffers it checks the same way."""

    __slots__ = ("f64", "mask", "rows", "shape", "tensors", "width")

    def __init__(self, tensors: dict[str, Tensor], mask_u8: Tensor) -> None:
        if _MODULE is None or not tensors:
            raise ValueError("the compiled passes are not available")
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
        n = _MODULE.dppo_pack(
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
        kl, kept, lower = _MODULE.dppo(
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
        _MODULE.dppo_frac(self.f64, p, q, x.shape[1], out.data_ptr())
        return out

    def clip_cov_pack(self, n_valid: int, am: Tensor, lm: Tensor) -> tuple[float, Tensor]:
        """Clip-Cov's first pass: ``A m`` into ``am`` and ``lp m`` into ``lm`` (token-sized; their sums are
        verl's masked sums), the masked sum of ``lp - old``, and ``lp - old`` of the valid tokens packed
        (row-major, ``n_valid``)."""
        self._need("log_prob", "old_log_prob", "advantages")
        am, lm = self.scratch(am), self.scratch(lm)
        vd = torch.empty(n_valid, dtype=am.dtype)
        kl, n = _MODULE.clip_cov_pack(
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
        n = _MODULE.clip_cov(
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
        rc = _MODULE.clip_cov_fix(
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
        abs_sum, a_sum, n = _MODULE.kl_cov_pack(
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
        _MODULE.kl_cov_rows(
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
        rc = _MODULE.kl_cov_fix(
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
        if (e is None) != (rho is None) or (e is None and not inline_exp()):
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
        big = _MODULE.rc_off(
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
        _MODULE.rc_rs(
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
        if (a is None) != (r is None) or (a is None and not inline_exp()):
            raise ValueError("rc_dbg takes both exp buffers, or neither with the inline exp")
        ptrs = (0, 0) if a is None else (self.scratch(a).data_ptr(), self.scratch(r).data_ptr())
        out = torch.empty(12, dtype=torch.float64)
        _MODULE.rc_dbg(
            self.f64, *ptrs, self._p("old_log_prob"), self._p("rollout_log_prob"), self.mask.data_ptr(),
            self.rows, self.width, out.data_ptr(),
        )  # fmt: skip
        return out.tolist()
