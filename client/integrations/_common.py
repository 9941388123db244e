"""Plumbing the integrations share: finding the run, turning framework metrics into plain scalars, and a
step clock for loss functions that are never told the training step.

Nothing here imports a training framework.
"""

from __future__ import annotations

import numbers
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

ENV_PROJECT = "RLVITALS_PROJECT"
ENV_RUN_NAME = "RLVITALS_RUN_NAME"
DEFAULT_STEP_GAP_S = 5.0  # a pause this long between loss calls means a rollout happened: a new step


class RunRef:
    """A run passed in explicitly, or started from the environment on first use (once per process).

    ``rlvitals.init`` resumes the run of the same (project, name), so every rank and worker process of a
    job that shares ``RLVITALS_PROJECT``/``RLVITALS_RUN_NAME`` lands in one run.
    """

    def __init__(
        self,
        run: Any = None,
        *,
        project: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """``options``: further ``rlvitals.init`` keywords for a run started here (``batch_every``, ...)."""
        if run is not None and not (hasattr(run, "log") and hasattr(run, "log_batch")):
            raise TypeError(f"run must be an rlvitals Run (with log and log_batch), got {type(run).__name__}")
        self._run = run
        self.project = project
        self.name = name
        self.config = dict(config) if config else None
        self.options = dict(options) if options else {}
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._run is not None

    @property
    def current(self) -> Any:
        """The run if it was given or started, else None (never starts one)."""
        return self._run

    def get(self, config: Mapping[str, Any] | None = None) -> Any:
        """The run, starting it from the environment if none was given (``config`` goes to ``init``)."""
        if self._run is not None:  # the client's Run carries itself across fork()
            return self._run
        with self._lock:
            if self._run is None:
                import rlvitals.client as client

                merged = {**(self.config or {}), **(dict(config) if config else {})}
                self._run = client.init(
                    project=self.project or os.environ.get(ENV_PROJECT, "default"),
                    name=self.name or os.environ.get(ENV_RUN_NAME),
                    config=merged or None,
                    **self.options,
                )
            return self._run


class RecordingError(RuntimeWarning):
    """A loss call could not be recorded; training went on (the message says why)."""


class Failures:
    """Recording failures of one integration: counted, warned about once, never raised to the trainer."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._warned = False

    def add(self, exc: BaseException) -> None:
        self.count += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"rlvitals: recording {self.what} failed: {type(exc).__name__}: {exc}; "
                "training continues, further failures are counted silently",
                RecordingError,
                stacklevel=3,
            )


class AuditSampler:
    """Which loss calls of a training job are captured for the audit: one every ``every`` steps, rotating
    through the positions of the update cycle so that the audits see clipping.

    The *update cycle* is the run of loss calls that reuse one rollout. Only its first position sees
    ``old_log_prob == log_prob`` (ratio 1, every clip metric 0); the later ones are where clipping,
    dual-clip and the KL drift show up:

    - verl / OpenRLHF: every micro-batch of every mini-batch of every PPO epoch after one rollout, all in
      one training step (position = the call's index in the step; the sampler counts it itself);
    - TRL: ``steps_per_generation x num_iterations`` micro-batches after one generation, spanning
      ``steps_per_generation x num_iterations / gradient_accumulation_steps`` optimizer steps (position =
      ``trainer._step % (steps_per_generation * num_iterations)``, given by the caller).

    Policy (deterministic, so every rank captures the same positions):

    1. at each step ``s`` with ``s % every == 0`` the sampler arms;
    2. armed, it captures the first call whose position equals the target, then disarms until the next
       multiple of ``every`` after the step it captured in;
    3. the ``n``-th capture targets position ``n mod L``, ``L`` the cycle length: given (``cycle=``), or
       learned as the most positions seen in one cycle so far (so a target is always reachable).

    Over ``L`` audits every position of the cycle is audited once, the on-policy first one included.
    ``all_calls=True`` (the run's ``batch_micro_batches="all"``) captures every call of an armed step
    instead. A decision is integer arithmetic on counters: no tensor is read, no device is synchronised.
    """

    def __init__(self, every: int = 10, *, cycle: int | None = None, all_calls: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if cycle is not None and (isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 1):
            raise ValueError(f"cycle must be None or an int >= 1, got {cycle!r}")
        self.every = every
        self.cycle = cycle
        self.all_calls = all_calls
        self.captures = 0
        self._learned = 1
        self._due = every  # the first step that arms the sampler
        self._armed_step: int | None = None
        self._step: int | None = None
        self._calls = 0
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run: Any, *, cycle: int | None = None) -> AuditSampler:
        """A sampler following ``run.settings`` (``batch_every``, ``batch_micro_batches``)."""
        settings = getattr(run, "settings", None)
        every = getattr(settings, "batch_every", 10)
        every = every if isinstance(every, int) and not isinstance(every, bool) and every >= 1 else 1
        return cls(every, cycle=cycle, all_calls=getattr(settings, "batch_micro_batches", "first") == "all")

    @property
    def cycle_length(self) -> int:
        return self.cycle if self.cycle is not None else self._learned

    @property
    def target(self) -> int:
        """The position the next capture waits for."""
        return self.captures % self.cycle_length

    def take(self, step: int, position: int | None = None) -> int | None:
        """Decide for one loss call at training ``step``: the position to label the capture with, or None.

        ``position`` is the call's place in the update cycle; None means "count the calls of each step"
        (verl, OpenRLHF: one step is one cycle).
        """
        with self._lock:
            if step != self._step:
                self._step, self._calls = step, 0
            else:
                self._calls += 1
            if position is None:
                position = self._calls
            if self.cycle is not None:
                position %= self.cycle
            self._learned = max(self._learned, position + 1)
            if self.all_calls:
                return position if step % self.every == 0 else None
            if self._armed_step is None and step >= self._due:
                self._armed_step = step  # normally at the multiple itself; later after a resumed run's jump
            if self._armed_step is None or position != self.target:
                return None
            self.captures += 1
            self._armed_step = None
            self._due = (step // self.every + 1) * self.every
            return position


def wants_batch(run: Any, step: int) -> bool:
    """Whether ``run`` may keep a tensor batch logged at ``step`` (lets callers skip costly preparation).

    Uses the run's ``wants_batch(step)`` when it has one, else its ``settings.batch_every``.
    """
    probe = getattr(run, "wants_batch", None)
    if probe is not None:
        return bool(probe(step))
    every = getattr(getattr(run, "settings", None), "batch_every", None)
    return not isinstance(every, int) or every < 1 or step % every == 0


def as_scalar(value: Any) -> float | int | None:
    """A number as a python float/int, or ``None`` when ``value`` is not a single number.

    Accepts python and numpy numbers, one-element torch tensors and numpy arrays, and verl's ``Metric``
    (its ``aggregate()``). NaN and Inf are kept.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and hasattr(value, "shape"):  # torch.Tensor / numpy array
        size = value.numel() if hasattr(value, "numel") else value.size
        return as_scalar(value.item()) if size == 1 else None
    aggregate = getattr(value, "aggregate", None)  # verl's Metric: values of one call, aggregated
    if callable(aggregate) and hasattr(value, "values"):
        try:
            return as_scalar(aggregate())
        except (ValueError, TypeError):
            return None
    return None


def scalars(metrics: Mapping[str, Any], *, strip_prefix: str | None = None) -> dict[str, float | int]:
    """The numeric entries of ``metrics`` (strings, lists and other values are left out)."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        number = as_scalar(value)
        if number is None:
            continue
        name = str(key)
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        out[name] = number
    return out


class StepClock:
    """The training step seen by a loss function that is not told it.

    In order of precedence:

    1. ``set(step)`` (or a ``step_fn`` returning an int): the trainer says which step it is;
    2. ``calls_per_step``: every that many loss calls make one step;
    3. a hint from the caller (``tick(new_step=True)``), e.g. verl's last-mini-batch flag flipping back;
    4. a pause of more than ``gap_s`` seconds between two calls: the rollout of the next batch happened.

    Steps counted by 2–4 start at ``start`` (verl's ``trainer.global_steps`` starts at 1).
    """

    def __init__(
        self,
        *,
        step_fn: Callable[[], int | None] | None = None,
        calls_per_step: int | None = None,
        gap_s: float = DEFAULT_STEP_GAP_S,
        start: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if calls_per_step is not None and (not isinstance(calls_per_step, int) or calls_per_step < 1):
            raise ValueError(f"calls_per_step must be an int >= 1, got {calls_per_step!r}")
        if gap_s <= 0:
            raise ValueError(f"gap_s must be > 0, got {gap_s}")
        self.step_fn = step_fn
        self.calls_per_step = calls_per_step
        self.gap_s = gap_s
        self.start = start
        self._clock = clock
        self._explicit: int | None = None
        self._counted = start - 1
        self._calls = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    def set(self, step: int) -> None:
        """The trainer's own step; every following call belongs to it until the next ``set``."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        with self._lock:
            self._explicit = int(step)

    def tick(self, *, new_step: bool = False) -> int:
        """Record one loss call and return its step."""
        with self._lock:
            now = self._clock()
            gap = None if self._last is None else now - self._last
            self._last = now
            self._calls += 1
            if self.step_fn is not None:
                step = self.step_fn()
                if step is not None:
                    return int(step)
            if self._explicit is not None:
                return self._explicit
            if self.calls_per_step is not None:
                return self.start + (self._calls - 1) // self.calls_per_step
            if self._calls == 1 or new_step or (gap is not None and gap > self.gap_s):
                self._counted += 1
            return self._counted
