"""verl's ``algorithm`` section as the audit reads it (:class:`AlgorithmConfig`), validated once, and the
size of the batch verl normalises advantages over (:func:`training_batch_size`). No math."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .rollout_config import RolloutCorrectionConfig
from .trainers.verl import training_batch_size  # noqa: F401  (re-exported: verl's reader)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The fields of verl's ``algorithm`` config the audit reads, with verl's defaults, except
    ``adv_estimator``: None when the config does not say (the audit then assumes ``grpo``, the estimator
    of every GRPO recipe; verl's own default is ``gae``, which needs a critic and is not checked)."""

    adv_estimator: str | None = None
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    rollout_correction: RolloutCorrectionConfig | None = None

    def __post_init__(self) -> None:
        if self.adv_estimator is not None and not isinstance(self.adv_estimator, str):
            raise ValueError(f"adv_estimator must be a string; got {self.adv_estimator!r}")
        if not isinstance(self.norm_adv_by_std_in_grpo, bool):
            raise ValueError(
                f"norm_adv_by_std_in_grpo must be True or False; got {self.norm_adv_by_std_in_grpo!r}"
            )
        if (
            isinstance(self.gamma, bool)
            or not isinstance(self.gamma, (int, float))
            or not math.isfinite(self.gamma)
        ):
            raise ValueError(f"gamma must be a finite number; got {self.gamma!r}")

    @classmethod
    def from_verl(cls, mapping: Mapping[str, Any] | None) -> AlgorithmConfig:
        """From a whole verl config (reads ``algorithm``) or the ``algorithm`` section itself."""
        if not hasattr(mapping, "get"):
            return cls()
        section = mapping.get("algorithm") if hasattr(mapping.get("algorithm"), "get") else mapping
        values = {
            k: section[k] for k in ("adv_estimator", "norm_adv_by_std_in_grpo", "gamma") if k in section
        }
        return cls(**values, rollout_correction=RolloutCorrectionConfig.from_verl(mapping))

    @property
    def present(self) -> bool:
        return self != AlgorithmConfig()

    def to_dict(self) -> dict[str, Any]:
        """verl's shape: ``{"adv_estimator", "norm_adv_by_std_in_grpo", "gamma", "rollout_correction"}``."""
        out: dict[str, Any] = {
            "norm_adv_by_std_in_grpo": self.norm_adv_by_std_in_grpo,
            "gamma": float(self.gamma),
        }
        if self.adv_estimator is not None:
            out["adv_estimator"] = self.adv_estimator
        if self.rollout_correction is not None:
            out["rollout_correction"] = self.rollout_correction.to_dict()
        return out
