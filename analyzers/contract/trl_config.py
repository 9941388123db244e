"""TRL 1.16 GRPOTrainer's loss settings (:class:`TrlLossConfig`), validated once, and the names of the
metrics TRL logs. No math: :mod:`rlvitals.analyzers.reference.trl` computes the loss."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

TRAINER = "trl"  # the ``trainer`` key of a TRL config's JSON: how the service tells it from a verl LossConfig


class TrlLossType(str, Enum):
    GRPO = "grpo"
    BNPO = "bnpo"
    DR_GRPO = "dr_grpo"
    DAPO = "dapo"
    LUSPO = "luspo"
    CISPO = "cispo"
    SAPO = "sapo"
    VESPO = "vespo"

    def __str__(self) -> str:
        return self.value


CLIPPED = frozenset(
    {TrlLossType.GRPO, TrlLossType.BNPO, TrlLossType.DR_GRPO, TrlLossType.DAPO, TrlLossType.LUSPO}
)
GLOBAL_TOKEN_NORM = frozenset({TrlLossType.DAPO, TrlLossType.CISPO, TrlLossType.VESPO})
LEVELS = ("token", "sequence")


def _number(name: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' or None' if optional else ''}; got {value!r}")
    return float(value)


def _count(name: str, value: Any, *, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}{' or None' if optional else ''}; got {value!r}"
        )
    return value


@dataclass(frozen=True)
class TrlLossConfig:
    """TRL 1.16 ``GRPOTrainer``'s loss settings as they stood at one ``_compute_loss`` call.

    Names are ``GRPOConfig``'s, except what the trainer holds at call time: ``entropy_coef`` is the
    coefficient applied on this call (0 while the adaptive controller gates it off), ``entropy_bonus``
    TRL's ``_entropy_bonus_enabled``, ``gradient_accumulation_steps`` its
    ``current_gradient_accumulation_steps``, ``num_items_in_batch`` the generation batch's token count
    (``dapo``/``cispo``/``vespo``), ``num_processes`` the accelerator's. ``sequence_advantages``: TRL got
    advantages of shape ``(B,)`` (sent expanded to ``(B, T)``). ``unaudited``: why this call's loss cannot
    be reproduced from the tensors sent (then nothing is checked, and the audit says so).
    """

    loss_type: TrlLossType = TrlLossType.DAPO
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    entropy_bonus: bool = False
    max_completion_length: int | None = None
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    num_items_in_batch: int | None = None
    num_processes: int = 1
    sequence_advantages: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    unaudited: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)
        try:
            set_("loss_type", TrlLossType(self.loss_type))
        except ValueError:
            allowed = ", ".join(repr(t.value) for t in TrlLossType)
            raise ValueError(f"loss_type must be one of {allowed}; got {self.loss_type!r}") from None
        for name in ("epsilon_low", "epsilon_high", "beta", "entropy_coef", "sapo_temperature_pos",
                     "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):  # fmt: skip
            set_(name, _number(name, getattr(self, name)))
        for name in ("delta", "off_policy_mask_threshold"):
            set_(name, _number(name, getattr(self, name), optional=True))
        set_("top_entropy_quantile", _number("top_entropy_quantile", self.top_entropy_quantile))
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1]; got {self.top_entropy_quantile!r}")
        if self.importance_sampling_level not in LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {LEVELS}; got {self.importance_sampling_level!r}"
            )
        for name in ("use_bias_correction_kl", "entropy_bonus", "sequence_advantages"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        _count("max_completion_length", self.max_completion_length, minimum=1, optional=True)
        _count("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        _count("steps_per_generation", self.steps_per_generation, minimum=1)
        _count("num_items_in_batch", self.num_items_in_batch, minimum=0, optional=True)
        _count("num_processes", self.num_processes, minimum=1)
        if self.unaudited is not None and not isinstance(self.unaudited, str):
            raise ValueError(f"unaudited must be None or a sentence; got {self.unaudited!r}")
        if self.unaudited is None:
            if self.loss_type is TrlLossType.DR_GRPO and self.max_completion_length is None:
                raise ValueError("max_completion_length is required for loss_type 'dr_grpo'")
            if self.loss_type in GLOBAL_TOKEN_NORM and self.num_items_in_batch is None:
                raise ValueError(f"num_items_in_batch is required for loss_type {self.loss_type.value!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, with ``"trainer": "trl"``; :meth:`from_dict` reads it back."""
        out = dataclasses.asdict(self)
        out["loss_type"] = self.loss_type.value
        return {"trainer": TRAINER, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrlLossConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k != "trainer"}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown TRL loss setting(s) {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**values)


def is_trl_config(data: Any) -> bool:
    return isinstance(data, Mapping) and data.get("trainer") == TRAINER


# The metrics that only hold for one process (TRL logs cross-process means/extremes of them).
LOCAL_METRICS = (
    "kl",
    "entropy",
    "policy_loss",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
)
METRICS = ("loss", *LOCAL_METRICS)
TRL_LOSS_TYPES = tuple(t.value for t in TrlLossType)
