"""TRL's configs, read once: a live ``GRPOTrainer`` at one ``_compute_loss`` call (:func:`trl_config_for`
-> :class:`~rlvitals.analyzers.contract.trl_config.TrlLossConfig`, :func:`unaudited_reason`,
:func:`applied_entropy_coef`) and a TRL run's whole config (:func:`updates_per_batch`, :func:`loss_mode`,
the gradient-clip and learning-rate keys). Nothing here imports TRL, torch or the web stack."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .common import _positive_int

RECORDER_MARK = "_rlvitals_records_loss"  # set on a class whose _compute_loss only records and delegates


def trainer_arg(trainer: Any, name: str, default: Any = None) -> Any:
    """``trainer.args.<name>`` (the GRPOConfig), ``default`` when unset or None."""
    value = getattr(getattr(trainer, "args", None), name, None)
    return default if value is None else value


def _loss_owner(trainer: Any) -> type | None:
    """The class whose ``_compute_loss`` computes the loss: the first one below any recording class
    (the client's ``RlvitalsGRPOMixin`` carries :data:`RECORDER_MARK`)."""
    mro = type(trainer).__mro__
    marked = [i for i, cls in enumerate(mro) if RECORDER_MARK in vars(cls)]
    for cls in mro[marked[-1] + 1 if marked else 0 :]:
        if "_compute_loss" in vars(cls):
            return cls
    return None


def unaudited_reason(trainer: Any, inputs: Mapping[str, Any]) -> str | None:
    """Why this TRL ``GRPOTrainer``'s loss cannot be reproduced from what rlvitals receives, or None."""
    from ..trl_config import TrlLossType

    owner = _loss_owner(trainer)
    if owner is not None and owner.__name__ != "GRPOTrainer":
        return f"{owner.__qualname__} overrides GRPOTrainer._compute_loss; rlvitals reproduces TRL's own loss only"
    loss_type = str(getattr(trainer, "loss_type", trainer_arg(trainer, "loss_type", "dapo")))
    if loss_type not in {t.value for t in TrlLossType}:
        return f"loss_type {loss_type!r} is not one of TRL 1.16's (this TRL is newer than rlvitals knows)"
    vllm = bool(getattr(trainer, "use_vllm", False))
    if vllm and getattr(trainer, "vllm_importance_sampling_correction", False):
        return (
            "vllm_importance_sampling_correction multiplies the loss by vLLM's per-token importance ratios, "
            "which rlvitals does not receive"
        )
    if (
        getattr(trainer, "off_policy_mask_threshold", None) is not None
        and "sampling_per_token_logps" in inputs
    ):
        return "off_policy_mask_threshold measures drift against vLLM's sampling log-probs, which rlvitals does not receive"
    if getattr(trainer, "aux_loss_enabled", False):
        return "router_aux_loss_coef adds the MoE load-balancing loss, which rlvitals does not receive"
    world = int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1) or 1)
    if float(getattr(trainer, "top_entropy_quantile", 1.0)) < 1.0 and world > 1:
        return "top_entropy_quantile < 1 on several processes: the entropy threshold is a quantile over every process's tokens"
    return None


def trl_config_for(trainer: Any, inputs: Mapping[str, Any], *, entropy_coef: float | None = None):
    """The :class:`~rlvitals.analyzers.reference.trl.TrlLossConfig` of one ``_compute_loss`` call on ``trainer``.

    ``entropy_coef``: the coefficient TRL applies on this call, read *before* the call (the adaptive
    controller updates ``trainer.entropy_coef`` inside it); by default read now.
    """
    from ..trl_config import GLOBAL_TOKEN_NORM, TRL_LOSS_TYPES, TrlLossConfig, TrlLossType

    reason = unaudited_reason(trainer, inputs)
    if reason is not None:
        kind = str(getattr(trainer, "loss_type", "dapo"))
        return TrlLossConfig(loss_type=kind if kind in TRL_LOSS_TYPES else "dapo", unaudited=reason)
    loss_type = TrlLossType(str(getattr(trainer, "loss_type", trainer_arg(trainer, "loss_type", "dapo"))))
    items = inputs.get("num_items_in_batch") if loss_type in GLOBAL_TOKEN_NORM else None
    return TrlLossConfig(
        loss_type=loss_type,
        epsilon_low=float(trainer.epsilon_low),
        epsilon_high=float(trainer.epsilon_high),
        beta=float(trainer.beta),
        use_bias_correction_kl=bool(trainer_arg(trainer, "use_bias_correction_kl", True)),
        delta=trainer_arg(trainer, "delta"),
        importance_sampling_level=str(getattr(trainer, "importance_sampling_level", "token")),
        top_entropy_quantile=float(getattr(trainer, "top_entropy_quantile", 1.0)),
        off_policy_mask_threshold=getattr(trainer, "off_policy_mask_threshold", None),
        entropy_coef=float(applied_entropy_coef(trainer) if entropy_coef is None else entropy_coef),
        entropy_bonus=bool(getattr(trainer, "_entropy_bonus_enabled", False)),
        max_completion_length=getattr(trainer, "max_completion_length", None),
        gradient_accumulation_steps=int(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1),
        steps_per_generation=int(trainer_arg(trainer, "steps_per_generation", 1)),
        num_items_in_batch=None if items is None else int(items),  # a sync, on captured calls only
        num_processes=int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1) or 1),
        sequence_advantages=inputs["advantages"].dim() == 1,
        **{
            name: float(trainer_arg(trainer, name, default))
            for name, default in (
                ("sapo_temperature_pos", 1.0),
                ("sapo_temperature_neg", 1.05),
                ("vespo_k_pos", 2.0),
                ("vespo_lambda_pos", 3.0),
                ("vespo_k_neg", 3.0),
                ("vespo_lambda_neg", 2.0),
            )
        },
    )


def applied_entropy_coef(trainer: Any) -> float:
    """The entropy coefficient TRL's next ``_compute_loss`` applies (adaptive: gated by the last window)."""
    coef = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
    if getattr(trainer, "use_adaptive_entropy", False):
        target = float(trainer_arg(trainer, "entropy_target", 0.0))
        return coef if float(getattr(trainer, "_last_world_entropy", float("inf"))) <= target else 0.0
    return coef


# -- a TRL run's config (flattened ``GRPOConfig``) -------------------------------------------------------
UPDATE_KEYS = ("num_iterations", "steps_per_generation", "gradient_accumulation_steps")
LOSS_MODE_KEYS = ("importance_sampling_level", "loss_type")
GRAD_CLIP_KEYS = (("max_grad_norm", "TRL / HF Trainer: max_grad_norm"),)
LEARNING_RATE_KEYS = (("learning_rate", "TRL / HF Trainer: learning_rate"),)


def updates_per_batch(flat: Mapping[str, Any]) -> tuple[int, str] | None:
    """TRL GRPO: ``num_iterations`` (default 1) x ceil(``steps_per_generation`` /
    ``gradient_accumulation_steps``) (steps_per_generation defaults to gradient_accumulation_steps)."""
    if "num_iterations" not in flat and "steps_per_generation" not in flat:
        return None
    iterations = _positive_int(flat.get("num_iterations", 1)) or 1
    accumulation = _positive_int(flat.get("gradient_accumulation_steps", 1)) or 1
    per_generation = _positive_int(flat.get("steps_per_generation")) or accumulation
    return iterations * math.ceil(per_generation / accumulation), (
        "TRL: num_iterations × ⌈steps_per_generation / gradient_accumulation_steps⌉"
    )


def loss_mode(flat: Mapping[str, Any]) -> tuple[str, str] | None:
    """TRL's ``loss_type`` ("sapo") and ``importance_sampling_level`` ("sequence" is GSPO) as how the
    loss clips; None when neither says."""
    trl_loss = flat.get("loss_type")
    if isinstance(trl_loss, str) and trl_loss.lower() == "sapo":
        return "sapo", f"TRL: loss_type={trl_loss}"
    level = flat.get("importance_sampling_level")
    if isinstance(level, str) and level.lower() == "sequence":
        return "gspo", "TRL: importance_sampling_level=sequence"
    return None
