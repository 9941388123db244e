"""OpenRLHF integration: record ``PolicyLoss.forward`` calls and send the trainer's logs dict.

- ``RecordingPolicyLoss(inner, run=None, step_fn=None)`` wraps an ``openrlhf.models.loss.PolicyLoss``
  instance (any module with ``forward(log_probs, old_log_probs, advantages, action_mask=None, ...)``); it
  calls it, records the call's tensors and the metrics it returned, and returns its result unchanged::

      actor_trainer.actor_loss_fn = RecordingPolicyLoss(actor_trainer.actor_loss_fn, step_fn=lambda: step)

  OpenRLHF's ``PolicyLoss`` returns ``loss``, ``(loss, clip_ratio)``, ``(loss, clip_ratio, ppo_kl,
  vllm_kl)`` or (0.11) ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``; ``loss`` is recorded as
  ``pg_loss``, ``clip_ratio`` as ``pg_clipfrac`` (its definition, ``surr2 < surr1``, is verl's) and
  ``ppo_kl`` as ``ppo_kl``. The loss configuration (``openrlhf_loss_config``: the one OpenRLHF
  mapping, in ``rlvitals.analyzers.contract.trainers``, re-exported here) maps ``clip_eps_low`` /
  ``clip_eps_high`` to the clip range, ``token_level_loss`` to ``token-mean`` (else
  ``seq-mean-token-mean``), ``dual_clip`` to ``clip_ratio_c`` (none: no dual clip), the ``dp_size`` /
  ``batch_num_tokens`` / ``global_batch_size`` the trainer passes to ``forward`` to verl's global
  normalisation (the same formulas as OpenRLHF's ``aggregate_loss``), and ``policy_loss_type`` to
  ``policy_loss.loss_mode``. ``rollout_log_probs``
  (vLLM's) are sent along. With the vLLM importance-sampling correction on (``is_correction_level`` not
  ``"off"``) the loss is scaled by weights the client does not send: ``pg_loss`` is left unaudited
  (warned once), ``pg_clipfrac`` and ``ppo_kl`` are still audited.
- Which calls are sent: an ``AuditSampler`` (every ``batch_every`` steps one call, rotating through the
  step's micro-batches and epochs, so the audits see the off-policy ones where clipping happens).
- ``log_openrlhf(run, logs, step)`` / ``OpenRLHFLogger`` send the numeric entries of the ``logs_dict``
  OpenRLHF's PPO trainer builds per step (``policy_loss``, ``ppo_clip_ratio``/``clip_ratio``, ``ppo_kl``,
  ``kl``, ``reward``, ``response_length``, ...); a ``train/`` prefix is dropped.

OpenRLHF itself is never imported.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from rlvitals.analyzers.contract.trainers import OPENRLHF_NORMALISERS, openrlhf_loss_config
from rlvitals.client.integrations._common import (
    AuditSampler,
    Failures,
    RecordingError,
    RunRef,
    StepClock,
    scalars,
)

__all__ = ["OpenRLHFLogger", "RecordingError", "RecordingPolicyLoss", "log_openrlhf", "openrlhf_loss_config"]

_RESULT_NAMES = ("pg_loss", "pg_clipfrac", "ppo_kl", "vllm_kl", "is_filter_ratio")
_UNAUDITED = ("vllm_kl", "is_filter_ratio")  # vLLM-vs-trainer metrics, not the loss
_NORMALISERS = OPENRLHF_NORMALISERS  # PolicyLoss.forward keywords


def _nn_module() -> type:
    try:
        from torch import nn

        return nn.Module
    except ImportError:  # pragma: no cover - torch is a dependency of rlvitals
        return object


class RecordingPolicyLoss(_nn_module()):
    """Wraps a policy-loss module; ``forward`` = the inner forward + one ``run.log_batch``."""

    def __init__(
        self,
        inner: Any,
        run: Any = None,
        *,
        step_fn: Callable[[], int | None] | None = None,
        calls_per_step: int | None = None,
    ) -> None:
        super().__init__()
        if not callable(inner):
            raise TypeError(f"inner must be a policy-loss module, got {type(inner).__name__}")
        self.inner = inner
        self._run = RunRef(run)
        self._clock = StepClock(step_fn=step_fn, calls_per_step=calls_per_step)
        self._sampler: AuditSampler | None = None
        self._weights_warned = False
        self.failures = Failures("an OpenRLHF loss call")

    def __getattr__(self, name: str) -> Any:  # clip_eps_low, token_level_loss, ... of the inner loss
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("inner") or self.__dict__.get("inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, *args: Any, **kwargs: Any):
        """Tensors ``(batch, num_actions)``; returns exactly what the inner loss returns."""
        result = self.inner(log_probs, old_log_probs, advantages, action_mask, *args, **kwargs)
        if getattr(log_probs, "requires_grad", False):
            try:
                self._record(result, log_probs, old_log_probs, advantages, action_mask, args, kwargs)
            except Exception as exc:  # the trainer must never fail because recording did
                self.failures.add(exc)
        return result

    def _record(self, result, log_probs, old_log_probs, advantages, action_mask, args, kwargs) -> None:
        step = self._clock.tick()
        run = self._run.get()
        if self._sampler is None:
            self._sampler = AuditSampler.for_run(run)
        position = self._sampler.take(step)  # counters only: no tensor is read for an unsampled call
        if position is None:
            return
        # forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size, ...)
        named = dict(zip(("rollout_log_probs", *_NORMALISERS), args, strict=False)) | kwargs
        values = result if isinstance(result, tuple) else (result,)
        reported = {
            name: value.detach() if hasattr(value, "detach") else value
            for name, value in zip(_RESULT_NAMES, values, strict=False)
            if value is not None and name not in _UNAUDITED
        }
        if getattr(self.inner, "is_correction_level", "off") != "off":
            reported.pop("pg_loss", None)  # scaled by vLLM IS weights the client does not send
            if not self._weights_warned:
                self._weights_warned = True
                warnings.warn(
                    "rlvitals: OpenRLHF's vLLM importance-sampling correction scales the loss by weights "
                    "rlvitals does not receive; pg_loss is sent unaudited, pg_clipfrac and ppo_kl are audited",
                    RecordingError,
                    stacklevel=4,
                )
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(log_probs)
        mask = action_mask if action_mask is not None else log_probs.new_ones(log_probs.shape, dtype=bool)
        run.log_batch(
            step,
            log_prob=log_probs.detach(),
            old_log_prob=old_log_probs,
            advantages=advantages,
            response_mask=mask.bool(),
            rollout_log_probs=named.get("rollout_log_probs"),
            config=openrlhf_loss_config(self.inner, **{k: named.get(k) for k in _NORMALISERS}),
            reported=reported,
            micro_batch=position,
            sampled=True,
        )


def log_openrlhf(run: Any, logs: Mapping[str, Any], step: int) -> dict[str, float | int]:
    """Send the numeric entries of an OpenRLHF ``logs_dict`` (``train/`` prefix dropped); returns them."""
    metrics = scalars(logs, strip_prefix="train/")
    if metrics:
        run.log(metrics, step)
    return metrics


class OpenRLHFLogger:
    """``log(logs_dict, global_step)`` / ``finish()`` for an OpenRLHF trainer's ``save_logs_and_checkpoints``."""

    def __init__(self, run: Any = None, *, project: str | None = None, name: str | None = None) -> None:
        self._run = RunRef(run, project=project, name=name)

    def log(self, logs: Mapping[str, Any], step: int) -> dict[str, float | int]:
        return log_openrlhf(self._run.get(), logs, step)

    def finish(self) -> None:
        if self._run.started:
            self._run.get().finish()
