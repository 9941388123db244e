"""verl's configs, read once: the live ``ActorConfig`` / ``DictConfig`` sections a trainer holds at loss time
(:func:`verl_loss_config`, :func:`verl_section`, :func:`verl_policy_loss_section`,
:func:`verl_distillation_section`: what :func:`rlvitals.analyzers.contract.batch.parse_config` parses)
and a verl run's whole config (:func:`training_batch_size`, :func:`updates_per_batch`, :func:`loss_mode`,
the gradient-clip and learning-rate keys). The audit and the health rules read verl through this module
only. Nothing here imports verl, torch or the web stack."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..config import GLOBAL_BATCH_FIELDS, POLICY_LOSS_FIELDS, LossConfig
from .common import _items, _positive_int, config_get, plain_scalar

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


def training_batch_size(*configs: Mapping[str, Any] | None) -> int | None:
    """The number of responses verl computes advantages over in one step (the driver's whole batch):
    ``data.train_batch_size`` x ``actor_rollout_ref.rollout.n`` of the first config holding both, else
    None."""
    for config in configs:
        if not hasattr(config, "get"):
            continue
        data, rollout = config.get("data"), (config.get("actor_rollout_ref") or {})
        rollout = rollout.get("rollout") if hasattr(rollout, "get") else None
        prompts = data.get("train_batch_size") if hasattr(data, "get") else None
        n = rollout.get("n", 1) if hasattr(rollout, "get") else None
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (prompts, n)):
            return prompts * n
    return None


# -- a verl run's config (flattened: ``{"dotted.key": scalar}``) ----------------------------------------
UPDATE_KEYS = (
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
)
LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
GRAD_CLIP_KEYS = (
    ("actor_rollout_ref.actor.grad_clip", "verl: actor_rollout_ref.actor.grad_clip"),
    ("actor.grad_clip", "verl: actor.grad_clip"),
)
LEARNING_RATE_KEYS = (("actor_rollout_ref.actor.optim.lr", "verl: actor_rollout_ref.actor.optim.lr"),)


def updates_per_batch(flat: Mapping[str, Any]) -> tuple[int, str] | None:
    """verl: ``actor_rollout_ref.actor.ppo_epochs`` (default 1) x ceil(``data.train_batch_size`` /
    ``actor_rollout_ref.actor.ppo_mini_batch_size``) (both counted in prompts); None without them."""
    train = _positive_int(flat.get("data.train_batch_size"))
    mini = _positive_int(flat.get("actor_rollout_ref.actor.ppo_mini_batch_size"))
    if train is None or mini is None:
        return None
    epochs = _positive_int(flat.get("actor_rollout_ref.actor.ppo_epochs", 1)) or 1
    return epochs * math.ceil(
        train / mini
    ), "verl: ppo_epochs × ⌈data.train_batch_size / actor.ppo_mini_batch_size⌉"


def loss_mode(flat: Mapping[str, Any]) -> tuple[str, str] | None:
    """verl's ``actor_rollout_ref.actor.policy_loss.loss_mode`` as how the loss clips (``"gspo"``,
    ``"sapo"``, else ``"token"``); None when the config does not say."""
    verl = flat.get(LOSS_MODE_KEY)
    if not isinstance(verl, str):
        return None
    kind = verl.lower() if verl.lower() in ("gspo", "sapo") else "token"
    return kind, f"verl: {LOSS_MODE_KEY}={verl}"
