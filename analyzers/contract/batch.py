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
trainer object that produce what they parse, one per trainer, in :mod:`rlvitals.analyzers.contract.trainer_configs`
(``verl_loss_config``, ``trl_config_for``, ``openrlhf_loss_config``; the client integrations re-export them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import batch_rules as rules

if TYPE_CHECKING:
    import torch

    from ..reference.distillation import DistillationConfig
    from ..reference.trl import TrlLossConfig
    from ..verdicts.algorithm import AlgorithmConfig
    from .config import LossConfig


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
_TOKEN_BATCH: type | None = None  # kernels.TokenBatch, once token_batch first ran


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
            raise BatchError(
                f"{name} must be 2-D (batch, response_len); got shape {list(tensor.shape)}",
                detail={"tensor": name, "shape": list(tensor.shape)},
            )
    mask = tensors.get("response_mask")
    if mask is None:
        raise BatchError("missing required tensor(s) ['response_mask']")
    shape = mask.shape
    # CPU tensors all share one device (it has no index): is_cpu answers without building device objects
    on_cpu = mask.is_cpu
    device = None if on_cpu else mask.device
    for (name, tensor), tensor_shape in zip(given, shapes, strict=True):
        if tensor_shape != shape:
            raise BatchError(
                f"{name} has shape {list(tensor.shape)}; every token tensor must match response_mask's "
                f"{list(shape)}",
                detail={"tensor": name, "shape": list(tensor.shape), "expected": list(shape)},
            )
        if (not tensor.is_cpu) if on_cpu else (tensor.device != device):
            raise BatchError(f"{name} is on {tensor.device} but response_mask is on {mask.device}")
        if name in rules.FLOAT_TENSORS and tensor.dtype not in float_dtypes:
            raise BatchError(
                f"{name} must be a floating-point tensor, {_FLOATS}; got {_dtype(tensor)} "
                "(convert it with .float() before sending)",
                detail={"tensor": name, "dtype": _dtype(tensor), "allowed": list(rules.FLOAT_DTYPES)},
            )
    if mask.dtype not in mask_dtypes:
        raise BatchError(
            f"response_mask must be one of {', '.join(rules.MASK_DTYPES)}; got {_dtype(mask)}",
            detail={"tensor": "response_mask", "dtype": _dtype(mask), "allowed": list(rules.MASK_DTYPES)},
        )
    return int(shape[0]), int(shape[1])


class CheckedTensors(dict):
    """Tensors that passed the contract's check (:attr:`AuditBatch.tensors`, or derived from them by
    :func:`audit_batch`): the audit builds its :class:`~rlvitals.analyzers.fast.kernels.TokenBatch` from
    them without checking them again (:func:`token_batch`). Any other mapping is checked."""


def token_batch(tensors: Mapping[str, Any], *, dense: bool = False):
    """The :class:`~rlvitals.analyzers.fast.kernels.TokenBatch` of ``tensors`` (its keyword names; None:
    absent), the per-tensor rules checked once: by :func:`check_token_tensors` here, unless ``tensors``
    is a :class:`CheckedTensors` (checked at validation). ``dense``: TokenBatch's (an audit's batch,
    which aggregates every way)."""
    global _TOKEN_BATCH
    if _TOKEN_BATCH is None:  # kernels imports torch: loaded on first use (see _torch_rules)
        from ..fast.kernels import TokenBatch

        _TOKEN_BATCH = TokenBatch
    if not isinstance(tensors, CheckedTensors):
        check_token_tensors(tensors)
    return _TOKEN_BATCH(**{k: v for k, v in tensors.items() if v is not None}, dense=dense)


def check_tensors(tensors: Mapping[str, torch.Tensor], *, max_tokens: int | None = None) -> tuple[int, int]:
    """Check ``tensors`` against the rule table; returns ``(batch, response_len)``. Raises
    :class:`BatchError` (:class:`TooManyTokens` past ``max_tokens``) naming the tensor."""
    import torch

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
    check_token_tensors(tensors)
    mask = tensors["response_mask"]
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)]
        raise BatchError(
            f"response_mask must contain only 0 and 1; found {bad.numel()} other value(s), e.g. {bad.flatten()[0].item()!r}"
        )
    if rules.GROUP_INDEX in tensors:
        index = tensors[rules.GROUP_INDEX]
        if _dtype(index) != rules.GROUP_INDEX_DTYPE:
            raise BatchError(f"group_index must be int64; got {index.dtype}")
        if tuple(index.shape) != (shape[0],):
            raise BatchError(
                f"group_index must have shape [{shape[0]}] (one id per sequence); got {list(index.shape)}"
            )
    partner = rules.missing_partner(tensors)
    if partner:
        raise BatchError(partner)
    return int(shape[0]), int(shape[1])


def parse_config(config: Mapping[str, Any] | None) -> tuple[LossConfig | TrlLossConfig, AlgorithmConfig]:
    """The one parse of a batch's config: ``(loss config, algorithm config)``. A TRL batch
    (``"trainer": "trl"``) gets :class:`TrlLossConfig`, anything else verl's :class:`LossConfig`
    (``from_verl``: an actor section, a whole trainer config, or a flat ``LossConfig.to_dict()``).
    Raises :class:`ConfigError` with the parser's message."""
    from ..reference.trl import TrlLossConfig, is_trl_config
    from ..verdicts.algorithm import AlgorithmConfig
    from .config import LossConfig

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
    from ..reference.distillation import DistillationConfig

    try:
        return DistillationConfig.from_verl(config or {})
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), section="distillation") from exc


@dataclass(frozen=True, eq=False)
class AuditBatch:
    """One micro-batch, checked: ``tensors`` by name (rule table), ``config`` as sent (JSON), ``loss``,
    ``algorithm`` and ``distillation`` parsed from it, ``reported`` decoded (floats, None; non-finite as
    floats)."""

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]
    loss: LossConfig | TrlLossConfig
    algorithm: AlgorithmConfig
    reported: Mapping[str, float | None]
    shape: tuple[int, int]
    distillation: DistillationConfig | None = None

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
        loss, algorithm = parse_config(config)
        distillation = parse_distillation(config)
        try:
            decoded = rules.decode_reported(reported)
        except ValueError as exc:
            raise BatchError(str(exc)) from None
        return cls(CheckedTensors(tensors), dict(config or {}), loss, algorithm, decoded, shape, distillation)

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
            CheckedTensors(tensors),
            dict(config or {}),
            loss,
            algorithm,
            decoded,
            shape,
            parse_distillation(config),
        )


@dataclass
class BatchAudit:
    """What :func:`audit_batch` found. ``result`` is the audit (``AuditReport.to_dict()``, plus
    ``groups``, ``advantages``, ``rollout``, ``distillation`` when they ran, and ``ok`` / ``explanation`` covering them
    all), floats as floats (non-finite too: the health monitor reads it); ``groups`` the GRPO group
    diagnostics; ``histograms`` the dashboard's ratio/advantage histograms (when asked for)."""

    result: dict[str, Any]
    groups: dict[str, Any] | None = None
    advantages: dict[str, Any] | None = None
    rollout: dict[str, Any] | None = None
    distillation: dict[str, Any] | None = None
    histograms: dict[str, Any] | None = field(default=None)

    @property
    def ok(self) -> bool | None:
        return self.result.get("ok")

    def to_dict(self) -> dict[str, Any]:
        """``result``, JSON-safe (non-finite floats spelled ``"NaN"``/``"Infinity"``/``"-Infinity"``)."""
        return _jsonable(self.result)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return rules.spell(obj)
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def audit_batch(
    batch: AuditBatch,
    *,
    run_config: Mapping[str, Any] | None = None,
    histograms: bool = False,
) -> BatchAudit:
    """Every check of one batch: the loss audit (verl's, or TRL's own loss for a TRL batch), and as
    the batch allows, the GRPO group diagnostics (``token_level_rewards`` + ``group_index``), the
    advantages recomputed with ``algorithm.adv_estimator`` (``token_level_rewards``), the rollout
    correction (``rollout_log_probs``: the reported ``rollout_corr/*`` checked), verl's on-policy
    distillation loss (``teacher_log_probs``: the reported ``distillation/*`` and the PPO + distillation
    total checked) and, with ``histograms=True``, the dashboard's histograms.

    The ``algorithm`` and ``distillation`` sections come from the batch config, else from ``run_config``
    (verl's ``algorithm.*`` / ``distillation.*`` of the run; verl's distillation defaults without
    either). A mismatch in any check fails the result (``ok`` False) and adds to its explanation. With rollout correction (not in ``bypass_mode``) the loss is audited on the mask
    after rejection, weighted by the IS weights, as verl's actor trains (the recomputed weights when
    the trainer did not send the ones it applied).
    """
    from ..reference.advantages import group_diagnostics
    from ..reference.trl import TrlLossConfig
    from ..verdicts.algorithm import (
        AlgorithmConfig,
        audit_rollout,
        check_advantages,
        training_batch_size,
    )
    from ..verdicts.auditing import audit

    tensors = batch.tensors
    algorithm = batch.algorithm
    if not algorithm.present and run_config:
        algorithm = AlgorithmConfig.from_verl(run_config)
    rollout = audit_rollout(algorithm, tensors, batch.reported)
    loss_tensors = tensors
    if rollout is not None and rollout["ok"] is not None and not rollout["config"]["bypass_mode"]:
        loss_tensors = CheckedTensors({**tensors, "response_mask": rollout["_mask"]})  # ours: same shapes
        if rollout["_weights"] is not None and "rollout_is_weights" not in tensors:
            loss_tensors["rollout_is_weights"] = rollout["_weights"]
    distillation = _distillation_config(batch, run_config)
    loss_reported = batch.reported
    if distillation is not None:  # verl's distillation_ppo_loss returns PPO + distillation: checked below
        loss_reported = {k: v for k, v in batch.reported.items() if k.removeprefix("actor/") != "policy_loss"}
    if isinstance(batch.loss, TrlLossConfig):  # a TRL GRPOTrainer batch: TRL's own loss, not verl's
        from ..verdicts.trl_audit import trl_audit

        report = trl_audit(batch.loss, loss_tensors, loss_reported)
    else:
        report = audit(batch.loss, loss_tensors, loss_reported)
    result = report.to_dict()
    out = BatchAudit(result)
    extra: list[str] = []
    if distillation is not None:
        out.distillation = _audit_distillation(distillation, batch, loss_tensors, report)
        result["distillation"] = out.distillation
        if out.distillation["ok"] is False:
            extra.append(out.distillation["explanation"])
    if "token_level_rewards" in tensors and rules.GROUP_INDEX in tensors:
        out.groups = group_diagnostics(
            tensors["token_level_rewards"], tensors["response_mask"], tensors[rules.GROUP_INDEX]
        ).to_dict()
        result["groups"] = out.groups
    if "token_level_rewards" in tensors and (
        rules.GROUP_INDEX in tensors or algorithm.adv_estimator is not None
    ):
        size = training_batch_size(batch.config, run_config)  # the driver's whole batch, when known
        out.advantages = check_advantages(algorithm, tensors, batch_size=size)
        result["advantages"] = out.advantages
        if out.advantages["ok"] is False:
            extra.append(out.advantages["explanation"])
    if rollout is not None:
        rollout.pop("_mask", None)
        rollout.pop("_weights", None)
        out.rollout = result["rollout"] = rollout
        if rollout["ok"] is False:
            extra.append(rollout["explanation"])
    if "rollout_log_probs" in tensors:
        result["mismatch"] = batch_mismatch(tensors, algorithm)
    if extra:
        # the summary (what the audit_mismatch alert says) names these findings too
        summary = str(result.get("summary") or "") if result["ok"] is False else ""
        summary = " ".join(part for part in (summary, extra[0]) if part)
        if len(extra) > 1:
            summary += f" (and {len(extra) - 1} more finding(s): see the explanation)"
        result["summary"] = summary
        result["ok"] = False
        result["explanation"] = " ".join([result["explanation"], *extra]).strip()
    from ..reference.entropy_dynamics import batch_covariance

    dynamics = batch_covariance(tensors)  # Cov(log π, A): the entropy forecast's input (health rules)
    if dynamics is not None:
        result["entropy_dynamics"] = dynamics
    if histograms:
        out.histograms = batch_histograms(batch)
    return out


def batch_mismatch(tensors: Mapping[str, Any], algorithm: AlgorithmConfig) -> dict[str, Any]:
    """The rollout-vs-training mismatch report (:func:`rlvitals.analyzers.verdicts.mismatch.mismatch_report`) of a
    batch with ``rollout_log_probs``: the trainer's side is ``old_log_prob`` (``log_prob`` in verl's
    bypass mode, where ``old_log_prob`` is the rollout's), the bounds verl's ``rollout_is_threshold``.
    ``{"skipped": why}`` when there is no valid token."""
    from ..verdicts.mismatch import mismatch_report

    config = algorithm.rollout_correction
    trainer = tensors["log_prob"] if config is not None and config.bypass_mode else tensors["old_log_prob"]
    try:
        return mismatch_report(
            trainer,
            tensors["rollout_log_probs"],
            tensors["response_mask"],
            group_index=tensors.get(rules.GROUP_INDEX),
            is_threshold=None if config is None else config.rollout_is_threshold,
        )
    except (ValueError, RuntimeError) as exc:  # no valid token; the loss audit stands without the report
        return {"skipped": f"{type(exc).__name__}: {exc}"}


def _distillation_config(
    batch: AuditBatch, run_config: Mapping[str, Any] | None
) -> DistillationConfig | None:
    """verl's distillation loss settings for this batch (its config, else the run's) when the teacher's
    log-probs came along; else None (no distillation audit)."""
    from ..reference.distillation import TENSOR, DistillationConfig

    if TENSOR not in batch.tensors:
        return None
    found = batch.distillation
    if found is None and run_config:
        found = DistillationConfig.from_verl(run_config)
    return found if found is not None else DistillationConfig()  # verl's defaults (k3, policy gradient)


def _audit_distillation(distillation, batch: AuditBatch, tensors, report) -> dict[str, Any]:
    """The distillation audit, with the reported total checked against the recomputed PPO total plus the
    distillation term when the loss audit could recompute that total (KL/entropy tensors present)."""
    from ..reference.distillation import audit_distillation
    from .config import LossConfig

    actor = batch.loss if isinstance(batch.loss, LossConfig) else LossConfig.from_verl(batch.config)
    base = report.recomputed.get("policy_loss")
    if (actor.use_kl_loss and "ref_log_prob" not in tensors) or (
        actor.entropy_coeff != 0 and "entropy" not in tensors
    ):
        base = None  # the PPO part is not reproducible: the total is not checked
    return audit_distillation(distillation, actor, tensors, batch.reported, policy_loss=base)


def batch_histograms(batch: AuditBatch, *, bins: int | None = None) -> dict[str, Any]:
    """The dashboard's ratio and advantage histograms of ``batch``, clip bounds from its parsed config."""
    from ..verdicts import histograms

    kwargs = {} if bins is None else {"bins": bins}
    return histograms.batch_histograms(batch.tensors, config=batch.loss, **kwargs)
