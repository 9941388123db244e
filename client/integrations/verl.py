"""verl 0.9.1 integration, without patching verl.

Three independent pieces; verl is imported only when one of them runs.

a) ``policy_loss`` — a policy loss in verl's registry (``verl.trainer.ppo.core_algos.register_policy_loss``)
   under the name ``"rlvitals"``. It calls the loss it wraps (``"vanilla"`` unless
   ``RLVITALS_VERL_DELEGATE`` or ``configure(delegate=...)`` says otherwise), records the micro-batch's
   ``(old_log_prob, log_prob, advantages, response_mask)`` with the metrics that loss returned, and
   returns them unchanged. Select it with ``actor_rollout_ref.actor.policy_loss.loss_mode=rlvitals`` and
   load this module in every worker with ``VERL_USE_EXTERNAL_MODULES=rlvitals.client.integrations.verl``.
b) ``ppo_loss(config, model_output, data, dp_group=None)`` — the same signature as
   ``verl.workers.utils.losses.ppo_loss``, which it calls; it also records ``entropy``, ``ref_log_prob``,
   ``token_level_rewards``/``uid`` groups when present, and the global batch info
   (``dp_size``, ``batch_num_tokens``, ``global_batch_size``). Bind it with
   ``actor.set_loss_fn(functools.partial(ppo_loss, config=actor_config))``.
   ``distillation_ppo_loss`` does the same for verl's ``trainer.distillation.distillation_ppo_loss`` (the
   loss verl binds when ``distillation.enabled``), and also records the teacher's log-probs of the sampled
   tokens (``teacher_logprobs``) with the ``distillation_loss`` settings, so the server audits the
   ``distillation/*`` metrics and the PPO + distillation total.
   Both forward verl's ``rollout_is_weights`` and ``rollout_log_probs`` when the batch has them: the
   server audits the weighted loss and compares the weights with the ones the rollout-correction config
   gives (``configure(algorithm=cfg.algorithm)`` or the run's config supplies it).
d) ``compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config)`` — verl's driver-side
   function (``trainer.ppo.rollout_corr_helper``), which it calls; on the steps the run's ``batch_every``
   picks it also sends the whole batch (mask before rejection, ``old_log_probs``, ``rollout_log_probs``,
   the weights verl computed) with verl's ``rollout_corr/*`` values, the only place they exist, so the
   server recomputes the weights and rejection mask and checks them. ``RayPPOTrainer.fit`` imports that
   function from its module at each step; ``install_rollout_correction()`` points the module's name at
   this wrapper (the one opt-in swap of a verl attribute; ``uninstall_rollout_correction()`` undoes it).
c) Scalars without touching verl at all: ``JsonlTailer`` follows the JSONL that verl's ``file`` logger
   writes (``VERL_FILE_LOGGER_PATH``) into a run; ``VerlTrackingLogger`` has verl's tracking-backend
   interface (``log(data, step)``, ``finish()``) for a ``Tracking.logger`` dict or a custom trainer; with
   ``halt_on=`` it stops verl's loop at a step boundary on a critical incident (``TrainingHalted``,
   ``fit(trainer)`` saves a checkpoint and returns the incident).

Which calls are sent: an ``AuditSampler`` (``_common``) following the run's ``batch_every`` picks one
micro-batch every ``batch_every`` steps, rotating through the positions of a step's update cycle (every
micro-batch of every mini-batch of every PPO epoch after one rollout, in verl's order), so that the audits
see the later mini-batches and epochs, where ``old_log_prob != log_prob`` and clipping happens, and not only
the first, on-policy one (ratio 1, every clip metric 0). The capture carries its position as
``micro_batch``. Deciding reads no tensor.

verl's loss functions are never told the training step. The recorders take it from ``set_step(step)``
when the trainer calls it, else count it (see ``StepClock``): ``RLVITALS_VERL_CALLS_PER_STEP`` loss calls
per step when set, else a new step whenever the last-mini-batch flag verl passes in the data flips back
(``ppo_loss`` only) or the loss has been idle for ``RLVITALS_VERL_STEP_GAP_S`` seconds (default 5: the
rollout of the next batch). Recording only happens in training passes (``log_prob.requires_grad``); a
failure to record is counted and warned about once, never raised into verl.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rlvitals.analyzers.contract.trainers import (
    VERL_DELEGATE,
    VERL_LOSS_MODE,
    config_get,
    plain_scalar,
    verl_distillation_section,
    verl_loss_config,
    verl_policy_loss_section,
    verl_section,
)
from rlvitals.client.integrations._common import (
    DEFAULT_STEP_GAP_S,
    AuditSampler,
    Failures,
    RecordingError,
    RunRef,
    StepClock,
    scalars,
)

LOSS_MODE = VERL_LOSS_MODE  # the name this module's policy loss registers under in verl
DEFAULT_DELEGATE = VERL_DELEGATE
ENV_DELEGATE = "RLVITALS_VERL_DELEGATE"
ENV_CALLS_PER_STEP = "RLVITALS_VERL_CALLS_PER_STEP"
ENV_STEP_GAP = "RLVITALS_VERL_STEP_GAP_S"

_ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # reproducible from log-probs

__all__ = [
    "JsonlTailer",
    "RecordingError",
    "TrainingHalted",
    "VerlTrackingLogger",
    "compute_rollout_correction_and_add_to_batch",
    "configure",
    "distillation_ppo_loss",
    "fit",
    "install_rollout_correction",
    "loss_config",
    "policy_loss",
    "ppo_loss",
    "read_verl_jsonl",
    "recording_failures",
    "register",
    "set_step",
    "uninstall_rollout_correction",
]

_inside_ppo_loss: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "rlvitals_inside_ppo_loss", default=False
)


class _Recorder:
    """Process-wide state of the recorders: the run, the step clock, the delegate, failure counts."""

    def __init__(self) -> None:
        self.run = RunRef()
        self.clock = _clock_from_env()
        self.delegate = os.environ.get(ENV_DELEGATE, DEFAULT_DELEGATE)
        self.failures = Failures("a verl micro-batch")
        self.sampler: AuditSampler | None = None
        self.algorithm: dict[str, Any] | None = None  # verl's algorithm section, sent with every batch
        self.driver_steps = 0  # rollout-correction calls seen by the driver (one per training step)
        self._last_flag: bool | None = None
        self._lock = threading.Lock()

    def boundary(self, last_mini_batch: bool | None) -> bool:
        """True when verl's ``update_lr_scheduler`` flag flips from the last mini-batch back to a first one."""
        with self._lock:
            previous, self._last_flag = self._last_flag, last_mini_batch
        return bool(previous) and last_mini_batch is False

    def record(self, prepare: Callable[[], dict[str, Any]], *, new_step: bool = False) -> None:
        """``run.log_batch(**prepare())`` for one micro-batch the sampler picks; any failure is counted and
        warned about once. The decision reads no tensor (no device sync): an unpicked call costs a counter,
        and ``prepare`` (padding, metric values) runs only for a picked one."""
        try:
            step = self.clock.tick(new_step=new_step)
            run = self.run.get()
            if self.sampler is None:
                self.sampler = AuditSampler.for_run(run)
            position = self.sampler.take(step)
            if position is None:
                return
            run.log_batch(step, micro_batch=position, sampled=True, **prepare())
        except Exception as exc:  # the trainer's loss must never fail because recording did
            self.failures.add(exc)

    def with_algorithm(self, config: dict[str, Any]) -> dict[str, Any]:
        """A batch config plus ``configure(algorithm=...)``'s section, when one was given."""
        return {**config, "algorithm": self.algorithm} if self.algorithm else config


def _clock_from_env() -> StepClock:
    """The step clock the environment asks for; a bad value is warned about and ignored (this runs when
    verl imports the module, where an exception would stop the job)."""
    calls, gap = os.environ.get(ENV_CALLS_PER_STEP), os.environ.get(ENV_STEP_GAP)
    try:
        return StepClock(
            calls_per_step=int(calls) if calls else None,
            gap_s=float(gap) if gap else DEFAULT_STEP_GAP_S,
        )
    except ValueError as exc:
        warnings.warn(
            f"rlvitals: ignoring {ENV_CALLS_PER_STEP}={calls!r} / {ENV_STEP_GAP}={gap!r}: {exc}",
            RecordingError,
            stacklevel=2,
        )
        return StepClock()


_recorder = _Recorder()


def configure(
    run: Any = None,
    *,
    project: str | None = None,
    name: str | None = None,
    delegate: str | None = None,
    step_fn: Any = None,
    calls_per_step: int | None = None,
    gap_s: float | None = None,
    algorithm: Any = None,
) -> None:
    """Set this process's run, the wrapped policy loss and how the step is found (all optional).

    ``algorithm``: verl's ``algorithm`` config section (``adv_estimator``, ``norm_adv_by_std_in_grpo``,
    ``gamma``, ``rollout_correction``), sent with every micro-batch so the server checks the advantages
    and the ``rollout_is_weights`` against it; without it the server reads the run's config.

    Without ``configure`` the recorders start a run from ``RLVITALS_URL``/``RLVITALS_PROJECT``/
    ``RLVITALS_RUN_NAME`` on their first call, which is what verl's Ray workers need.
    """
    global _recorder
    fresh = _Recorder()
    fresh.run = RunRef(run, project=project, name=name)
    if delegate is not None:
        fresh.delegate = delegate
    if algorithm is not None:
        fresh.algorithm = verl_section(algorithm)
    if step_fn is not None or calls_per_step is not None or gap_s is not None:
        fresh.clock = StepClock(
            step_fn=step_fn,
            calls_per_step=calls_per_step,
            gap_s=DEFAULT_STEP_GAP_S if gap_s is None else gap_s,
        )
    _recorder = fresh


def set_step(step: int) -> None:
    """The training step of the loss calls that follow (for trainers that know it in the worker)."""
    _recorder.clock.set(step)


def recording_failures() -> int:
    """How many micro-batches this process failed to record."""
    return _recorder.failures.count


def loss_config(
    config: Any, loss_agg_mode: str | None = None, *, loss_mode: str | None = None
) -> dict[str, Any]:
    """``rlvitals.analyzers.contract.trainers.verl_loss_config`` (the one verl actor -> ``LossConfig``
    mapping), with this process's delegate standing in for a config that selects ``rlvitals``."""
    return verl_loss_config(config, loss_agg_mode, loss_mode=loss_mode, delegate=_recorder.delegate)


# --------------------------------------------------------------------------- (a) registered policy loss


def policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights=None,
):
    """verl's policy-loss signature; delegates, records, returns ``(pg_loss, pg_metrics)`` unchanged.

    Tensors are ``(batch, response_len)``; ``pg_loss`` is a scalar tensor.
    """
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    recorder = _recorder
    delegate = get_policy_loss_fn(recorder.delegate)
    pg_loss, pg_metrics = delegate(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    if not _inside_ppo_loss.get() and getattr(log_prob, "requires_grad", False):

        def prepare() -> dict[str, Any]:  # only for a sampled call: scalars() may read device values
            reported = {**scalars(pg_metrics), "actor/pg_loss": pg_loss.detach()}
            return {
                "log_prob": log_prob.detach(),
                "old_log_prob": old_log_prob,
                "advantages": advantages,
                "response_mask": response_mask,
                "rollout_is_weights": rollout_is_weights,  # the weights verl multiplied the loss by
                # the policy loss alone: verl adds the KL and entropy terms outside it (ppo_loss)
                "config": recorder.with_algorithm(
                    {
                        **loss_config(config, loss_agg_mode, loss_mode=recorder.delegate),
                        "use_kl_loss": False,
                        "entropy_coeff": 0.0,
                    }
                ),
                "reported": reported,
            }

        recorder.record(prepare=prepare)
    return pg_loss, pg_metrics


def register(name: str = LOSS_MODE) -> None:
    """Register ``policy_loss`` in verl's registry under ``name`` (done on import when verl is present)."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    register_policy_loss(name)(policy_loss)


# --------------------------------------------------------------------------- (b) recording ppo_loss


def ppo_loss(config: Any, model_output: Mapping[str, Any], data: Any, dp_group: Any = None):
    """``verl.workers.utils.losses.ppo_loss`` plus recording; returns its ``(loss, metrics)`` unchanged.

    ``model_output["log_probs"]`` (and ``"entropy"``) are verl's no-padding nested tensors; the recorded
    tensors are the padded ``(batch, response_len)`` views verl's own loss computes on.
    """
    from verl.workers.utils import losses

    token = _inside_ppo_loss.set(True)
    try:
        loss, metrics = losses.ppo_loss(
            config=config, model_output=model_output, data=data, dp_group=dp_group
        )
    finally:
        _inside_ppo_loss.reset(token)
    _record_loss_call(config, model_output, data, loss, metrics)
    return loss, metrics


def _record_loss_call(config, model_output, data, loss, metrics, distillation: Any = None) -> None:
    """Record one ``ppo_loss`` / ``distillation_ppo_loss`` call (training passes only)."""
    if not getattr(model_output["log_probs"], "requires_grad", False):
        return
    recorder = _recorder
    explicit = _non_tensor(data, "global_steps")
    if explicit is not None:
        recorder.clock.set(int(explicit))
    new_step = recorder.boundary(_non_tensor(data, "update_lr_scheduler"))

    def prepare() -> dict[str, Any]:  # only for a sampled call: scalars() may read device values
        reported = {**scalars(metrics), "policy_loss": loss.detach()}
        batch = _padded_batch(model_output, data, config_get(config, "rollout_n"))
        batch_config = recorder.with_algorithm(loss_config(config))
        if distillation is not None:
            settings = verl_distillation_section(distillation)
            if settings.get("loss_mode") in _ESTIMATOR_MODES and _has(data, "teacher_logprobs"):
                batch["teacher_log_probs"] = _teacher_log_probs(data)
                batch_config["distillation"] = {"enabled": True, "distillation_loss": settings}
            else:  # forward_kl_topk: needs the student's logits; the total and distillation/* go unaudited
                reported = {
                    k: v
                    for k, v in reported.items()
                    if k != "policy_loss" and not k.startswith("distillation/")
                }
        return {**batch, "config": batch_config, "reported": reported}

    recorder.record(new_step=new_step, prepare=prepare)


# ------------------------------------------------------------------- (b') recording distillation_ppo_loss


def distillation_ppo_loss(
    config: Any,
    distillation_config: Any,
    model_output: Mapping[str, Any] | None = None,
    data: Any = None,
    dp_group: Any = None,
    student_logits: Any = None,
    data_format: str = "thd",
):
    """``verl.trainer.distillation.distillation_ppo_loss`` plus recording; returns what it returns.

    The logits-processor call (``student_logits`` given: verl's top-k loss) passes straight through. Bind it
    with ``actor.set_loss_fn(functools.partial(distillation_ppo_loss, config=actor_config,
    distillation_config=distillation_config))``, as verl's worker binds its own.
    """
    from verl.trainer.distillation import losses as distillation_losses

    if student_logits is not None:
        return distillation_losses.distillation_ppo_loss(
            config, distillation_config, model_output, data, dp_group, student_logits, data_format
        )
    token = _inside_ppo_loss.set(True)
    try:
        loss, metrics = distillation_losses.distillation_ppo_loss(
            config, distillation_config, model_output=model_output, data=data, dp_group=dp_group,
            data_format=data_format,
        )  # fmt: skip
    finally:
        _inside_ppo_loss.reset(token)
    _record_loss_call(config, model_output, data, loss, metrics, distillation=distillation_config)
    return loss, metrics


def _teacher_log_probs(data: Any):
    """The teacher's log-probs of the sampled response tokens, ``(batch, response_len)``, as verl's
    reverse-KL estimator loss reads them (``no_padding_2_padding(...).squeeze(-1)``)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(data["teacher_logprobs"], data).squeeze(-1).detach()


# ---------------------------------------------------------------- (d) driver-side rollout correction


def compute_rollout_correction_and_add_to_batch(batch: Any, rollout_corr_config: Any):
    """verl's ``compute_rollout_correction_and_add_to_batch`` plus recording; returns its
    ``(batch, metrics)`` unchanged.

    On a step the run's ``batch_every`` picks, the whole batch is sent (the ``rollout_corr/*`` values are
    verl's numbers for all of it): ``old_log_probs`` (also as ``log_prob``: on the driver the actor is
    still pi_old), ``rollout_log_probs``, the ``response_mask`` before rejection, the
    ``rollout_is_weights`` verl added, and ``rollout_corr/*`` as ``reported``, with the config as
    ``algorithm.rollout_correction``. Advantages do not exist yet at this point of verl's step: zeros are
    sent, and no loss metric is reported with them. The step is ``batch.meta_info["global_steps"]`` when
    verl put it there, else this call's count. A failure to record is counted, never raised.
    """
    from verl.trainer.ppo import rollout_corr_helper

    verl_fn = getattr(rollout_corr_helper, "_rlvitals_original", None) or (
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    )
    mask_before = batch.batch["response_mask"]  # verl assigns a new mask tensor, this one stays as it was
    batch, metrics = verl_fn(batch, rollout_corr_config)
    recorder = _recorder
    try:
        recorder.driver_steps += 1
        step = (
            plain_scalar((getattr(batch, "meta_info", None) or {}).get("global_steps"))
            or recorder.driver_steps
        )
        run = recorder.run.get()
        every = getattr(getattr(run, "settings", None), "batch_every", 1) or 1
        if int(step) % int(every) == 0:
            old = batch.batch["old_log_probs"]
            keys = set(batch.batch.keys())
            weights = batch.batch["rollout_is_weights"] if "rollout_is_weights" in keys else None
            run.log_batch(
                int(step),
                log_prob=old,
                old_log_prob=old,
                advantages=old.new_zeros(old.shape),
                response_mask=mask_before.bool(),
                rollout_log_probs=batch.batch["rollout_log_probs"],
                rollout_is_weights=weights,
                config={"algorithm": {"rollout_correction": verl_policy_loss_section(rollout_corr_config)}},
                reported=scalars(metrics),
                sampled=True,
            )
    except Exception as exc:  # the trainer's step must never fail because recording did
        recorder.failures.add(exc)
    return batch, metrics


def install_rollout_correction() -> None:
    """Point ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` (which
    ``RayPPOTrainer.fit`` imports at every step) at :func:`compute_rollout_correction_and_add_to_batch`."""
    from verl.trainer.ppo import rollout_corr_helper

    if getattr(rollout_corr_helper, "_rlvitals_original", None) is None:
        rollout_corr_helper._rlvitals_original = (
            rollout_corr_helper.compute_rollout_correction_and_add_to_batch
        )
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch = (
            compute_rollout_correction_and_add_to_batch
        )


def uninstall_rollout_correction() -> None:
    """Undo :func:`install_rollout_correction`."""
    from verl.trainer.ppo import rollout_corr_helper

    original = getattr(rollout_corr_helper, "_rlvitals_original", None)
    if original is not None:
        rollout_corr_helper.compute_rollout_correction_and_add_to_batch = original
        rollout_corr_helper._rlvitals_original = None


def _has(data: Any, key: str) -> bool:
    try:
        return key in data.keys()  # noqa: SIM118 - TensorDict needs .keys()
    except (TypeError, AttributeError, RuntimeError):
        return False


def _non_tensor(data: Any, key: str) -> Any:
    """A non-tensor entry of verl's micro-batch ``TensorDict`` (``data[key]`` gives the python value)."""
    try:
        return data[key] if key in data.keys() else None  # noqa: SIM118 - TensorDict needs .keys()
    except (KeyError, TypeError, RuntimeError):
        return None


_BATCH_NAMES = {  # verl's TensorDict keys -> log_batch keywords
    "response_mask": "response_mask",
    "old_log_probs": "old_log_prob",
    "advantages": "advantages",
    "ref_log_prob": "ref_log_prob",
    "token_level_rewards": "token_level_rewards",
    "rollout_log_probs": "rollout_log_probs",  # the inference engine's, when the rollout computed them
    "rollout_is_weights": "rollout_is_weights",  # verl's rollout correction: the loss is weighted by them
}


def _padded_batch(model_output: Mapping[str, Any], data: Any, rollout_n: Any = None) -> dict[str, Any]:
    """The ``(batch, response_len)`` tensors ``ppo_loss`` computed on, as ``log_batch`` keywords.

    Same conversions as verl's ``ppo_loss``: ``no_padding_2_padding`` for the model outputs, zero-padded
    ``to_padded_tensor`` for nested data fields, ``response_mask`` as bool. ``uid`` becomes
    ``group_index`` only when the micro-batch holds whole groups (each uid ``rollout_n`` times): verl's
    shuffled mini-batches, sequence balancing and micro-batch split cut GRPO groups apart, and a group
    advantage recomputed from part of a group is not the one verl computed from all of it.
    """
    from verl.workers.utils.padding import no_padding_2_padding

    batch: dict[str, Any] = {"log_prob": no_padding_2_padding(model_output["log_probs"], data).detach()}
    entropy = model_output.get("entropy")
    if entropy is not None:
        batch["entropy"] = no_padding_2_padding(entropy, data).detach()
    keys = set(data.keys())
    for key, name in _BATCH_NAMES.items():
        if key in keys:
            value = data[key]
            batch[name] = value.to_padded_tensor(0.0) if getattr(value, "is_nested", False) else value
    batch["response_mask"] = batch["response_mask"].bool()
    uid = _uids(data, keys)
    if uid is not None and len(uid) == batch["log_prob"].shape[0] and _whole_groups(uid, rollout_n):
        batch["group_index"] = uid
    return batch


def _whole_groups(uid: list[str], rollout_n: Any) -> bool:
    if not isinstance(rollout_n, int) or isinstance(rollout_n, bool) or rollout_n < 1:
        return False
    return all(count == rollout_n for count in Counter(uid).values())


def _uids(data: Any, keys: set) -> list[str] | None:
    if "uid" not in keys:
        return None
    try:
        values = data["uid"]
        values = values.tolist() if hasattr(values, "tolist") else list(values)
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return None
    return [str(v) for v in values]


# --------------------------------------------------------------------------- (c) scalars: file logger tail


def read_verl_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, float | int]]]:
    """``(step, numeric metrics)`` for every line of a verl ``file`` logger JSONL.

    A line is ``{"step": int, "data": {name: value}}``, or the metrics written flat beside their step
    (``{"step": int, name: value, ...}``); non-numeric values are left out. A malformed line raises
    ``ValueError`` naming the file and line number.
    """
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if raw.strip():
                yield _parse_line(raw, f"{path}:{number}")


def _parse_line(raw: bytes, where: str) -> tuple[int, dict[str, float | int]]:
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(record, dict) or not ("step" in record and len(record) > 1):
        raise ValueError(f'{where}: expected {{"step": int, "data": {{...}}}}')
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: step must be an int >= 0, got {step!r}")
    data = record.get("data")
    if isinstance(data, dict):
        return step, scalars(data)
    # the metrics dict written flat beside its step (``{"step": N, **metrics}``), as scripts that dump
    # verl's per-step metrics themselves do
    return step, scalars({k: v for k, v in record.items() if k != "step"})


class JsonlTailer:
    """Follow verl's ``file`` logger JSONL into a run, from a separate process or thread.

    ``poll()`` reads the lines completed since the last call (a half-written last line waits for its
    newline) and logs them, starting at byte ``offset``; ``start()`` polls every ``interval`` seconds in a daemon thread until
    ``stop()``. verl opens the file with ``"wb"``, so a file that shrank is read again from the start.
    A malformed line is skipped and counted in ``skipped``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        run: Any = None,
        *,
        interval: float = 1.0,
        offset: int = 0,
    ) -> None:
        path = path or os.environ.get("VERL_FILE_LOGGER_PATH")
        if not path:
            raise ValueError("JsonlTailer needs a path (or VERL_FILE_LOGGER_PATH)")
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.path = Path(path)
        self.run = RunRef(run, name=self.path.stem)
        self.interval = interval
        self.lines = 0
        self.skipped = 0
        self._offset = offset  # bytes already read (e.g. by an import that came before)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def poll(self) -> int:
        """Log every newly completed line; returns how many were logged."""
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                return 0
            if size < self._offset:
                self._offset = 0
            if size == self._offset:
                return 0
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read(size - self._offset)
            end = chunk.rfind(b"\n")
            if end < 0:
                return 0
            self._offset += end + 1
            logged = 0
            for raw in chunk[: end + 1].splitlines():
                if not raw.strip():
                    continue
                try:
                    step, metrics = _parse_line(raw, str(self.path))
                except ValueError:
                    self.skipped += 1
                    continue
                if metrics:
                    self.run.get().log(metrics, step)
                    logged += 1
            self.lines += logged
            return logged

    def start(self) -> JsonlTailer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rlvitals-verl-tail", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def stop(self, timeout: float = 5.0) -> int:
        """Stop following after one last read; returns the total lines logged."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.poll()
        return self.lines

    def follow(self, *, idle_exit_s: float | None = None) -> int:
        """Poll in the foreground until interrupted (or ``idle_exit_s`` without new lines)."""
        idle_since = time.monotonic()
        try:
            while True:
                if self.poll():
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    return self.lines
                time.sleep(self.interval)
        except KeyboardInterrupt:
            return self.lines


class TrainingHalted(RuntimeError):
    """Raised out of verl's trainer loop at a step boundary: the run reported a critical incident it opted
    to halt on. ``incident``: the server's short form (id, number, cause, title, primary_rule, onset_step)."""

    def __init__(self, incident: Mapping[str, Any]) -> None:
        self.incident = dict(incident)
        super().__init__(
            f"rlvitals halted training: critical incident id {incident.get('id')} "
            f"(cause {incident.get('cause')}, primary rule {incident.get('primary_rule')}, "
            f"since step {incident.get('onset_step')})"
        )


class VerlTrackingLogger:
    """A verl tracking backend: ``log(data, step)`` sends the numeric entries, ``finish()`` finishes the run.

    ``Tracking(...).logger["rlvitals"] = VerlTrackingLogger(project, experiment, config)`` adds it to
    verl's own tracker; ``config`` (an OmegaConf config or dict) becomes the run's config. With
    ``halt_on=`` (``("critical",)``, or causes / rules), ``log`` raises :class:`TrainingHalted` at the
    first step boundary after the server reports such a critical incident: verl's ``fit`` loop logs each
    step's metrics at its end, so the exception leaves it between two steps (see :func:`fit`).
    """

    def __init__(
        self,
        project_name: str | None = None,
        experiment_name: str | None = None,
        config: Any = None,
        *,
        run: Any = None,
        halt_on: tuple[str, ...] | str | None = None,
    ) -> None:
        options = {"halt_on": halt_on} if halt_on else None
        self._run = RunRef(
            run, project=project_name, name=experiment_name, config=_container(config), options=options
        )

    def log(self, data: Mapping[str, Any], step: int) -> None:
        metrics = scalars(data)
        if metrics:
            run = self._run.get()
            run.log(metrics, step)
            halted = _halted(run)
            if halted is not None:
                raise TrainingHalted(halted)

    def finish(self, exit_code: int = 0) -> None:
        if self._run.started:
            self._run.get().finish()


def _halted(run: Any) -> dict[str, Any] | None:
    try:
        return run.halt_reason if run.should_stop() else None
    except Exception:  # the client never crashes the trainer
        return None


def fit(trainer: Any, *, save_checkpoint: bool = True) -> dict[str, Any] | None:
    """``trainer.fit()`` (a verl ``RayPPOTrainer``) that stops cleanly on :class:`TrainingHalted`: saves a
    checkpoint first when ``save_checkpoint`` (``trainer._save_checkpoint()``, verl's own), then returns the
    incident that stopped it (``None`` when training ran to its end)."""
    try:
        trainer.fit()
    except TrainingHalted as halted:
        if save_checkpoint and hasattr(trainer, "_save_checkpoint"):
            trainer._save_checkpoint()
        return halted.incident
    return None


def _container(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    return dict(config)


# Registered on import when verl is present (VERL_USE_EXTERNAL_MODULES imports this module in every
# worker); without verl this module still imports and ``register()`` can be called later.
with contextlib.suppress(ImportError):
    register()
