"""JSON encoding for API replies: non-finite floats travel as "NaN", "Infinity" and "-Infinity".

The same spelling the ingest API accepts, so a value read back can be sent again unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from rlvitals.analyzers.contract.batch_rules import NON_FINITE, spell
from starlette.responses import Response

NON_FINITE_STRINGS = NON_FINITE  # the one spelling table (rlvitals.analyzers.contract.batch_rules)
encode_float = spell


def decode_value(value: float | int | str | None) -> float | None:
    """A metric value as the API accepts it -> a Python float (or None)."""
    if value is None:
        return None
    if isinstance(value, str):
        return NON_FINITE_STRINGS[value]
    return float(value)


JSONABLE_DEPTH = 256  # deeper than any input is allowed to be (settings.max_json_depth); a guard


def jsonable(obj: Any, _depth: int = 0) -> Any:
    """A copy of ``obj`` that ``json.dumps(allow_nan=False)`` accepts (dicts, lists, scalars).

    Raises ``ValueError`` past ``JSONABLE_DEPTH`` levels instead of exhausting the stack (input is
    refused long before: ``storable_problem``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else encode_float(obj)
    if isinstance(obj, (Mapping, list, tuple)) and _depth >= JSONABLE_DEPTH:
        raise ValueError(f"value is nested deeper than {JSONABLE_DEPTH} levels")
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, _depth + 1) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        return jsonable(obj.item(), _depth)
    if hasattr(obj, "tolist"):
        return jsonable(obj.tolist(), _depth)
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    return str(obj)


def valid_text(text: str) -> bool:
    """True when ``text`` can be stored and sent: UTF-8 encodable (no lone surrogates, which
    JSON's ``\\ud800`` escapes produce) and free of NUL (PostgreSQL text and jsonb refuse it)."""
    if text.isascii():
        return "\x00" not in text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def storable_problem(obj: Any, *, max_depth: int) -> str | None:
    """Why the parsed JSON ``obj`` cannot be stored and read back, or None when it can: nesting
    deeper than ``max_depth`` containers, or a key or string that is not valid text (``valid_text``).
    Iterative, so any depth is judged without touching the stack."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not valid_text(value):
                return f"{path or 'value'}: strings must be valid Unicode without NUL (no lone surrogates)"
            continue
        if isinstance(value, Mapping):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            continue
        if depth > max_depth:
            return f"{path or 'value'}: nested deeper than the limit of {max_depth} levels"
        for key, item in items:
            if isinstance(key, str) and not valid_text(key):
                return f"{path or 'value'}: keys must be valid Unicode without NUL (no lone surrogates)"
            stack.append((item, depth + 1, f"{path}[{key!r}]" if len(path) < 200 else path))
    return None


def scrub(obj: Any) -> Any:
    """``obj`` with every string made encodable (lone surrogates backslash-escaped): for error
    replies, which echo the input that was refused. Shallow inputs only (replies we build)."""
    if isinstance(obj, str):
        return obj if valid_text(obj) else obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, Mapping):
        return {scrub(str(k)): scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(jsonable(obj), separators=(",", ":"), allow_nan=False, ensure_ascii=False)


class JSONResponse(Response):
    """The response class for every API route (FastAPI's default would emit bare NaN tokens)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
