"""One reader per trainer's config (:mod:`.verl`, :mod:`.trl`, :mod:`.openrlhf`), used by the audit, the client
integrations and the health rules alike, and what reads a run's config whatever its trainer.

A trainer's live config objects (at loss time) -> what the batch contract parses: ``verl_loss_config``
and the ``verl_*_section`` readers, ``trl_config_for``, ``openrlhf_loss_config`` (the client integrations
re-export them). A run's whole config, flattened to dotted keys (:func:`flatten_config`, also what the
health monitor persists) -> what the health rules need: :func:`updates_per_batch` (with one, the batch is
used on-policy: ``old_log_prob == log_prob`` and pg_clipfrac is 0 by construction), :func:`loss_mode`,
:func:`grad_clip`, :func:`learning_rate`; and verl's :func:`training_batch_size` for the advantage audit.
Each asks the trainers' readers in turn (verl, TRL, OpenRLHF); torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import openrlhf, trl, verl
from .common import _first_positive, _positive_int, config_get, flatten_config, plain_scalar
from .openrlhf import OPENRLHF_LOSS_MODES, OPENRLHF_NORMALISERS, openrlhf_loss_config
from .trl import RECORDER_MARK, applied_entropy_coef, trainer_arg, trl_config_for, unaudited_reason
from .verl import (
    VERL_ACTOR_FIELDS,
    VERL_DELEGATE,
    VERL_DISTILLATION_FIELDS,
    VERL_LOSS_MODE,
    training_batch_size,
    verl_distillation_section,
    verl_loss_config,
    verl_policy_loss_section,
    verl_section,
)

__all__ = [
    "CONFIG_KEYS",
    "EXPLICIT_KEY",
    "GRAD_CLIP_KEYS",
    "LEARNING_RATE_KEYS",
    "LOSS_MODE_KEYS",
    "OPENRLHF_LOSS_MODES",
    "OPENRLHF_NORMALISERS",
    "RECORDER_MARK",
    "VERL_ACTOR_FIELDS",
    "VERL_DELEGATE",
    "VERL_DISTILLATION_FIELDS",
    "VERL_LOSS_MODE",
    "applied_entropy_coef",
    "config_get",
    "flatten_config",
    "grad_clip",
    "learning_rate",
    "loss_mode",
    "openrlhf_loss_config",
    "plain_scalar",
    "trainer_arg",
    "training_batch_size",
    "trl_config_for",
    "unaudited_reason",
    "updates_per_batch",
    "verl_distillation_section",
    "verl_loss_config",
    "verl_policy_loss_section",
    "verl_section",
]

EXPLICIT_KEY = "rlvitals.updates_per_batch"
# every flattened key updates_per_batch() reads, plus the whole rlvitals section
CONFIG_KEYS: tuple[str, ...] = ("rlvitals.", *verl.UPDATE_KEYS, *trl.UPDATE_KEYS, *openrlhf.UPDATE_KEYS)
LOSS_MODE_KEYS: tuple[str, ...] = (verl.LOSS_MODE_KEY, *trl.LOSS_MODE_KEYS)
# where each trainer keeps the gradient-clipping threshold (the norm gradients are clipped to), first wins
GRAD_CLIP_KEYS: tuple[tuple[str, str], ...] = (
    *verl.GRAD_CLIP_KEYS,
    *trl.GRAD_CLIP_KEYS,
    *openrlhf.GRAD_CLIP_KEYS,
    ("rlvitals.grad_clip", "rlvitals.grad_clip"),
)
LEARNING_RATE_KEYS: tuple[tuple[str, str], ...] = (
    *verl.LEARNING_RATE_KEYS,
    *trl.LEARNING_RATE_KEYS,
    *openrlhf.LEARNING_RATE_KEYS,
)


def updates_per_batch(flat: Mapping[str, Any]) -> tuple[int | None, str]:
    """Optimizer updates per rollout batch, and where that came from; ``(None, reason)`` when unknown.

    Sources, first match wins: explicit ``rlvitals.updates_per_batch``; then each trainer's reader, verl
    (:func:`.verl.updates_per_batch`), TRL (:func:`.trl.updates_per_batch`), OpenRLHF
    (:func:`.openrlhf.updates_per_batch`).
    """
    explicit = _positive_int(flat.get(EXPLICIT_KEY))
    if explicit is not None:
        return explicit, EXPLICIT_KEY
    for reader in (verl.updates_per_batch, trl.updates_per_batch, openrlhf.updates_per_batch):
        found = reader(flat)
        if found is not None:
            return found
    return None, "unknown (no explicit rlvitals.updates_per_batch, verl, TRL or OpenRLHF keys)"


def loss_mode(flat: Mapping[str, Any]) -> tuple[str, str]:
    """How the policy loss clips, and where that came from: ``"gspo"`` (sequence-level ratio),
    ``"sapo"`` (soft gate, no hard clip) or ``"token"`` (token-level PPO clip: verl vanilla, TRL grpo/
    bnpo/dr_grpo/dapo, and anything unknown). A verl gspo/sapo wins, then TRL's, then verl's own word."""
    found_verl = verl.loss_mode(flat)
    if found_verl is not None and found_verl[0] != "token":
        return found_verl
    found_trl = trl.loss_mode(flat)
    if found_trl is not None:
        return found_trl
    if found_verl is not None:
        return found_verl
    return "token", "default (token-level PPO clip)"


def grad_clip(flat: Mapping[str, Any]) -> tuple[float | None, str]:
    """The gradient-clipping threshold (the norm the optimizer clips gradients to) and where it came from;
    ``(None, reason)`` when the config does not say or clipping is off (0, negative)."""
    return _first_positive(flat, GRAD_CLIP_KEYS)


def learning_rate(flat: Mapping[str, Any]) -> tuple[float | None, str]:
    """The actor's learning rate and where it came from; ``(None, reason)`` when the config does not say."""
    return _first_positive(flat, LEARNING_RATE_KEYS)
