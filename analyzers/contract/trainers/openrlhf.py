"""OpenRLHF's configs, read once: a live ``PolicyLoss`` at one ``forward`` call (:func:`openrlhf_loss_config`
-> verl-named ``LossConfig`` fields) and an OpenRLHF run's whole config (:func:`updates_per_batch`, the
gradient-clip and learning-rate keys). Nothing here imports OpenRLHF, torch or the web stack."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..config import NO_DUAL_CLIP
from .common import _positive_int

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


# -- an OpenRLHF run's config (its flattened arguments) --------------------------------------------------
UPDATE_KEYS = ("rollout_batch_size", "n_samples_per_prompt", "train_batch_size", "max_epochs")
GRAD_CLIP_KEYS = (("max_norm", "OpenRLHF: max_norm"),)
LEARNING_RATE_KEYS = (("actor_learning_rate", "OpenRLHF: actor_learning_rate"),)


def updates_per_batch(flat: Mapping[str, Any]) -> tuple[int, str] | None:
    """OpenRLHF: ``max_epochs`` (default 1) x ``rollout_batch_size`` x ``n_samples_per_prompt`` /
    ``train_batch_size``; None without them."""
    rollout = _positive_int(flat.get("rollout_batch_size"))
    samples = _positive_int(flat.get("n_samples_per_prompt"))
    train_samples = _positive_int(flat.get("train_batch_size"))
    if rollout is None or samples is None or train_samples is None:
        return None
    epochs = _positive_int(flat.get("max_epochs", 1)) or 1
    return epochs * max(1, math.ceil(rollout * samples / train_samples)), (
        "OpenRLHF: max_epochs × rollout_batch_size × n_samples_per_prompt / train_batch_size"
    )
