"""JSON encoding for API replies: non-finite floats travel as "NaN", "Infinity" and "-Infinity".

The same spelling the ingest API accepts, so a value read back can be sent again unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

NON_FINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_float(value: float) -> float | str:
    if value != value:  # NaN
        return "NaN"
    if value == math.inf:
        return "Infinity"
    if value == -math.inf:
        return "-Infinity"
    return value


def decode_value(value: float | int | str | None) -> float | None:
    """A metric value as the API accepts it -> a Python float (or None)."""
    if value is None:
        return None
    if isinstance(value, str):
        return NON_FINITE_STRINGS[value]
    return float(value)


def jsonable(obj: Any) -> Any:
    """A copy of ``obj`` that ``json.dumps(allow_nan=False)`` accepts (dicts, lists, scalars)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else encode_float(obj)
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        return jsonable(obj.item())
    if hasattr(obj, "tolist"):
        return jsonable(obj.tolist())
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    return str(obj)


def dumps(obj: Any) -> str:
    return json.dumps(jsonable(obj), separators=(",", ":"), allow_nan=False, ensure_ascii=False)


class JSONResponse(Response):
    """The response class for every API route (FastAPI's default would emit bare NaN tokens)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
