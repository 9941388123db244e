"""Tensor batches uploaded for audit: safetensors bytes, validated before they are queued.

Only ``safetensors`` is ever parsed (never pickle / ``torch.load``). Tensors, all ``(batch,
response_len)`` unless noted:

- required: ``log_prob``, ``old_log_prob``, ``advantages`` (float16, bfloat16, float32 or float64:
  float8 and integers are refused), ``response_mask`` (0/1 of bool, a signed integer or uint8, or
  one of those float dtypes);
- optional (same float dtypes): ``ref_log_prob``, ``entropy``, ``rollout_is_weights`` (the IS weights
  the loss was multiplied by), ``token_level_rewards``,
  ``rollout_log_probs`` (the rollout engine's log-probs, verl's name), ``teacher_log_probs`` (an
  on-policy distillation teacher's log-probs of the sampled tokens, verl's ``teacher_logprobs``) and
  ``group_index``
  ``(batch,)`` int64 (the GRPO group of each sequence; needs ``token_level_rewards``).

safetensors metadata (all strings): ``step`` (int >= 0, required), ``config`` (JSON object of verl
LossConfig fields, optionally with verl's ``algorithm`` section: ``adv_estimator``,
``norm_adv_by_std_in_grpo``, ``gamma``, ``rollout_correction``, and verl's ``distillation`` section:
``distillation_loss`` fields), ``reported`` (JSON object: the metrics the trainer computed on exactly these
tensors), optional ``rank`` and ``micro_batch`` (ints) and ``record_id`` (the client's id of the
upload, 1-128 printable ASCII characters without spaces: a resend with the same id is stored once).
Anything wrong -> ``InvalidInput`` (422) naming the tensor or field.

The tensor rules, the config parse and the decoding of ``reported`` are the batch contract's
(``rlvitals.analyzers.contract.batch``, rule table in ``rlvitals.analyzers.contract.batch_rules``); this module reads the
safetensors bytes and the metadata fields only the upload has (``step``, ``rank``, ``record_id``...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlvitals.analyzers.contract import batch_rules as rules
from rlvitals.service import tensor_file
from rlvitals.service.encoding import jsonable, storable_problem
from rlvitals.service.errors import InvalidInput, PayloadTooLarge

if TYPE_CHECKING:  # torch is imported by the audit worker only: the server never loads it
    import torch
    from rlvitals.analyzers.contract.batch import CheckedUpload

REQUIRED, OPTIONAL_FLOAT, ALLOWED = rules.REQUIRED, rules.OPTIONAL, rules.ALLOWED  # the contract's table
RECORD_ID_MAX = 128  # the column's width
JSON_DEPTH = 64  # settings.max_json_depth's default


@dataclass
class Batch:
    step: int
    config: dict[str, Any]  # verl LossConfig fields, as sent
    reported: dict[str, Any]  # JSON-safe (non-finite spelled out)
    rank: int | None
    micro_batch: int | None
    shape: tuple[int, int]
    record_id: str | None = None  # the client's upload id: a resend is recognised by it


Body = tensor_file.Body
read_metadata = tensor_file.read_metadata  # the header contract: rlvitals.service.tensor_file


def load_tensors(body: Body) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views into ``body`` (a ``bytearray`` or a writable
    ``memoryview``: no copy; ``bytes`` are copied once into a bytearray), for the audit. The entries
    and their checks are :func:`rlvitals.service.tensor_file.entries`, the ones the upload passed."""
    import torch

    writable = isinstance(body, bytearray) or (isinstance(body, memoryview) and not body.readonly)
    buffer = body if writable else bytearray(body)
    found, start = tensor_file.entries(buffer)
    data = memoryview(buffer)[start:]
    out: dict[str, torch.Tensor] = {}
    for entry in found:
        dtype = getattr(torch, entry.dtype)
        if entry.numel:
            flat = torch.frombuffer(data[entry.begin : entry.end], dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        try:
            out[entry.name] = flat.reshape(entry.shape)
        except (RuntimeError, OverflowError, ValueError) as exc:  # what torch refuses is the upload's fault
            raise InvalidInput(
                f"body is not a valid safetensors file: tensor {entry.name!r} of shape {list(entry.shape)!s:.200}: "
                f"{exc}"
            ) from None
    return out


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


def _json_object(meta: dict[str, str], name: str, max_depth: int) -> dict[str, Any]:
    raw = meta.get(name)
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except RecursionError as exc:
        raise InvalidInput(
            f"safetensors metadata {name!r} is nested deeper than the limit of {max_depth} levels"
        ) from exc
    except ValueError as exc:
        raise InvalidInput(f"safetensors metadata {name!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidInput(f"safetensors metadata {name!r} must be a JSON object; got {type(value).__name__}")
    problem = storable_problem(value, max_depth=max_depth)
    if problem is not None:
        raise InvalidInput(f"safetensors metadata {name!r}: {problem}")
    return value


def validate(
    body: Body, *, max_json_depth: int = JSON_DEPTH, max_tokens: int | None = None
) -> tuple[Batch, CheckedUpload]:
    """Parse and check one upload without torch (the request-serving process never loads it): the
    header's entries (:mod:`rlvitals.service.tensor_file`), the batch contract's rules on their dtypes
    and shapes, ``response_mask``'s values (read in place with numpy), the config and ``reported``.
    Returns the batch description (what is stored) and the contract's :class:`CheckedUpload`.
    ``config`` and ``reported`` nested deeper than ``max_json_depth`` or holding invalid text are
    refused, and so (413) is a batch of more than ``max_tokens`` tokens (``batch x response_len``:
    the audit's CPU)."""
    from rlvitals.analyzers.contract.batch import BatchError, CheckedUpload, ConfigError, TooManyTokens

    meta = read_metadata(body)
    found, start = tensor_file.entries(body)
    layout = {entry.name: entry for entry in found}
    config = _json_object(meta, "config", max_json_depth)
    reported = _json_object(meta, "reported", max_json_depth)
    try:  # the batch contract checks everything once: tensors, config, reported
        checked = CheckedUpload.validate(
            layout,
            mask_outliers=lambda: tensor_file.outside_zero_one(body, start, layout["response_mask"]),
            config=config,
            reported=reported,
            max_tokens=max_tokens,
        )
    except TooManyTokens as exc:
        raise PayloadTooLarge(str(exc), detail=exc.detail) from None
    except ConfigError as exc:
        raise _config_error(exc) from exc
    except BatchError as exc:
        raise InvalidInput(str(exc), detail=exc.detail) from None
    batch = Batch(
        step=_int_field(meta, "step", required=True),
        config=jsonable(config),
        reported=dict(checked.reported),
        rank=_int_field(meta, "rank", required=False),
        micro_batch=_int_field(meta, "micro_batch", required=False),
        shape=checked.shape,
        record_id=_record_id(meta),
    )
    return batch, checked


def _config_error(exc) -> InvalidInput:
    """The 422 of a config the contract refused (``ConfigError``), naming the section."""
    if exc.section in ("algorithm", "distillation"):
        return InvalidInput(f"safetensors metadata 'config' has an invalid '{exc.section}' section: {exc}")
    return InvalidInput(f"safetensors metadata 'config' is not a valid loss config: {exc}")
