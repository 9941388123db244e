"""TRL integration: a ``TrainerCallback`` for GRPOTrainer's logs and a mixin that captures its loss tensors.

- ``RlvitalsCallback(run=None, project=None, name=None)`` — a ``transformers.TrainerCallback``. ``on_log``
  sends every numeric entry of the trainer's logs at ``state.global_step`` (world process zero only).
  GRPOTrainer's names are kept as they are; the health rules read them through their alias tables:
  ``clip_ratio/region_mean`` is verl's ``pg_clipfrac`` (the same token set: ratio above ``1+ε_high``
  with A>0 or below ``1-ε_low`` with A<0), ``clip_ratio/low_mean`` / ``clip_ratio/high_mean`` its two
  sides, ``kl`` is the policy-vs-reference KL (verl's ``kl_loss`` signal, *not* ``ppo_kl``), ``entropy``
  the mean token entropy, ``frac_reward_zero_std`` the share of zero-variance groups.
  ``on_train_begin`` starts the run (when none was given) with the ``GRPOConfig`` as its config, so the
  rules know ``num_iterations`` (one update per batch: clipping is 0 by construction).
- ``RlvitalsGRPOMixin`` — ``class Trainer(RlvitalsGRPOMixin, GRPOTrainer)``: around ``_compute_loss`` it
  keeps the policy's per-token log-probs (and entropies) from ``_get_per_token_logps_and_entropies`` /
  ``_get_per_token_logps``, and sends them with the batch's ``old_per_token_logps`` (the log-probs
  themselves when ``num_iterations == 1``), ``ref_per_token_logps``, ``advantages`` and
  ``completion_mask`` to ``run.log_batch``, with the loss configuration mapped onto verl's
  (``loss_config_for``, built on ``rlvitals.analyzers.trl.trl_loss_config``). Training passes only; a
  failure to record is warned about once, never raised.

transformers is imported only when ``RlvitalsCallback`` is first used; without it this module imports
and ``RlvitalsCallback`` raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlvitals.client.integrations._common import Failures, RecordingError, RunRef, scalars

__all__ = ["RecordingError", "RlvitalsCallback", "RlvitalsGRPOMixin", "TrlLogBridge", "loss_config_for"]  # noqa: F822 - RlvitalsCallback is built on first access (module __getattr__)


def loss_config_for(trainer: Any, completion_mask: Any = None, inputs: Mapping[str, Any] | None = None):
    """The verl ``LossConfig`` equal to a GRPOTrainer's loss on one micro-batch.

    Reads ``loss_type``, ``epsilon``/``epsilon_low``, ``epsilon_high``, ``beta``, ``delta`` and
    ``max_completion_length`` from the trainer (or its ``args``) and hands them, with what the micro-batch
    says (rows, valid tokens, ``num_items_in_batch`` for dapo) and the trainer's
    ``current_gradient_accumulation_steps`` (recent TRL divides the loss by it), to
    :func:`rlvitals.analyzers.trl.trl_loss_config`, which documents how the two losses differ.
    """
    from rlvitals.analyzers.trl import trl_loss_config

    low = _attr(trainer, "epsilon_low", None)
    low = _attr(trainer, "epsilon", 0.2) if low is None else low
    items = None if inputs is None else inputs.get("num_items_in_batch")
    world = int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1) or 1)
    return trl_loss_config(
        str(_attr(trainer, "loss_type", "grpo")),
        epsilon=float(low),
        epsilon_high=_attr(trainer, "epsilon_high", None),
        beta=float(_attr(trainer, "beta", 0.0) or 0.0),
        delta=_attr(trainer, "delta", None),
        max_completion_length=_attr(trainer, "max_completion_length", None),
        batch_size=None if completion_mask is None else int(completion_mask.shape[0]),
        num_tokens=None if completion_mask is None else int(completion_mask.sum()),
        gradient_accumulation_steps=int(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1),
        num_items_in_batch=None if items is None else int(items),
        num_processes=world,
    )


def _attr(source: Any, name: str, default: Any) -> Any:
    for holder in (source, getattr(source, "args", None)):
        if holder is not None and getattr(holder, name, None) is not None:
            return getattr(holder, name)
    return default


def _args_dict(args: Any) -> dict[str, Any] | None:
    if args is None:
        return None
    to_dict = getattr(args, "to_dict", None)
    raw = to_dict() if callable(to_dict) else dict(vars(args))
    return {k: v for k, v in raw.items() if v is None or isinstance(v, (str, int, float, bool))}


class TrlLogBridge:
    """The callback's logic, free of transformers (``RlvitalsCallback`` adds ``TrainerCallback``)."""

    def __init__(self, run: Any = None, *, project: str | None = None, name: str | None = None) -> None:
        self._owns_run = run is None
        self._run = RunRef(run, project=project, name=name)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(state, "is_world_process_zero", True):
            config = _args_dict(args) or {}
            name = self._run.name or getattr(args, "run_name", None)
            if name and not self._run.started:
                self._run.name = str(name)
            self._run.get(config=config or None)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ):
        if not logs or not getattr(state, "is_world_process_zero", True):
            return
        metrics = scalars(logs)
        if metrics:
            self._run.get(config=_args_dict(args)).log(metrics, int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._owns_run and self._run.started and getattr(state, "is_world_process_zero", True):
            self._run.get().finish()


def _build_callback() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError(
            "rlvitals.client.integrations.trl.RlvitalsCallback needs transformers: pip install transformers trl"
        ) from exc

    class RlvitalsCallback(TrlLogBridge, TrainerCallback):
        """Sends a Trainer's (e.g. GRPOTrainer's) logs to rlvitals; see the module docstring."""

    RlvitalsCallback.__module__ = __name__
    return RlvitalsCallback


def __getattr__(name: str) -> Any:
    if name == "RlvitalsCallback":
        cls = _build_callback()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RlvitalsGRPOMixin:
    """Mix in before ``GRPOTrainer``: ``class MyTrainer(RlvitalsGRPOMixin, GRPOTrainer)``.

    Pass ``rlvitals_run=`` to the constructor, or let it start a run from the environment.
    """

    def __init__(self, *args: Any, rlvitals_run: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rlvitals_run = RunRef(rlvitals_run)
        self._rlvitals_capture: dict[str, Any] | None = None
        self.rlvitals_failures = Failures("a GRPOTrainer batch")

    # the policy's per-token log-probs, as _compute_loss computes them
    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if isinstance(result, tuple):
            self._rlvitals_keep(result[0], result[1] if len(result) > 1 else None)
        elif isinstance(result, Mapping):
            self._rlvitals_keep(result.get("logps"), result.get("entropies"))
        return result

    def _get_per_token_logps(self, *args: Any, **kwargs: Any):
        result = super()._get_per_token_logps(*args, **kwargs)
        self._rlvitals_keep(result, None)
        return result

    def _rlvitals_keep(self, logps: Any, entropies: Any) -> None:
        capture = self._rlvitals_capture
        if capture is not None and "log_prob" not in capture and getattr(logps, "requires_grad", False):
            capture["log_prob"] = logps.detach()
            if entropies is not None:
                capture["entropy"] = entropies.detach()

    def _compute_loss(self, model: Any, inputs: Mapping[str, Any]):
        self._rlvitals_capture = {}
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            capture, self._rlvitals_capture = self._rlvitals_capture, None
        if "log_prob" in capture:
            try:
                self._rlvitals_record(capture, inputs)
            except Exception as exc:  # the trainer must never fail because recording did
                self.rlvitals_failures.add(exc)
        return loss

    def _rlvitals_record(self, capture: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
        log_prob = capture["log_prob"]
        mask = inputs["completion_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(log_prob)
        old = inputs.get("old_per_token_logps")
        reported = self._rlvitals_reported()
        step = int(self.state.global_step) + 1  # the step these losses are logged under
        self._rlvitals_run.get().log_batch(
            step,
            log_prob=log_prob,
            old_log_prob=log_prob if old is None else old,
            advantages=advantages,
            response_mask=mask.bool(),
            ref_log_prob=inputs.get("ref_per_token_logps"),
            entropy=capture.get("entropy"),
            config=loss_config_for(self, mask, inputs),
            reported=reported,
        )

    def _rlvitals_reported(self) -> dict[str, float]:
        """The clip share TRL just logged for this batch (gathered over processes: exact for one)."""
        metrics = getattr(self, "_metrics", None)
        if not isinstance(metrics, Mapping):
            return {}
        train = metrics.get("train", metrics)
        region = train.get("clip_ratio/region_mean") if isinstance(train, Mapping) else None
        world = int(getattr(getattr(self, "accelerator", None), "num_processes", 1) or 1)
        if region and world == 1:
            return {"pg_clipfrac": float(region[-1])}
        return {}
