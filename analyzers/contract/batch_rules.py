"""The batch contract's rule table, in pure Python (no torch, no numpy, no web stack).

One table read by everything that touches a micro-batch: the client's ``log_batch`` capture
(``rlvitals.client.capture``), the server's upload check and the audit (``rlvitals.analyzers.contract.batch``),
so the tensor names, their dtypes and the wire spelling of non-finite numbers are written once.

Tensors, all ``(batch, response_len)`` unless noted:

- ``REQUIRED``: ``log_prob``, ``old_log_prob``, ``advantages`` (floats), ``response_mask`` (0/1 of bool,
  an integer dtype or a float dtype);
- ``OPTIONAL``: ``ref_log_prob``, ``entropy``, ``rollout_is_weights`` (the IS weights the loss was
  multiplied by), ``token_level_rewards``, ``rollout_log_probs`` (the rollout engine's log-probs, verl's
  name), ``teacher_log_probs`` (an on-policy distillation teacher's log-probs of the sampled tokens), all
  floats;
- ``GROUP_INDEX``: ``group_index``, ``(batch,)`` int64, the GRPO group of each sequence; it needs
  ``token_level_rewards`` (``NEEDS``).

Non-finite numbers travel as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (``NON_FINITE``):
metric values, ``reported`` values and every JSON reply use this spelling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

REQUIRED = ("log_prob", "old_log_prob", "advantages", "response_mask")
OPTIONAL = (
    "ref_log_prob",
    "entropy",
    "rollout_is_weights",
    "token_level_rewards",
    "rollout_log_probs",
    "teacher_log_probs",
)
GROUP_INDEX = "group_index"
TOKEN_TENSORS = (*REQUIRED, *OPTIONAL)  # every (batch, response_len) tensor
ALLOWED = (*TOKEN_TENSORS, GROUP_INDEX)
FLOAT_TENSORS = ("log_prob", "old_log_prob", "advantages", *OPTIONAL)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # what the audit computes in
MASK_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", *FLOAT_DTYPES)
GROUP_INDEX_DTYPE = "int64"
NEEDS = {GROUP_INDEX: "token_level_rewards"}  # tensor -> the tensor it is useless without
NEEDS_REASON = {GROUP_INDEX: "the GRPO advantage audit uses both"}

NAN, POS_INF, NEG_INF = "NaN", "Infinity", "-Infinity"
NON_FINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def spell(value: float) -> float | str:
    """A float as the API writes it: itself when finite, else ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``."""
    if value != value:
        return NAN
    if value == math.inf:
        return POS_INF
    if value == -math.inf:
        return NEG_INF
    return value


def decode(value: float | int | str | None) -> float | None:
    """A value as the API accepts it (number, null or a non-finite spelling) -> a float or None.
    Raises ``KeyError`` for any other string."""
    if value is None:
        return None
    if isinstance(value, str):
        return NON_FINITE[value]
    return float(value)


def decode_reported(reported: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The ``reported`` metrics of a batch (numbers, null, or non-finite spellings) as floats or None.
    Raises ``ValueError`` naming the first key whose value is anything else (a bool, a list, text)."""
    out: dict[str, float | None] = {}
    for key, value in (reported or {}).items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out[key] = None if value is None else float(value)
        elif isinstance(value, str) and value in NON_FINITE:
            out[key] = NON_FINITE[value]
        else:
            raise ValueError(
                f"reported[{key!r}] must be a number, null, 'NaN', 'Infinity' or '-Infinity'; got {value!r}"
            )
    return out


def missing_partner(names: Any) -> str | None:
    """The message for a tensor sent without the tensor it needs (``NEEDS``), or None."""
    present = set(names)
    for name, partner in NEEDS.items():
        if name in present and partner not in present:
            return f"{name} needs {partner} ({NEEDS_REASON[name]})"
    return None


def token_shape(tensors: Mapping[str, Any], *, accepted: Any, kinds: str) -> tuple[int, int]:
    """The metadata rules of the token tensors (``REQUIRED`` present; each given one ``accepted(value)``,
    2-D and of ``log_prob``'s shape), read from ``.ndim`` / ``.shape`` only, so they hold for torch
    tensors and numpy arrays alike without importing either. Returns ``(batch, response_len)``; raises
    ``TypeError`` (missing, not ``kinds``) or ``ValueError`` (shape) naming the tensor. The client runs
    it before copying anything; the server's :func:`~rlvitals.analyzers.contract.batch.check_tensors`
    adds the dtype and device rules of its torch tensors."""
    shape: tuple[int, ...] | None = None
    for name in TOKEN_TENSORS:
        value = tensors.get(name)
        if value is None:
            if name in REQUIRED:
                raise TypeError(f"{name} is required")
            continue
        if not accepted(value):
            raise TypeError(f"{name} must be a {kinds}, got {type(value).__name__}")
        if value.ndim != 2:
            raise ValueError(f"{name} must be 2-D (batch, response_len), got shape {tuple(value.shape)}")
        if shape is None:
            shape = tuple(value.shape)
        elif tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, log_prob has {shape}")
    assert shape is not None  # REQUIRED is not empty
    return int(shape[0]), int(shape[1])


def check_required(tensors: Mapping[str, Any]) -> None:
    """The rules every call must meet even when its tensors are not sampled (so not copied): each
    ``REQUIRED`` tensor present and array-like (has ``.shape``). ``TypeError`` naming the tensor."""
    for name in REQUIRED:
        value = tensors.get(name)
        if value is None:
            raise TypeError(f"{name} is required")
        if not hasattr(value, "shape"):
            raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
