"""TRL integration: a ``TrainerCallback`` for GRPOTrainer's logs and a mixin that captures its loss tensors.

- ``RlvitalsCallback(run=None, project=None, name=None, **init_options)`` — a ``transformers.TrainerCallback``
  (``init_options`` go to ``rlvitals.init`` when it starts the run: ``batch_every=``, ``url=``, ...).
  ``on_train_begin`` starts the run (on every process; one run per job) with the ``GRPOConfig`` as its
  config, so config-aware rules know ``num_iterations``; a run handed in gets the config with
  ``run.update_config``. Its name: ``name=``, else ``RLVITALS_RUN_NAME``, else ``GRPOConfig.run_name``,
  else a generated one. ``on_log`` sends every numeric log entry at ``state.global_step`` (world process
  zero only); GRPOTrainer's names are kept (the health rules read ``clip_ratio/region_mean`` as
  ``pg_clipfrac``, ``kl`` as ``kl_loss``, ...). ``on_train_end`` finishes a run it started.
  With ``halt_on=("critical",)`` (or causes / rules), ``on_step_end`` stops training at the first step
  boundary after the server reports a critical incident (``control.should_training_stop``; with
  ``save_on_halt=True`` a checkpoint first, ``control.should_save``); the incident's id and cause go to
  the ``rlvitals`` logger. Under ``accelerate launch`` every process stops (and saves) at the same step
  boundary: the processes agree on it with one small all-reduce per step (``Run.should_stop``).
- ``RlvitalsGRPOMixin`` — ``class Trainer(RlvitalsGRPOMixin, GRPOTrainer)``. It joins the trainer's
  ``RlvitalsCallback`` (or adds one), so callback and mixin share one run however they are combined
  (``rlvitals_run=`` on either side). Around ``_compute_loss`` it asks the shared :class:`AuditSampler`
  (position = ``trainer._step % (steps_per_generation * num_iterations)``: rotating through the update's
  micro-batches and iterations, so audits see clipping) whether to capture this call; the decision
  reads counters only. A captured call sends the policy's per-token log-probs and entropies, the
  batch's ``old_per_token_logps`` (the log-probs themselves when TRL stores none), ``ref_per_token_logps``,
  ``advantages``, ``completion_mask x tool_mask``, the :class:`~rlvitals.analyzers.reference.trl.TrlLossConfig`
  as TRL held it at the call, and as ``reported`` the loss ``_compute_loss`` returned plus the metrics
  it logged for this micro-batch (one process: all of them; several: the loss only, the rest are
  cross-process means). The server recomputes TRL's loss (``rlvitals.analyzers.verdicts.trl_audit``).
  Where it cannot (``unaudited_reason``: vLLM importance-sampling correction, vLLM off-policy mask,
  MoE router aux loss, ``top_entropy_quantile < 1`` on several processes, a ``_compute_loss`` override
  or a loss type newer than TRL 1.16's) it warns once (:class:`NotAudited`) and sends the tensors with no
  ``reported`` numbers. Training passes only; a failure to record is warned about once, never raised.

transformers is imported only when ``RlvitalsCallback`` is first used; without it this module imports
and ``RlvitalsCallback`` raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from rlvitals.analyzers.contract.trainers import (
    applied_entropy_coef,
    trainer_arg,
    trl_config_for,
    unaudited_reason,
)
from rlvitals.client.integrations._common import (
    ENV_RUN_NAME,
    AuditSampler,
    Failures,
    RecordingError,
    RunRef,
    scalars,
)
from rlvitals.client.run import agree_across_ranks

__all__ = [  # noqa: F822 - RlvitalsCallback is built on first access (module __getattr__)
    "NotAudited",
    "RecordingError",
    "RlvitalsCallback",
    "RlvitalsGRPOMixin",
    "TrlLogBridge",
    "applied_entropy_coef",
    "trl_config_for",
    "unaudited_reason",
]


class NotAudited(RuntimeWarning):
    """This GRPOTrainer's loss cannot be reproduced from the tensors rlvitals receives; it is not audited."""


def _args_dict(args: Any) -> dict[str, Any] | None:
    if args is None:
        return None
    to_dict = getattr(args, "to_dict", None)
    raw = to_dict() if callable(to_dict) else dict(vars(args))
    return {k: v for k, v in raw.items() if v is None or isinstance(v, (str, int, float, bool))}


def _is_main(state: Any) -> bool:
    return bool(getattr(state, "is_world_process_zero", True))


class TrlLogBridge:
    """The callback's logic, free of transformers (``RlvitalsCallback`` adds ``TrainerCallback``)."""

    def __init__(
        self,
        run: Any = None,
        *,
        project: str | None = None,
        name: str | None = None,
        save_on_halt: bool = False,
        **init_options: Any,
    ) -> None:
        self.run_ref = RunRef(run, project=project, name=name, options=init_options)
        self._owns_run = run is None
        self.save_on_halt = bool(save_on_halt)
        self.halted: dict | None = None  # the critical incident that stopped training, if one did

    def adopt(self, run: Any) -> None:
        """Use ``run`` (the mixin's ``rlvitals_run=``) unless this callback already has another."""
        if run is None:
            return
        current = self.run_ref.current
        if current is not None and current is not run:
            raise ValueError("RlvitalsCallback and RlvitalsGRPOMixin were given two different runs; pass one")
        if current is None:
            self.run_ref = RunRef(run)
            self._owns_run = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        config = _args_dict(args) or {}
        ref = self.run_ref
        if self._owns_run and getattr(getattr(ref.current, "state", None), "value", "open") != "open":
            ref = self.run_ref = RunRef(None, project=ref.project, name=ref.name, options=ref.options)
        if ref.current is not None:
            if _is_main(state) and config and hasattr(ref.current, "update_config"):
                ref.current.update_config(config)
            return
        name = ref.name or os.environ.get(ENV_RUN_NAME) or getattr(args, "run_name", None)
        if not name and not _is_main(state):
            return  # no name shared by every process: only the main one records (else one run per rank)
        ref.name = str(name) if name else None
        ref.get(config=config or None)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ):
        if not logs or not _is_main(state):
            return
        metrics = scalars(logs)
        if metrics:
            self.run_ref.get(config=_args_dict(args)).log(metrics, int(state.global_step))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """At each step boundary: stop training (``control.should_training_stop``, after a checkpoint with
        ``save_on_halt``) once the run reports a critical incident it opted to halt on (``halt_on=``)."""
        run = self.run_ref.current
        if self.halted is not None:
            return
        if run is None or not hasattr(run, "should_stop"):
            # a process with no run (no run name shared by the job's processes: only the main one
            # records) still takes part in the ranks' agreement, or the others would wait for it
            if self._halting():
                stop, incident_id = agree_across_ranks(False)
                if stop:
                    self.halted = {"id": incident_id or None, "from_another_rank": True}
                    control.should_training_stop = True
                    control.should_save = self.save_on_halt or control.should_save  # saving is collective too
            return
        try:
            stop = run.should_stop()  # agreed by every process of the job (``Run.should_stop``)
        except Exception:  # the client never crashes the trainer
            return
        if stop:
            self.halted = getattr(run, "halt_reason", None) or {}
            control.should_training_stop = True
            if self.save_on_halt:
                control.should_save = True

    def _halting(self) -> bool:
        options = self.run_ref.options
        settings = options.get("settings")
        return bool(options.get("halt_on") or getattr(settings, "halt_on", ()))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._owns_run and self.run_ref.current is not None:
            self.run_ref.current.finish()


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


# ------------------------------------------------------------------------------------------ the loss
# The GRPOTrainer -> TrlLossConfig mapping lives beside the batch contract (analyzers/contract/trainers/);
# unaudited_reason, trl_config_for and applied_entropy_coef are re-exported here.


class RlvitalsGRPOMixin:
    """Mix in before ``GRPOTrainer``: ``class MyTrainer(RlvitalsGRPOMixin, GRPOTrainer)``.

    Pass ``rlvitals_run=`` to the constructor (or to ``RlvitalsCallback``), or let the callback start a
    run from the environment when training begins; see the module docstring.
    """

    _rlvitals_records_loss = (
        True  # RECORDER_MARK: its _compute_loss only records, the loss is the next class's
    )

    def __init__(self, *args: Any, rlvitals_run: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rlvitals_capture: dict[str, Any] | None = None
        self._rlvitals_sampler: AuditSampler | None = None
        self._rlvitals_warned: set[str] = set()
        self.rlvitals_failures = Failures("a GRPOTrainer batch")
        bridges = [cb for cb in self.callback_handler.callbacks if isinstance(cb, TrlLogBridge)]
        if bridges:
            self._rlvitals_bridge = bridges[0]
            self._rlvitals_bridge.adopt(rlvitals_run)
        else:
            self._rlvitals_bridge = __getattr__("RlvitalsCallback")(rlvitals_run)
            self.add_callback(self._rlvitals_bridge)

    @property
    def rlvitals_run(self) -> Any:
        """The run this trainer records to (None until training begins, unless one was given)."""
        return self._rlvitals_bridge.run_ref.current

    # the policy's per-token log-probs, as _compute_loss computes them
    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._rlvitals_capture is not None:
            if isinstance(result, tuple):
                self._rlvitals_keep(result[0], result[1] if len(result) > 1 else None)
            elif isinstance(result, Mapping):
                self._rlvitals_keep(result.get("logps"), result.get("entropies"))
        return result

    def _rlvitals_keep(self, logps: Any, entropies: Any) -> None:
        capture = self._rlvitals_capture
        if "log_prob" not in capture and getattr(logps, "requires_grad", False):
            capture["log_prob"] = logps.detach()
            if entropies is not None:
                capture["entropy"] = entropies.detach()

    def _rlvitals_slot(self, run: Any) -> int | None:
        """Whether to capture this call (counters only: no tensor is read)."""
        if self._rlvitals_sampler is None:
            cycle = int(trainer_arg(self, "steps_per_generation", 1)) * int(
                getattr(self, "num_iterations", 1) or 1
            )
            self._rlvitals_sampler = AuditSampler.for_run(run, cycle=cycle)
        step = int(self.state.global_step) + 1  # the step these losses are logged under
        return self._rlvitals_sampler.take(step, int(getattr(self, "_step", 0)))

    def _compute_loss(self, model: Any, inputs: Mapping[str, Any]):
        run = self.rlvitals_run
        if run is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        try:
            slot = self._rlvitals_slot(run)
            if slot is not None:
                metrics = self._metrics["train"]
                before = {key: len(values) for key, values in metrics.items()}
                coef = applied_entropy_coef(self)
        except Exception as exc:  # the trainer must never fail because recording did
            self.rlvitals_failures.add(exc)
            slot = None
        if slot is None:
            return super()._compute_loss(model, inputs)
        self._rlvitals_capture = {}
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            capture, self._rlvitals_capture = self._rlvitals_capture, None
        try:
            if "log_prob" in capture:
                logged = {k: v[-1] for k, v in metrics.items() if len(v) > before.get(k, 0)}
                self._rlvitals_record(run, slot, capture, inputs, loss, logged, coef)
        except Exception as exc:
            self.rlvitals_failures.add(exc)
        return loss

    def _rlvitals_record(self, run, slot, capture, inputs, loss, logged, coef) -> None:
        from rlvitals.analyzers.reference.trl import LOCAL_METRICS

        log_prob = capture["log_prob"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(log_prob)
        old = inputs.get("old_per_token_logps")
        config = trl_config_for(self, inputs, entropy_coef=coef)
        if config.unaudited is not None:
            reported = {}
            if config.unaudited not in self._rlvitals_warned:
                self._rlvitals_warned.add(config.unaudited)
                warnings.warn(
                    f"rlvitals: this GRPOTrainer's loss is not audited: {config.unaudited}; its tensors are "
                    "still sent (histograms, on-policy gap), without reported numbers",
                    NotAudited,
                    stacklevel=3,
                )
        else:
            reported = {"loss": loss.detach()}  # copied off the device without a sync
            if config.num_processes == 1:
                reported.update({k: v for k, v in logged.items() if k in LOCAL_METRICS})
        run.log_batch(
            int(self.state.global_step) + 1,
            log_prob=log_prob,
            old_log_prob=log_prob if old is None else old,
            advantages=advantages,
            response_mask=mask,
            ref_log_prob=inputs.get("ref_per_token_logps"),
            rollout_log_probs=inputs.get("sampling_per_token_logps"),  # vLLM's, with its IS correction on
            entropy=capture.get("entropy"),
            config=config,
            reported=reported,
            micro_batch=slot,
            sampled=True,
        )
