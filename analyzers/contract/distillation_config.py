"""verl 0.9.1's ``distillation.distillation_loss`` settings (:class:`DistillationConfig`), validated once.
No math: :mod:`rlvitals.analyzers.reference.distillation` computes the loss."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
PREFIX = "distillation/"
TENSOR = "teacher_log_probs"  # the upload's name for verl's ``teacher_logprobs`` of the sampled tokens


@dataclass(frozen=True)
class DistillationConfig:
    """verl's ``distillation.distillation_loss`` (``DistillationLossConfig``) fields the loss reads, with
    verl's defaults; ``loss_agg_mode`` and global batch info come from the actor config."""

    loss_mode: str = "k3"
    loss_max_clamp: float | None = 10.0
    use_policy_gradient: bool = True
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        if self.loss_mode not in ESTIMATOR_MODES:
            raise ValueError(
                f"distillation loss_mode must be one of {', '.join(ESTIMATOR_MODES)} (forward_kl_topk needs "
                f"logits, not log-probs); got {self.loss_mode!r}"
            )
        if self.loss_mode == "k1" and not self.use_policy_gradient:
            raise ValueError(  # verl's DistillationLossConfig refuses it too
                "loss_mode 'k1' needs use_policy_gradient: its gradient does not depend on the teacher"
            )
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            raise ValueError(f"loss_max_clamp must be None or > 0; got {self.loss_max_clamp!r}")
        for name in ("use_policy_gradient", "use_task_rewards"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        for name in ("distillation_loss_coef", "clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number; got {value!r}")

    @classmethod
    def from_verl(cls, mapping: Mapping[str, Any] | None) -> DistillationConfig | None:
        """From a whole verl config's ``distillation`` section (verl's ``DistillationConfig``: its
        ``distillation_loss`` fields; ``enabled: false`` means None) or ``{"distillation": {...}}`` as a
        batch config carries it; None when there is none. Unknown keys (teacher models, topk) are ignored;
        ``policy_loss_mode`` other than ``vanilla`` is refused, as verl refuses it."""
        if not hasattr(mapping, "get"):
            return None
        section = mapping.get("distillation")
        if not hasattr(section, "get") or section.get("enabled", True) is False:
            return None
        loss = section.get("distillation_loss", section)
        if not hasattr(loss, "get"):
            raise ValueError(f"distillation.distillation_loss must be a mapping; got {loss!r}")
        mode = loss.get("policy_loss_mode", "vanilla")
        if mode != "vanilla":
            raise ValueError(
                f"distillation policy_loss_mode must be 'vanilla' (verl 0.9.1's only one); got {mode!r}"
            )
        return cls(**{f.name: loss[f.name] for f in fields(cls) if f.name in loss})

    def to_dict(self) -> dict[str, Any]:
        """The batch config's ``distillation`` section (``DistillationLossConfig`` field names)."""
        return {"distillation_loss": asdict(self)}
