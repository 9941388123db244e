"""The fast path's buffers and scalar arithmetic: a per-thread pool of token-sized buffers, IEEE
division as verl's 0-dim tensors do it, the row sums a pass returns, and the memo keys of a config."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..contract.config import AggMode, KLType, LossConfig

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
