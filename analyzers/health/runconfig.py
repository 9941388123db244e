"""What the health rules need to know about a run's trainer configuration.

:func:`flatten_config` turns a nested verl/TRL/OpenRLHF config (dicts, OmegaConf, or already dotted
keys) into ``{"dotted.key": scalar}`` with only JSON scalars kept, which is also what the monitor
persists. :func:`updates_per_batch` infers how many optimizer updates each rollout batch gets: with one,
the batch is used on-policy, ``old_log_prob == log_prob`` and pg_clipfrac is 0 by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

EXPLICIT_KEY = "rlvitals.updates_per_batch"
# every flattened key updates_per_batch() reads, plus the whole rlvitals section
CONFIG_KEYS: tuple[str, ...] = (
    "rlvitals.",
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "num_iterations",
    "steps_per_generation",
    "gradient_accumulation_steps",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "train_batch_size",
    "max_epochs",
)


def flatten_config(config: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``; keeps str/int/float/bool/None leaves, drops everything else."""
    flat: dict[str, Any] = {}
    if config is None:
        return flat
    items = config.items() if hasattr(config, "items") else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if hasattr(value, "items"):  # dict, OmegaConf DictConfig
            flat.update(flatten_config(value, name + "."))
        elif (
            value is None
            or isinstance(value, (str, bool, int))
            or (isinstance(value, float) and math.isfinite(value))
        ):
            flat[name] = value
    return flat


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number) or number < 1 or number != int(number):
        return None
    return int(number)


def updates_per_batch(flat: Mapping[str, Any]) -> tuple[int | None, str]:
    """Optimizer updates per rollout batch, and where that came from; ``(None, reason)`` when unknown.

    Sources, first match wins:
    - explicit ``rlvitals.updates_per_batch``;
    - verl: ``actor_rollout_ref.actor.ppo_epochs`` (default 1) × ⌈``data.train_batch_size`` /
      ``actor_rollout_ref.actor.ppo_mini_batch_size``⌉ (both counted in prompts);
    - TRL GRPO: ``num_iterations`` (default 1) × ⌈``steps_per_generation`` / ``gradient_accumulation_steps``⌉
      (steps_per_generation defaults to gradient_accumulation_steps);
    - OpenRLHF: ``max_epochs`` (default 1) × ``rollout_batch_size`` × ``n_samples_per_prompt`` / ``train_batch_size``.
    """
    explicit = _positive_int(flat.get(EXPLICIT_KEY))
    if explicit is not None:
        return explicit, EXPLICIT_KEY
    train = _positive_int(flat.get("data.train_batch_size"))
    mini = _positive_int(flat.get("actor_rollout_ref.actor.ppo_mini_batch_size"))
    if train is not None and mini is not None:
        epochs = _positive_int(flat.get("actor_rollout_ref.actor.ppo_epochs", 1)) or 1
        return epochs * math.ceil(train / mini), (
            "verl: ppo_epochs × ⌈data.train_batch_size / actor.ppo_mini_batch_size⌉"
        )
    if "num_iterations" in flat or "steps_per_generation" in flat:
        iterations = _positive_int(flat.get("num_iterations", 1)) or 1
        accumulation = _positive_int(flat.get("gradient_accumulation_steps", 1)) or 1
        per_generation = _positive_int(flat.get("steps_per_generation")) or accumulation
        return iterations * math.ceil(per_generation / accumulation), (
            "TRL: num_iterations × ⌈steps_per_generation / gradient_accumulation_steps⌉"
        )
    rollout = _positive_int(flat.get("rollout_batch_size"))
    samples = _positive_int(flat.get("n_samples_per_prompt"))
    train_samples = _positive_int(flat.get("train_batch_size"))
    if rollout is not None and samples is not None and train_samples is not None:
        epochs = _positive_int(flat.get("max_epochs", 1)) or 1
        return epochs * max(1, math.ceil(rollout * samples / train_samples)), (
            "OpenRLHF: max_epochs × rollout_batch_size × n_samples_per_prompt / train_batch_size"
        )
    return None, "unknown (no explicit rlvitals.updates_per_batch, verl, TRL or OpenRLHF keys)"


VERL_LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"
LOSS_MODE_KEYS: tuple[str, ...] = (VERL_LOSS_MODE, "importance_sampling_level", "loss_type")


def loss_mode(flat: Mapping[str, Any]) -> tuple[str, str]:
    """How the policy loss clips, and where that came from: ``"gspo"`` (sequence-level ratio),
    ``"sapo"`` (soft gate, no hard clip) or ``"token"`` (token-level PPO clip: verl vanilla, TRL grpo/
    bnpo/dr_grpo/dapo, and anything unknown).

    Sources: verl ``actor_rollout_ref.actor.policy_loss.loss_mode``; TRL ``loss_type`` ("sapo") and
    ``importance_sampling_level`` ("sequence" is GSPO).
    """
    verl = flat.get(VERL_LOSS_MODE)
    if isinstance(verl, str) and verl.lower() in ("gspo", "sapo"):
        return verl.lower(), f"verl: {VERL_LOSS_MODE}={verl}"
    trl_loss = flat.get("loss_type")
    if isinstance(trl_loss, str) and trl_loss.lower() == "sapo":
        return "sapo", f"TRL: loss_type={trl_loss}"
    level = flat.get("importance_sampling_level")
    if isinstance(level, str) and level.lower() == "sequence":
        return "gspo", "TRL: importance_sampling_level=sequence"
    if isinstance(verl, str):
        return "token", f"verl: {VERL_LOSS_MODE}={verl}"
    return "token", "default (token-level PPO clip)"


# where each trainer keeps the gradient-clipping threshold (the norm gradients are clipped to), first wins
GRAD_CLIP_KEYS: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.grad_clip", "verl: actor_rollout_ref.actor.grad_clip"),
    ("actor.grad_clip", "verl: actor.grad_clip"),
    ("max_grad_norm", "TRL / HF Trainer: max_grad_norm"),
    ("max_norm", "OpenRLHF: max_norm"),
    ("rlvitals.grad_clip", "rlvitals.grad_clip"),
)
LEARNING_RATE_KEYS: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.optim.lr", "verl: actor_rollout_ref.actor.optim.lr"),
    ("learning_rate", "TRL / HF Trainer: learning_rate"),
    ("actor_learning_rate", "OpenRLHF: actor_learning_rate"),
)


def _positive_float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _first_positive(flat: Mapping[str, Any], keys: tuple[tuple[str, str], ...]) -> tuple[float | None, str]:
    for key, source in keys:
        number = _positive_float(flat.get(key))
        if number is not None:
            return number, source
    return None, "not in the run config"


def grad_clip(flat: Mapping[str, Any]) -> tuple[float | None, str]:
    """The gradient-clipping threshold (the norm the optimizer clips gradients to) and where it came from;
    ``(None, reason)`` when the config does not say or clipping is off (0, negative)."""
    return _first_positive(flat, GRAD_CLIP_KEYS)


def learning_rate(flat: Mapping[str, Any]) -> tuple[float | None, str]:
    """The actor's learning rate and where it came from; ``(None, reason)`` when the config does not say."""
    return _first_positive(flat, LEARNING_RATE_KEYS)
