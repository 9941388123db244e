"""The batch contract: one micro-batch of tensors, its loss config and the metrics the trainer reported.

:class:`AuditBatch` is the value object every part builds instead of re-checking on its own: it
validates the tensors against the rule table (``rlvitals.analyzers.contract.batch_rules``) once, parses the
config once (verl's actor section -> :class:`LossConfig`, a TRL batch -> :class:`TrlLossConfig`, verl's
``algorithm`` section -> :class:`AlgorithmConfig`, verl's ``distillation`` section ->
:class:`DistillationConfig`) and decodes ``reported`` once (non-finite
spellings -> floats). :func:`audit_batch` then runs every check the batch allows and returns one
:class:`BatchAudit`: the loss audit, the GRPO group diagnostics, the advantage check, the rollout
correction and the dashboard's histograms.

Who calls it: the server's upload route (``AuditBatch.validate``: bad input raises :class:`BatchError`,
which the service turns into its 422/413), the audit worker (``AuditBatch.stored``: a batch already
validated at upload is not validated again, only its config parsed) and the client's ``log_batch``
(``parse_config``: misuse raises in the trainer). The trainer -> config mappings live beside it: the
parsers ``LossConfig.from_verl`` (verl, and OpenRLHF's verl-named fields), ``TrlLossConfig.from_dict``
(TRL), ``AlgorithmConfig.from_verl``, which :func:`parse_config` picks from; and the readers of a live
trainer object that produce what they parse, one per trainer, in :mod:`rlvitals.analyzers.contract.trainers`
(``verl_loss_config``, ``trl_config_for``, ``openrlhf_loss_config``; the client integrations re-export them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from . import batch_rules as rules
from .algorithm_config import AlgorithmConfig
from .config import LossConfig
from .distillation_config import DistillationConfig
from .trl_config import TrlLossConfig, is_trl_config

if TYPE_CHECKING:
    import torch


class BatchError(ValueError):
    """A batch that breaks the contract; ``detail`` names the tensor or field (JSON-safe)."""

    def __init__(self, message: str, *, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class TooManyTokens(BatchError):
    """More ``batch x response_len`` tokens than the caller's limit (the server answers 413)."""


class ConfigError(BatchError):
    """The config does not parse; ``section`` is ``"loss"``, ``"algorithm"`` or ``"distillation"``."""

    def __init__(self, message: str, *, section: str) -> None:
        super().__init__(message)
        self.section = section


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


_FLOATS = ", ".join(rules.FLOAT_DTYPES[:-1]) + " or " + rules.FLOAT_DTYPES[-1]
_TORCH_RULES: tuple[type, frozenset, frozenset] | None = None


def _torch_rules() -> tuple[type, frozenset, frozenset]:
    """``torch.Tensor`` and the rule table's float and mask dtypes as torch dtypes, built once: torch
    loads lazily here, and an import statement run on every call costs ~1.5 us even when the module
    is loaded."""
    global _TORCH_RULES
    if _TORCH_RULES is None:
        import torch

        _TORCH_RULES = (
            torch.Tensor,
            frozenset(getattr(torch, name) for name in rules.FLOAT_DTYPES),
            frozenset(getattr(torch, name) for name in rules.MASK_DTYPES),
        )
    return _TORCH_RULES


def _not_2d(name: str, shape) -> BatchError:
    return BatchError(
        f"{name} must be 2-D (batch, response_len); got shape {list(shape)}",
        detail={"tensor": name, "shape": list(shape)},
    )


def _shape_mismatch(name: str, shape, expected) -> BatchError:
    return BatchError(
        f"{name} has shape {list(shape)}; every token tensor must match response_mask's {list(expected)}",
        detail={"tensor": name, "shape": list(shape), "expected": list(expected)},
    )


def _not_float(name: str, dtype: str) -> BatchError:
    return BatchError(
        f"{name} must be a floating-point tensor, {_FLOATS}; got {dtype} (convert it with .float() before sending)",
        detail={"tensor": name, "dtype": dtype, "allowed": list(rules.FLOAT_DTYPES)},
    )


def _bad_mask_dtype(dtype: str) -> BatchError:
    return BatchError(
        f"response_mask must be one of {', '.join(rules.MASK_DTYPES)}; got {dtype}",
        detail={"tensor": "response_mask", "dtype": dtype, "allowed": list(rules.MASK_DTYPES)},
    )


def check_token_tensors(tensors: Mapping[str, Any]) -> tuple[int, int]:
    """The per-tensor rules every caller gets, the upload (:func:`check_tensors`) and a direct
    ``audit()`` / ``recompute()``: each ``(batch, response_len)`` tensor given (None: absent) is a
    ``torch.Tensor``, 2-D, of ``response_mask``'s shape and device; the float tensors are float16,
    bfloat16, float32 or float64; ``response_mask`` is bool, an integer or a float dtype. Metadata
    only: no tensor's values are read. Returns ``(batch, response_len)``; raises :class:`BatchError`
    (a ``ValueError``) naming the tensor."""
    tensor_type, float_dtypes, mask_dtypes = _torch_rules()
    # each tensor's metadata is read once (a torch attribute costs ~50 ns, ~1 us with cold caches)
    given = [(k, t) for k in rules.TOKEN_TENSORS if (t := tensors.get(k)) is not None]
    shapes = []
    for name, tensor in given:
        if not isinstance(tensor, tensor_type):
            raise BatchError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
        tensor_shape = tensor.shape
        shapes.append(tensor_shape)
        if len(tensor_shape) != 2:
            raise _not_2d(name, tensor_shape)
    mask = tensors.get("response_mask")
    if mask is None:
        raise BatchError("missing required tensor(s) ['response_mask']")
    shape = mask.shape
    # CPU tensors all share one device (it has no index): is_cpu answers without building device objects
    on_cpu = mask.is_cpu
    device = None if on_cpu else mask.device
    for (name, tensor), tensor_shape in zip(given, shapes, strict=True):
        if tensor_shape != shape:
            raise _shape_mismatch(name, tensor_shape, shape)
        if (not tensor.is_cpu) if on_cpu else (tensor.device != device):
            raise BatchError(f"{name} is on {tensor.device} but response_mask is on {mask.device}")
        if name in rules.FLOAT_TENSORS and tensor.dtype not in float_dtypes:
            raise _not_float(name, _dtype(tensor))
    if mask.dtype not in mask_dtypes:
        raise _bad_mask_dtype(_dtype(mask))
    return int(shape[0]), int(shape[1])


class CheckedTensors(dict):
    """Tensors that passed the contract's check (:attr:`AuditBatch.tensors`, or derived from them by
    :func:`audit_batch`): the audit builds its :class:`~rlvitals.analyzers.fast.token_batch.TokenBatch` from
    them without checking them again (:func:`token_batch`). Any other mapping is checked."""


class TensorLayout(NamedTuple):
    """What the contract reads of a tensor besides a mask's values: its dtype (torch's name,
    ``"float32"``) and its shape. The server's upload check builds these from the safetensors header
    (no torch); :func:`check_tensors` from torch tensors."""

    dtype: str
    shape: tuple[int, ...]


MaskOutliers = Callable[[], "tuple[int, int | float] | None"]


def check_layout(
    layout: Mapping[str, TensorLayout], *, max_tokens: int | None = None, mask_outliers: MaskOutliers
) -> tuple[int, int]:
    """The batch rules, read from dtypes and shapes only (no torch): known names, required ones
    present, ``(batch, response_len)`` token tensors of one shape, their dtypes, at most ``max_tokens``
    tokens, ``group_index`` and the tensors it needs. ``response_mask``'s values are read through
    ``mask_outliers()`` (how many values are neither 0 nor 1 and the first of them, or None), called
    for a non-bool mask once the rest passed. Returns ``(batch, response_len)``; raises
    :class:`BatchError` (:class:`TooManyTokens` past ``max_tokens``) naming the tensor. The same
    rules, in the same order and words, as :func:`check_tensors` on torch tensors."""
    shape = _check_names_and_size(layout, max_tokens)
    given = [(k, t) for k in rules.TOKEN_TENSORS if (t := layout.get(k)) is not None]
    for name, tensor in given:
        if len(tensor.shape) != 2:
            raise _not_2d(name, tensor.shape)
    mask = layout["response_mask"]
    for name, tensor in given:
        if tensor.shape != mask.shape:
            raise _shape_mismatch(name, tensor.shape, mask.shape)
        if name in rules.FLOAT_TENSORS and tensor.dtype not in rules.FLOAT_DTYPES:
            raise _not_float(name, tensor.dtype)
    if mask.dtype not in rules.MASK_DTYPES:
        raise _bad_mask_dtype(mask.dtype)
    _check_mask_and_groups(layout, shape, mask_outliers)
    return shape


def _check_names_and_size(tensors: Mapping[str, Any], max_tokens: int | None) -> tuple[int, int]:
    unknown = sorted(set(tensors) - set(rules.ALLOWED))
    if unknown:
        raise BatchError(f"unknown tensor(s) {unknown}; allowed: {list(rules.ALLOWED)}")
    missing = [name for name in rules.REQUIRED if name not in tensors]
    if missing:
        raise BatchError(f"missing required tensor(s) {missing}; required: {list(rules.REQUIRED)}")
    shape = tuple(tensors["log_prob"].shape)
    if len(shape) != 2 or 0 in shape:
        raise BatchError(f"log_prob must be 2-D (batch, response_len) and non-empty; got shape {list(shape)}")
    if max_tokens is not None and shape[0] * shape[1] > max_tokens:
        raise TooManyTokens(
            f"a batch of {shape[0]}x{shape[1]} = {shape[0] * shape[1]} tokens exceeds max_audit_tokens "
            f"({max_tokens}); upload a sample of the micro-batch",
            detail={"tokens": shape[0] * shape[1], "limit": max_tokens},
        )
    return int(shape[0]), int(shape[1])


def _check_mask_and_groups(
    layout: Mapping[str, TensorLayout], shape: tuple[int, int], mask_outliers: MaskOutliers
) -> None:
    outliers = None if layout["response_mask"].dtype == "bool" else mask_outliers()
    if outliers is not None:
        count, example = outliers
        raise BatchError(
            f"response_mask must contain only 0 and 1; found {count} other value(s), e.g. {example!r}"
        )
    if rules.GROUP_INDEX in layout:
        index = layout[rules.GROUP_INDEX]
        if index.dtype != rules.GROUP_INDEX_DTYPE:
            raise BatchError(f"group_index must be int64; got torch.{index.dtype}")
        if tuple(index.shape) != (shape[0],):
            raise BatchError(
                f"group_index must have shape [{shape[0]}] (one id per sequence); got {list(index.shape)}"
            )
    partner = rules.missing_partner(layout)
    if partner:
        raise BatchError(partner)


def check_tensors(tensors: Mapping[str, torch.Tensor], *, max_tokens: int | None = None) -> tuple[int, int]:
    """Check ``tensors`` against the rule table: :func:`check_layout`'s rules, with
    :func:`check_token_tensors` for the token tensors (each a ``torch.Tensor``, all on
    ``response_mask``'s device); returns ``(batch, response_len)``. Raises :class:`BatchError`
    (:class:`TooManyTokens` past ``max_tokens``) naming the tensor."""
    shape = _check_names_and_size(tensors, max_tokens)
    check_token_tensors(tensors)

    def mask_outliers() -> tuple[int, int | float] | None:
        mask = tensors["response_mask"]
        if bool(((mask == 0) | (mask == 1)).all()):
            return None
        bad = mask[(mask != 0) & (mask != 1)]
        return bad.numel(), bad.flatten()[0].item()

    layout = {name: TensorLayout(_dtype(tensor), tuple(tensor.shape)) for name, tensor in tensors.items()}
    _check_mask_and_groups(layout, shape, mask_outliers)
    return shape


def parse_config(config: Mapping[str, Any] | None) -> tuple[LossConfig | TrlLossConfig, AlgorithmConfig]:
    """The one parse of a batch's config: ``(loss config, algorithm config)``. A TRL batch
    (``"trainer": "trl"``) gets :class:`TrlLossConfig`, anything else verl's :class:`LossConfig`
    (``from_verl``: an actor section, a whole trainer config, or a flat ``LossConfig.to_dict()``).
    Raises :class:`ConfigError` with the parser's message."""

    config = config or {}
    try:
        loss = TrlLossConfig.from_dict(config) if is_trl_config(config) else LossConfig.from_verl(config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), section="loss") from exc
    try:
        algorithm = AlgorithmConfig.from_verl(config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), section="algorithm") from exc
    return loss, algorithm


def parse_distillation(config: Mapping[str, Any] | None) -> DistillationConfig | None:
    """verl's ``distillation`` section of a batch's config (None without one). Raises
    :class:`ConfigError` (``section="distillation"``) with the parser's message."""

    try:
        return DistillationConfig.from_verl(config or {})
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), section="distillation") from exc


@dataclass(frozen=True, eq=False)
class ParsedBatch:
    """What a checked batch holds besides its tensors: ``config`` as sent (JSON), ``loss``,
    ``algorithm`` and ``distillation`` parsed from it, ``reported`` decoded (floats, None; non-finite as
    floats) and ``shape``, ``(batch, response_len)``. The upload's :class:`CheckedUpload` and the
    audit's :class:`AuditBatch` are both one."""

    config: Mapping[str, Any]
    loss: LossConfig | TrlLossConfig
    algorithm: AlgorithmConfig
    reported: Mapping[str, float | None]
    shape: tuple[int, int]
    distillation: DistillationConfig | None = None

    @classmethod
    def parse(
        cls,
        shape: tuple[int, int],
        *,
        config: Mapping[str, Any] | None,
        reported: Mapping[str, Any] | None,
        **fields: Any,
    ):
        """The one parse of ``config`` and decoding of ``reported`` for a batch of ``shape`` (``fields``:
        the subclass's own); raises :class:`BatchError` (:class:`ConfigError` for the config)."""
        loss, algorithm = parse_config(config)
        distillation = parse_distillation(config)
        try:
            decoded = rules.decode_reported(reported)
        except ValueError as exc:
            raise BatchError(str(exc)) from None
        return cls(dict(config or {}), loss, algorithm, decoded, shape, distillation, **fields)


@dataclass(frozen=True, eq=False)
class CheckedUpload(ParsedBatch):
    """A batch checked from its layout (:func:`check_layout`: dtypes, shapes and the mask's values)
    without holding its tensors as torch tensors: what the server's upload check learns."""

    @classmethod
    def validate(
        cls,
        layout: Mapping[str, TensorLayout],
        *,
        mask_outliers: MaskOutliers,
        config: Mapping[str, Any] | None = None,
        reported: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> CheckedUpload:
        """Check everything (layout, mask values, config, reported); raises :class:`BatchError`."""
        shape = check_layout(layout, max_tokens=max_tokens, mask_outliers=mask_outliers)
        return cls.parse(shape, config=config, reported=reported)


@dataclass(frozen=True, eq=False)
class AuditBatch(ParsedBatch):
    """One micro-batch, checked: its ``tensors`` by name (rule table; a :class:`CheckedTensors`) and
    what every checked batch holds (:class:`ParsedBatch`)."""

    tensors: Mapping[str, torch.Tensor] = field(kw_only=True)

    @classmethod
    def validate(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        config: Mapping[str, Any] | None = None,
        reported: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> AuditBatch:
        """Check everything (tensors, config, reported); raises :class:`BatchError`."""
        shape = check_tensors(tensors, max_tokens=max_tokens)
        return cls.parse(shape, config=config, reported=reported, tensors=CheckedTensors(tensors))

    @classmethod
    def stored(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        config: Mapping[str, Any] | None = None,
        reported: Mapping[str, Any] | None = None,
    ) -> AuditBatch:
        """A batch validated before (at upload): the tensors are not checked again; the config is
        parsed (objects are not stored) and ``reported`` decoded from its stored spelling."""
        loss, algorithm = parse_config(config)
        shape = tuple(tensors["log_prob"].shape)
        decoded = rules.decode_reported(reported)
        return cls(
            dict(config or {}),
            loss,
            algorithm,
            decoded,
            shape,
            parse_distillation(config),
            tensors=CheckedTensors(tensors),
        )
