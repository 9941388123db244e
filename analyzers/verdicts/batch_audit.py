"""Every check of one batch (:func:`audit_batch`): the loss audit, the GRPO group diagnostics, the advantage
check, the rollout correction, the distillation audit, the mismatch report and the dashboard's
histograms, over one :class:`~rlvitals.analyzers.contract.batch.AuditBatch` validated by the contract
layer. Returns one :class:`BatchAudit`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..contract import batch_rules as rules
from ..contract.algorithm_config import AlgorithmConfig, training_batch_size
from ..contract.batch import AuditBatch, CheckedTensors
from ..contract.config import LossConfig
from ..contract.distillation_config import TENSOR, DistillationConfig
from ..contract.trl_config import TrlLossConfig
from ..reference.advantages import group_diagnostics
from ..reference.distillation import audit_distillation
from . import histograms
from .algorithm import audit_rollout, check_advantages
from .auditing import audit
from .entropy_dynamics import batch_covariance
from .mismatch import mismatch_report
from .trl_audit import trl_audit


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

    if TENSOR not in batch.tensors:
        return None
    found = batch.distillation
    if found is None and run_config:
        found = DistillationConfig.from_verl(run_config)
    return found if found is not None else DistillationConfig()  # verl's defaults (k3, policy gradient)


def _audit_distillation(distillation, batch: AuditBatch, tensors, report) -> dict[str, Any]:
    """The distillation audit, with the reported total checked against the recomputed PPO total plus the
    distillation term when the loss audit could recompute that total (KL/entropy tensors present)."""

    actor = batch.loss if isinstance(batch.loss, LossConfig) else LossConfig.from_verl(batch.config)
    base = report.recomputed.get("policy_loss")
    if (actor.use_kl_loss and "ref_log_prob" not in tensors) or (
        actor.entropy_coeff != 0 and "entropy" not in tensors
    ):
        base = None  # the PPO part is not reproducible: the total is not checked
    return audit_distillation(distillation, actor, tensors, batch.reported, policy_loss=base)


def batch_histograms(batch: AuditBatch, *, bins: int | None = None) -> dict[str, Any]:
    """The dashboard's ratio and advantage histograms of ``batch``, clip bounds from its parsed config."""

    kwargs = {} if bins is None else {"bins": bins}
    return histograms.batch_histograms(batch.tensors, config=batch.loss, **kwargs)
