"""OpenRLHF integration: record ``PolicyLoss.forward`` calls and send the trainer's logs dict.

- ``RecordingPolicyLoss(inner, run=None, step_fn=None)`` wraps an ``openrlhf.models.loss.PolicyLoss``
  instance (any module with ``forward(log_probs, old_log_probs, advantages, action_mask=None, ...)``); it
  calls it, records the call's tensors and the metrics it returned, and returns its result unchanged::

      actor_trainer.actor_loss_fn = RecordingPolicyLoss(actor_trainer.actor_loss_fn, step_fn=lambda: step)

  OpenRLHF's ``PolicyLoss`` returns ``loss``, ``(loss, clip_ratio)`` or ``(loss, clip_ratio, ppo_kl,
  vllm_kl)`` depending on the version; ``loss`` is recorded as ``pg_loss``, ``clip_ratio`` as
  ``pg_clipfrac`` (its definition, ``surr2 < surr1``, is verl's) and ``ppo_kl`` as ``ppo_kl``. The loss
  configuration maps ``clip_eps_low``/``clip_eps_high`` to the clip range, ``token_level_loss`` to
  ``token-mean`` (else ``seq-mean-token-mean``) and ``dual_clip`` to ``clip_ratio_c`` (none: no dual clip).
- ``log_openrlhf(run, logs, step)`` / ``OpenRLHFLogger`` send the numeric entries of the ``logs_dict``
  OpenRLHF's PPO trainer builds per step (``policy_loss``, ``ppo_clip_ratio``/``clip_ratio``, ``ppo_kl``,
  ``kl``, ``reward``, ``response_length``, ...); a ``train/`` prefix is dropped.

OpenRLHF itself is never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlvitals.client.integrations._common import (
    Failures,
    RecordingError,
    RunRef,
    StepClock,
    scalars,
    wants_batch,
)

__all__ = ["OpenRLHFLogger", "RecordingError", "RecordingPolicyLoss", "log_openrlhf", "openrlhf_loss_config"]

_RESULT_NAMES = ("pg_loss", "pg_clipfrac", "ppo_kl", "vllm_kl")


def openrlhf_loss_config(loss: Any) -> dict[str, Any]:
    """verl ``LossConfig`` fields for an OpenRLHF ``PolicyLoss`` instance."""
    from rlvitals.analyzers.trl import NO_DUAL_CLIP  # a bound the (e^20-capped) ratio never reaches

    eps = getattr(loss, "clip_eps", None)
    low = getattr(loss, "clip_eps_low", eps if eps is not None else 0.2)
    high = getattr(loss, "clip_eps_high", low)
    dual = getattr(loss, "dual_clip", None)
    token_level = getattr(loss, "token_level_loss", True)
    return {
        "clip_ratio": float(low),
        "clip_ratio_low": float(low),
        "clip_ratio_high": float(high),
        "clip_ratio_c": float(dual) if dual else NO_DUAL_CLIP,
        "loss_agg_mode": "token-mean" if token_level else "seq-mean-token-mean",
    }


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
                self._record(result, log_probs, old_log_probs, advantages, action_mask)
            except Exception as exc:  # the trainer must never fail because recording did
                self.failures.add(exc)
        return result

    def _record(self, result, log_probs, old_log_probs, advantages, action_mask) -> None:
        step = self._clock.tick()
        run = self._run.get()
        if not wants_batch(run, step):
            return
        values = result if isinstance(result, tuple) else (result,)
        reported = {
            name: value.detach() if hasattr(value, "detach") else value
            for name, value in zip(_RESULT_NAMES, values, strict=False)
            if value is not None and name != "vllm_kl"
        }
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(log_probs)
        mask = action_mask if action_mask is not None else log_probs.new_ones(log_probs.shape, dtype=bool)
        run.log_batch(
            step,
            log_prob=log_probs.detach(),
            old_log_prob=old_log_probs,
            advantages=advantages,
            response_mask=mask.bool(),
            config=openrlhf_loss_config(self.inner),
            reported=reported,
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
