"""The fast path's entry points: :func:`token_batch` (a :class:`~rlvitals.analyzers.fast.token_batch.TokenBatch`
from checked tensors) and :func:`recompute` (every loss metric verl would report, through it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..contract import batch as contract
from ..contract.batch import CheckedTensors
from ..contract.config import LossConfig
from .token_batch import TokenBatch

Tensor = torch.Tensor


def token_batch(tensors: Mapping[str, Any], *, dense: bool = False):
    """The :class:`~rlvitals.analyzers.fast.token_batch.TokenBatch` of ``tensors`` (its keyword names; None:
    absent), the per-tensor rules checked once: by :func:`~rlvitals.analyzers.contract.batch.check_token_tensors` here, unless ``tensors``
    is a :class:`CheckedTensors` (checked at validation). ``dense``: TokenBatch's (an audit's batch,
    which aggregates every way)."""
    if not isinstance(tensors, CheckedTensors):
        contract.check_token_tensors(tensors)
    return TokenBatch(**{k: v for k, v in tensors.items() if v is not None}, dense=dense)


def recompute(
    config: LossConfig,
    *,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    ref_log_prob: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> dict[str, float]:
    """Every loss metric verl would report for this micro-batch, as python floats (no autograd).

    Keys: ``pg_loss``, the loss mode's metrics (vanilla: ``pg_clipfrac``, ``ppo_kl``,
    ``pg_clipfrac_lower``; see :mod:`rlvitals.analyzers.reference.policy_losses`), ``policy_loss``, plus ``kl_loss`` when
    ``ref_log_prob`` is given and ``entropy_loss`` when ``entropy`` is given. ``rollout_is_weights``
    multiply the per-token policy loss as in verl. Shapes ``(batch, response_len)``;
    float16/bfloat16/float32/float64.
    """
    batch = token_batch(
        {
            "log_prob": log_prob,
            "old_log_prob": old_log_prob,
            "advantages": advantages,
            "response_mask": response_mask,
            "ref_log_prob": ref_log_prob,
            "entropy": entropy,
            "rollout_is_weights": rollout_is_weights,
        }
    )
    return batch.metrics(config)
