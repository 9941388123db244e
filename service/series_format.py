"""The binary form of a history answer (``GET /api/v1/runs/{id}/metrics?format=binary``): every point
as fixed-width little-endian columns, which a reader takes as arrays without parsing a number.

Layout (documented in docs/server.md, decoded by ``rlvitals.client.history.decode_series``):

- ``b"RLVS"``, then the header's length in bytes (``uint32``), then the header: UTF-8 JSON
  ``{"version": 1, "series": [{"name": ..., "points": n, "nulls": bool, "wall_time": bool}, ...]}``,
  then zero bytes up to a multiple of 8 from the start of the body;
- per series, in the header's order: ``n`` steps (``int64``), ``n`` values (``float64``: NaN and
  ±Infinity as themselves; a null value reads NaN here), when ``nulls``: ``n`` bytes, 1 where the
  value is null, then zero bytes up to a multiple of 8; when ``wall_time``: ``n`` wall times
  (``float64``, Unix seconds, NaN where the trainer sent none).

Every column starts at a multiple of 8 bytes, so ``numpy.frombuffer`` takes them without a copy.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator

import orjson
from rlvitals.analyzers.contract.batch_rules import NON_FINITE

MAGIC = b"RLVS"
VERSION = 1
MEDIA_TYPE = "application/vnd.rlvitals.series"
_NAN = float("nan")
_SWAP = sys.byteorder != "little"


def _pad(n: int) -> bytes:
    return b"\0" * (-n % 8)


def _column(code: str, values: Iterable) -> bytes:
    col = array(code, values)
    if _SWAP:
        col.byteswap()
    return col.tobytes()


def _held(values: array, odd: dict) -> tuple[bytes, bytes | None]:
    """A held ``array('d')`` whose ``odd`` positions hold values that are not floats (null or a
    spelled non-finite value) -> (float64 column, null mask)."""
    nulls = None
    if odd:
        mask = bytearray(len(values))
        for at, value in odd.items():
            if value is None:
                values[at] = _NAN
                mask[at] = 1
            else:
                values[at] = NON_FINITE[value]
        if any(mask):
            nulls = bytes(mask) + _pad(len(mask))
    if _SWAP:
        values.byteswap()
    return values.tobytes(), nulls


def _values(values: list) -> tuple[bytes, bytes | None]:
    """API-spelled values (floats, None, "NaN", "Infinity", "-Infinity") -> (float64 column, null mask)."""
    try:
        return _column("d", values), None  # the common case: every value a float
    except TypeError:
        pass
    nulls = bytes(value is None for value in values)
    floats = (
        _NAN if value is None else NON_FINITE[value] if value.__class__ is str else value for value in values
    )
    return _column("d", floats), (nulls + _pad(len(nulls)) if any(nulls) else None)


def encode_series(parts: Iterator[tuple[str, dict]]) -> bytes:
    """``(name, {"step", "value"[, "wall_time"]})`` series (lists of API-spelled values, or the
    columns' arrays with their ``"odd"`` values) -> the binary answer."""
    header: list[dict] = []
    body: list[bytes] = []
    for name, series in parts:
        steps, values = series["step"], series["value"]
        walls = series.get("wall_time")
        if "odd" in series:  # arrays copied from the in-memory columns
            values_col, nulls = _held(values, series["odd"])
            body.append(_column("q", steps) if _SWAP else steps.tobytes())
            body.append(values_col)
        else:
            values_col, nulls = _values(values)
            body += [_column("q", steps), values_col]
        if nulls is not None:
            body.append(nulls)
        if walls is not None:
            body.append(_column("d", (_NAN if w is None else w for w in walls)))
        header.append(
            {"name": name, "points": len(steps), "nulls": nulls is not None, "wall_time": walls is not None}
        )
    head = orjson.dumps({"version": VERSION, "series": header})
    start = MAGIC + len(head).to_bytes(4, "little") + head
    return b"".join([start, _pad(len(start)), *body])
