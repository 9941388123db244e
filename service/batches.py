"""Tensor batches uploaded for audit: safetensors bytes, validated before they are queued.

Only ``safetensors`` is ever parsed (never pickle / ``torch.load``). Tensors, all ``(batch,
response_len)`` unless noted:

- required: ``log_prob``, ``old_log_prob``, ``advantages`` (floating), ``response_mask`` (0/1 of any
  bool / integer / floating dtype);
- optional: ``ref_log_prob``, ``entropy``, ``token_level_rewards`` (floating) and ``group_index``
  ``(batch,)`` int64 (the GRPO group of each sequence; needs ``token_level_rewards``).

safetensors metadata (all strings): ``step`` (int >= 0, required), ``config`` (JSON object of verl
LossConfig fields), ``reported`` (JSON object: the metrics the trainer computed on exactly these
tensors), optional ``rank`` and ``micro_batch`` (ints) and ``record_id`` (the client's id of the
upload, 1-128 printable ASCII characters without spaces: a resend with the same id is stored once).
Anything wrong -> ``InvalidInput`` (422) naming the tensor or field.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlvitals.service.encoding import jsonable
from rlvitals.service.errors import InvalidInput

if TYPE_CHECKING:  # torch is imported with the first batch: a scalar-only server never loads it
    import torch

REQUIRED = ("log_prob", "old_log_prob", "advantages", "response_mask")
OPTIONAL_FLOAT = ("ref_log_prob", "entropy", "token_level_rewards")
ALLOWED = (*REQUIRED, *OPTIONAL_FLOAT, "group_index")
FLOAT_TENSORS = ("log_prob", "old_log_prob", "advantages", *OPTIONAL_FLOAT)
RECORD_ID_MAX = 128  # the column's width
_SPELLED = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass
class Batch:
    step: int
    config: dict[str, Any]  # verl LossConfig fields, as sent
    reported: dict[str, Any]  # JSON-safe (non-finite spelled out)
    rank: int | None
    micro_batch: int | None
    shape: tuple[int, int]
    record_id: str | None = None  # the client's upload id: a resend is recognised by it


def read_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (its header is JSON; nothing is executed)."""
    if len(body) < 8:
        raise InvalidInput("body is not a safetensors file: shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > len(body) - 8:
        raise InvalidInput(f"body is not a safetensors file: header length {header_len} exceeds the body")
    try:
        header = json.loads(body[8 : 8 + header_len])
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"body is not a safetensors file: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise InvalidInput("body is not a safetensors file: header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidInput("safetensors __metadata__ must map names to strings")
    return meta


def load_tensors(body: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(body)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise InvalidInput(f"body is not a valid safetensors file: {exc}") from exc


def _int_field(meta: dict[str, str], name: str, *, required: bool) -> int | None:
    raw = meta.get(name)
    if raw is None:
        if required:
            raise InvalidInput(f"safetensors metadata {name!r} is required (an integer >= 0, as a string)")
        return None
    try:
        value = int(raw.strip())
    except ValueError as exc:
        raise InvalidInput(f"safetensors metadata {name!r} must be an integer >= 0; got {raw!r}") from exc
    if value < 0 or value > 2**63 - 1:
        raise InvalidInput(f"safetensors metadata {name!r} must be an integer >= 0; got {raw!r}")
    return value


def _record_id(meta: dict[str, str]) -> str | None:
    raw = meta.get("record_id")
    if raw is None:
        return None
    if not 1 <= len(raw) <= RECORD_ID_MAX or not all("!" <= ch <= "~" for ch in raw):
        raise InvalidInput(
            f"safetensors metadata 'record_id' must be 1-{RECORD_ID_MAX} printable ASCII characters "
            f"without spaces; got {raw[:80]!r}{'...' if len(raw) > 80 else ''}"
        )
    return raw


def _json_object(meta: dict[str, str], name: str) -> dict[str, Any]:
    raw = meta.get(name)
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput(f"safetensors metadata {name!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidInput(f"safetensors metadata {name!r} must be a JSON object; got {type(value).__name__}")
    return value


def _reported(meta: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _json_object(meta, "reported").items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out[key] = None if value is None else float(value)
        elif isinstance(value, str) and value in _SPELLED:
            out[key] = _SPELLED[value]
        else:
            raise InvalidInput(
                f"reported[{key!r}] must be a number, null, 'NaN', 'Infinity' or '-Infinity'; got {value!r}"
            )
    return out


def validate(body: bytes) -> tuple[Batch, dict[str, torch.Tensor]]:
    """Parse and check one upload; returns the batch description and its tensors."""
    import torch

    meta = read_metadata(body)
    tensors = load_tensors(body)
    unknown = sorted(set(tensors) - set(ALLOWED))
    if unknown:
        raise InvalidInput(f"unknown tensor(s) {unknown}; allowed: {list(ALLOWED)}")
    missing = [name for name in REQUIRED if name not in tensors]
    if missing:
        raise InvalidInput(f"missing required tensor(s) {missing}; required: {list(REQUIRED)}")
    shape = tuple(tensors["log_prob"].shape)
    if len(shape) != 2 or 0 in shape:
        raise InvalidInput(
            f"log_prob must be 2-D (batch, response_len) and non-empty; got shape {list(shape)}"
        )
    for name, tensor in tensors.items():
        if name == "group_index":
            continue
        if tuple(tensor.shape) != shape:
            raise InvalidInput(
                f"{name} has shape {list(tensor.shape)}; every token tensor must match log_prob's {list(shape)}",
                detail={"tensor": name, "shape": list(tensor.shape), "expected": list(shape)},
            )
        if name in FLOAT_TENSORS and not tensor.dtype.is_floating_point:
            raise InvalidInput(f"{name} must be a floating-point tensor; got {tensor.dtype}")
    mask = tensors["response_mask"]
    if mask.dtype.is_complex:
        raise InvalidInput(f"response_mask must be bool, integer or floating; got {mask.dtype}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)]
        raise InvalidInput(
            f"response_mask must contain only 0 and 1; found {bad.numel()} other value(s), e.g. {bad.flatten()[0].item()!r}"
        )
    if "group_index" in tensors:
        index = tensors["group_index"]
        if index.dtype != torch.int64:
            raise InvalidInput(f"group_index must be int64; got {index.dtype}")
        if tuple(index.shape) != (shape[0],):
            raise InvalidInput(
                f"group_index must have shape [{shape[0]}] (one id per sequence); got {list(index.shape)}"
            )
        if "token_level_rewards" not in tensors:
            raise InvalidInput("group_index needs token_level_rewards (the GRPO advantage audit uses both)")
    config = _json_object(meta, "config")
    _check_config(config)
    batch = Batch(
        step=_int_field(meta, "step", required=True),
        config=jsonable(config),
        reported=_reported(meta),
        rank=_int_field(meta, "rank", required=False),
        micro_batch=_int_field(meta, "micro_batch", required=False),
        shape=(int(shape[0]), int(shape[1])),
        record_id=_record_id(meta),
    )
    return batch, tensors


def _check_config(config: dict[str, Any]) -> None:
    try:
        if config.get("trainer") == "trl":  # a TRL GRPOTrainer batch (TrlLossConfig.to_dict())
            from rlvitals.analyzers.trl import TrlLossConfig

            TrlLossConfig.from_dict(config)
        else:
            from rlvitals.analyzers import LossConfig

            LossConfig.from_verl(config)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"safetensors metadata 'config' is not a valid loss config: {exc}") from exc
