"""The safetensors file contract, read without torch: the header, its tensor entries and their checks.

One module for both readers of an uploaded batch, so they cannot disagree about what a valid file
is: the server's upload check (``rlvitals.service.batches.validate``: no torch in the
request-serving process, numpy reads the one tensor whose values are checked) and the audit worker's
loading (``rlvitals.service.batches.load_tensors``: torch views of the same entries).

The checks are the safetensors library's: the header is a JSON object (nothing is executed), every
tensor entry names a known dtype, a shape and ``data_offsets``; sizes match shapes; data lies inside
the file; no two tensors share bytes and no byte is unused. Every refusal is an ``InvalidInput``
(422) naming the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from rlvitals.service.errors import InvalidInput

Body = bytes | bytearray | memoryview  # a memoryview: of a spooled upload's mapping (storage.blobs)

DTYPES = {  # safetensors dtype names -> torch attribute names (what the contract's messages say)
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}  # fmt: skip
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}  # fmt: skip
MAX_DIM = 2**63 - 1  # torch holds sizes and strides as int64


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: ``dtype`` by its torch name, ``shape``, and where its bytes lie
    (``begin``/``end``, offsets into the data after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def header(body: Body) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and where its data starts (nothing is executed)."""
    if len(body) < 8:
        raise InvalidInput("body is not a safetensors file: shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > len(body) - 8:
        raise InvalidInput(f"body is not a safetensors file: header length {header_len} exceeds the body")
    try:
        parsed = json.loads(bytes(body[8 : 8 + header_len]))
    except RecursionError as exc:
        raise InvalidInput("body is not a safetensors file: header JSON is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"body is not a safetensors file: header is not JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise InvalidInput("body is not a safetensors file: header is not a JSON object")
    return parsed, 8 + header_len


def read_metadata(body: Body) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file."""
    meta = header(body)[0].get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidInput("safetensors __metadata__ must map names to strings")
    return meta


def entries(body: Body) -> tuple[list[Entry], int]:
    """Every tensor entry of the file, checked (see the module's docstring), and where the data
    starts in ``body``. Reads the header only: no tensor byte is touched."""
    parsed, start = header(body)
    size = len(body) - start
    spans: list[tuple[int, int, str]] = []
    out: list[Entry] = []
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(
                f"body is not a valid safetensors file: tensor {name!r} has a malformed entry "
                f"(dtype one of {sorted(DTYPES)}, shape, data_offsets): {info!r:.200}"
            ) from exc
        numel = math.prod(shape)
        if math.prod(n for n in shape if n) > MAX_DIM:
            raise InvalidInput(
                f"body is not a valid safetensors file: tensor {name!r} declares shape {shape!s:.200}, "
                "whose dimensions (zero-size or not) do not fit the 64-bit sizes torch holds"
            )
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size:
            raise InvalidInput(f"body is not a valid safetensors file: tensor {name!r} lies outside the file")
        if end - begin != numel * ITEMSIZE[dtype]:
            raise InvalidInput(
                f"body is not a valid safetensors file: tensor {name!r} has {end - begin} bytes, but shape "
                f"{shape} of {info['dtype']} needs {numel * ITEMSIZE[dtype]}"
            )
        spans.append((begin, end, name))
        out.append(Entry(name, dtype, tuple(shape), begin, end))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise InvalidInput(
                f"body is not a valid safetensors file: tensor {name!r} overlaps another or leaves a gap"
            )
        position = end
    if position != size:
        raise InvalidInput("body is not a valid safetensors file: bytes after the last tensor")
    return out, start


_NUMPY = {  # torch names -> numpy dtypes (little-endian, as safetensors stores them)
    "uint8": "u1", "int8": "i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
    "float16": "<f2", "float32": "<f4", "float64": "<f8",
}  # fmt: skip


def outside_zero_one(body: Body, start: int, entry: Entry) -> tuple[int, int | float] | None:
    """How many of ``entry``'s values are neither 0 nor 1 (NaN included) and the first of them, as
    torch's ``.item()`` gives it; None when every value is 0 or 1. numpy reads the bytes in place
    (a mask dtype: bool, an integer or a float one; bfloat16 widened exactly to float32)."""
    import numpy as np

    raw = memoryview(body)[start + entry.begin : start + entry.end]
    if entry.dtype == "bfloat16":  # the high half of a float32: widening is exact
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, dtype=_NUMPY[entry.dtype])
    bad = (values != 0) & (values != 1)
    if not bad.any():
        return None
    outliers = values[bad]
    return int(outliers.size), outliers[0].item()
