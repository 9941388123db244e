"""Trainer -> config mappings from the live trainer objects (verl, TRL, OpenRLHF), beside the batch contract.

The integrations in ``rlvitals.client.integrations`` hold a trainer's own config objects at loss time:
verl's ``ActorConfig`` (a dataclass ``Mapping``, or an OmegaConf ``DictConfig``), TRL's ``GRPOTrainer``,
OpenRLHF's ``PolicyLoss`` module. The functions here read those objects into what the batch contract
parses (:func:`rlvitals.analyzers.contract.batch.parse_config`), so each trainer has one mapping and it lives in
``analyzers/`` next to the parser that reads its output:

- verl: :func:`verl_loss_config` (actor section -> verl-named JSON that ``LossConfig.from_verl`` reads;
  the field lists are ``LossConfig``'s own, split the way ``from_verl`` reads them), plus
  :func:`verl_section` / :func:`verl_policy_loss_section` / :func:`verl_distillation_section` for the
  ``algorithm``, ``policy_loss`` and ``distillation`` sections;
- TRL: :func:`trl_config_for` (a ``GRPOTrainer`` at one ``_compute_loss`` call -> ``TrlLossConfig``),
  :func:`unaudited_reason`, :func:`applied_entropy_coef`;
- OpenRLHF: :func:`openrlhf_loss_config` (a ``PolicyLoss`` + one ``forward`` call's normalisers -> verl
  ``LossConfig`` fields).

Nothing here imports a trainer, torch or the web stack at import time (``rlvitals.analyzers.contract.config`` is
plain Python); the TRL mapping imports ``rlvitals.analyzers.reference.trl`` (torch) when it runs, inside a trainer
that has torch loaded already. The client modules re-export these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .config import GLOBAL_BATCH_FIELDS, NO_DUAL_CLIP, POLICY_LOSS_FIELDS, LossConfig

# ----------------------------------------------------------------------------------------------- verl

VERL_DELEGATE = "vanilla"  # the loss the client's registered ``rlvitals`` loss wraps unless told otherwise
VERL_LOSS_MODE = "rlvitals"  # that registered loss's own name: never the loss audited
# LossConfig fields verl keeps in the actor section itself (the rest: policy_loss.*, global_batch_info.*)
VERL_ACTOR_FIELDS = tuple(
    f.name
    for f in fields(LossConfig)
    if f.name not in POLICY_LOSS_FIELDS
    and (f.name not in GLOBAL_BATCH_FIELDS or f.name == "loss_scale_factor")  # the actor has its own
)


def verl_loss_config(
    config: Any,
    loss_agg_mode: str | None = None,
    *,
    loss_mode: str | None = None,
    delegate: str = VERL_DELEGATE,
) -> dict[str, Any]:
    """The ``LossConfig`` fields of a verl ``ActorConfig`` (or any mapping) as plain JSON in verl's own
    shape: the actor-section fields (:data:`VERL_ACTOR_FIELDS`, SAPO's ``tau_pos``/``tau_neg`` included),
    ``global_batch_info``'s counts flattened, and ``policy_loss`` (``loss_mode`` and its knobs) nested
    where verl keeps it. ``LossConfig.from_verl`` reads the result back.

    ``loss_agg_mode`` overrides the actor's (verl passes it to the policy loss as an argument).
    ``loss_mode`` overrides ``policy_loss.loss_mode``: the loss that actually ran. A config that selects
    the client's registered ``rlvitals`` loss names ``delegate`` instead (the loss it wraps), so the
    server audits that loss and never ``rlvitals`` itself.
    """
    out: dict[str, Any] = {}
    for name in VERL_ACTOR_FIELDS:
        value = config_get(config, name)
        if value is not None:
            out[name] = plain_scalar(value)
    info = config_get(config, "global_batch_info") or {}
    for name in GLOBAL_BATCH_FIELDS:
        value = info.get(name) if hasattr(info, "get") else None
        if value is not None:
            out[name] = plain_scalar(value)
    if loss_agg_mode is not None:
        out["loss_agg_mode"] = loss_agg_mode
    section = verl_policy_loss_section(config_get(config, "policy_loss"))
    mode = section.get("loss_mode", VERL_DELEGATE)
    if mode == VERL_LOSS_MODE:
        mode = delegate
    section["loss_mode"] = loss_mode or mode
    out["policy_loss"] = section
    return out


def verl_section(section: Any) -> dict[str, Any]:
    """A verl config section (dataclass, DictConfig or dict) as plain JSON values, nested sections too
    (how the client sends verl's ``algorithm`` section)."""
    if section is None:
        return {}
    out = verl_policy_loss_section(section)
    for key, value in _items(section):
        if value is not None and not isinstance(plain_scalar(value), (str, int, float, bool)):
            inner = verl_section(value)
            if inner:
                out[str(key)] = inner
    return out


def verl_policy_loss_section(section: Any) -> dict[str, Any]:
    """verl's ``policy_loss`` (a ``PolicyLossConfig``, DictConfig or dict; also a
    ``RolloutCorrectionConfig``) as plain scalars, plus its ``rollout_correction`` when that is in
    ``bypass_mode`` (what the ``bypass_mode`` loss reads; otherwise it holds unused defaults)."""
    if section is None:
        return {}
    out = {}
    for key, value in _items(section):
        value = plain_scalar(value)
        if isinstance(value, (str, int, float, bool)) or value is None:
            out[str(key)] = value
        elif str(key) == "rollout_correction" and config_get(value, "bypass_mode"):
            out[str(key)] = verl_policy_loss_section(value)
    return out


VERL_DISTILLATION_FIELDS = (  # verl's DistillationLossConfig fields the distillation audit reads
    "loss_mode",
    "loss_max_clamp",
    "use_policy_gradient",
    "use_task_rewards",
    "distillation_loss_coef",
    "policy_loss_mode",
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
)


def verl_distillation_section(distillation_config: Any) -> dict[str, Any]:
    """``distillation_config.distillation_loss`` (verl's ``DistillationLossConfig``) as plain scalars,
    what ``DistillationConfig.from_verl`` reads under ``distillation.distillation_loss``."""
    loss = config_get(distillation_config, "distillation_loss")
    out = {}
    for name in VERL_DISTILLATION_FIELDS:
        value = plain_scalar(config_get(loss, name))
        if value is not None or name == "loss_max_clamp":
            out[name] = value
    return out


def _items(section: Any) -> Any:
    if isinstance(section, Mapping):
        return dict(section).items()
    if hasattr(section, "__dataclass_fields__"):
        return ((name, getattr(section, name, None)) for name in section.__dataclass_fields__)
    if hasattr(section, "items"):
        return section.items()
    return ()


def config_get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping) or hasattr(config, "get"):
        try:
            return config.get(name)
        except (KeyError, AttributeError, TypeError):
            pass
    return getattr(config, name, None)


def plain_scalar(value: Any) -> Any:
    """A 0-dim tensor (verl puts ``batch_num_tokens`` in as one) as its python number."""
    if hasattr(value, "item") and hasattr(value, "shape"):
        return value.item()
    return value


# ------------------------------------------------------------------------------------------------ TRL

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
    from .trl_config import TrlLossType

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
    from .trl_config import GLOBAL_TOKEN_NORM, TRL_LOSS_TYPES, TrlLossConfig, TrlLossType

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


# ------------------------------------------------------------------------------------------- OpenRLHF

OPENRLHF_LOSS_MODES = {"ppo": "vanilla", "gspo": "gspo"}  # OpenRLHF policy_loss_type -> verl loss_mode
OPENRLHF_NORMALISERS = ("dp_size", "batch_num_tokens", "global_batch_size")  # PolicyLoss.forward keywords


def openrlhf_loss_config(loss: Any, **normalisers: Any) -> dict[str, Any]:
    """verl ``LossConfig`` fields (and ``policy_loss.loss_mode``) for an OpenRLHF ``PolicyLoss`` instance,
    plus the loss normalisers of one ``forward`` call (``dp_size``, ``batch_num_tokens``,
    ``global_batch_size``) when given.

    ``clip_eps_low``/``clip_eps_high`` are the clip range, ``token_level_loss`` is ``token-mean`` (else
    ``seq-mean-token-mean``), ``dual_clip`` is ``clip_ratio_c`` (none: a bound no ratio reaches),
    ``policy_loss_type`` is ``policy_loss.loss_mode`` (``"unknown"`` for a type verl has no loss for: the
    batch contract's parse refuses it, so such a call is never audited as PPO).
    """
    eps = getattr(loss, "clip_eps", None)
    low = getattr(loss, "clip_eps_low", eps if eps is not None else 0.2)
    high = getattr(loss, "clip_eps_high", low)
    dual = getattr(loss, "dual_clip", None)
    token_level = getattr(loss, "token_level_loss", True)
    config = {
        "clip_ratio": float(low),
        "clip_ratio_low": float(low),
        "clip_ratio_high": float(high),
        "clip_ratio_c": float(dual) if dual else NO_DUAL_CLIP,
        "loss_agg_mode": "token-mean" if token_level else "seq-mean-token-mean",
        "policy_loss": {
            "loss_mode": OPENRLHF_LOSS_MODES.get(getattr(loss, "policy_loss_type", "ppo"), "unknown")
        },
    }
    total = "batch_num_tokens" if token_level else "global_batch_size"
    if normalisers.get(total) is not None:
        count, factor = _as_count(_count(normalisers[total]))
        config[total] = count
        config["dp_size"] = _count(normalisers.get("dp_size") or 1) * factor
    return config


def _count(value: Any) -> Any:
    """A normaliser OpenRLHF passes as a float tensor (``batch_num_tokens``) as the int it counts."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _as_count(value: float) -> tuple[int, int]:
    """``(count, k)`` with ``value == count / k``, ``k`` the smallest such integer.

    OpenRLHF passes ``total / gas`` (``iter_grad_accum_global_norm`` pre-compensates DeepSpeed's 1/gas
    loss scaling), so ``aggregate_loss`` is ``sum / (total / gas) * dp_size``; verl's normalisation
    ``sum / batch_num_tokens * dp_size`` is the same number with ``batch_num_tokens = total`` and
    ``dp_size = dp_size * gas``. ``value`` is a float32 from a tensor: ``k`` is found to 1e-4 relative.
    """
    if isinstance(value, int):
        return value, 1
    for k in range(1, 4097):
        count = round(value * k)
        if count >= 0 and abs(value * k - count) <= 1e-4 * max(1.0, value * k):
            return int(count), k
    raise ValueError(f"loss normaliser {value!r} is not a count divided by a small integer")
