"""``rlvitals.init`` / ``Run``: the object a trainer holds. The caller's side only validates and enqueues.

``run.log(metrics, step)`` checks its arguments (misuse raises ``TypeError``/``ValueError`` at once,
``RuntimeError`` after ``finish()``; a step lower than the last one warns once) and
appends one tuple to a ``collections.deque`` — no lock, no I/O, no encoding; the pump thread does the rest
(see ``sender.py``). ``run.log_batch(...)`` decides sampling first (a skipped call costs a few µs), then
copies the tensors off the device without waiting for it (see ``capture.py``).

Lifecycle: ``OPEN`` → ``FINISHING`` → ``FINISHED``. Fork: the child gets fresh locks, queue, spool files
and threads (``os.register_at_fork``); records the parent queued stay the parent's to send.
Ranks: the rank comes from ``torch.distributed`` if initialised, else ``RANK`` / ``LOCAL_RANK``; by default
only rank 0 sends scalars and every rank sends its sampled audit batches (rank is in their metadata).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from rlvitals.analyzers.contract import batch_rules as rules
from rlvitals.client.capture import capture
from rlvitals.client.problems import Problems
from rlvitals.client.sender import Stats, Worker
from rlvitals.client.settings import DEFAULT_FINISH_TIMEOUT, DEFAULT_URL, ClientSettings, default_spool_dir
from rlvitals.client.spool import RunInfo, Spool
from rlvitals.client.transport import HttpApi, RejectedError, RetryableError
from rlvitals.client.values import check_metrics, check_step, copy_device_scalars

_log = logging.getLogger("rlvitals")

MODES = ("online", "offline")


class Lifecycle(str, Enum):
    OPEN = "open"
    FINISHING = "finishing"
    FINISHED = "finished"


@dataclass(frozen=True)
class FinishReport:
    """What happened to everything this process logged. ``complete`` is True when nothing is pending or lost.

    ``points_pending`` / ``batches_pending`` sit in ``spool_dir`` (resend with ``rlvitals sync``);
    ``points_dropped`` could not be kept anywhere (memory and disk full); ``points_rejected`` were refused
    by the server with a 4xx that resending cannot fix.
    """

    run_id: str | None
    mode: str
    points_logged: int
    points_sent: int
    points_pending: int
    points_dropped: int
    points_rejected: int
    batches_logged: int
    batches_sent: int
    batches_pending: int
    batches_dropped: int
    batches_rejected: int
    batches_skipped: int
    spool_dir: str
    problems: tuple[str, ...] = field(default=())

    @property
    def complete(self) -> bool:
        lost = self.points_dropped + self.points_rejected + self.batches_dropped + self.batches_rejected
        return self.points_pending == 0 and self.batches_pending == 0 and lost == 0

    def __str__(self) -> str:
        text = (
            f"rlvitals: {self.points_sent}/{self.points_logged} points and "
            f"{self.batches_sent}/{self.batches_logged} tensor batches delivered"
        )
        if self.points_pending or self.batches_pending:
            text += (
                f"; {self.points_pending} points and {self.batches_pending} batches pending in "
                f"{self.spool_dir} (resend: rlvitals sync {self.spool_dir})"
            )
        if self.points_dropped or self.batches_dropped:
            text += f"; dropped {self.points_dropped} points and {self.batches_dropped} batches (spool/memory full)"
        if self.points_rejected or self.batches_rejected:
            text += f"; server rejected {self.points_rejected} points and {self.batches_rejected} batches"
        return text


def detect_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # a half-initialised process group: fall back to the environment
            pass
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


def agree_across_ranks(stop: bool, incident_id: int = 0) -> tuple[bool, int]:
    """``(stop, incident_id)`` agreed by every process of the job: stop if any rank says so, with the
    largest incident id any rank knows. One 2-element all-reduce under an initialised
    ``torch.distributed`` process group of several processes (every rank must call it at the same step
    boundary, as it must every collective); otherwise the arguments unchanged, and torch is never
    imported here (the client stays light)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return stop, incident_id
    import torch

    backend = str(dist.get_backend()).lower()
    # NCCL reduces CUDA tensors only; gloo (and a "cpu:gloo,cuda:nccl" group) reduces CPU tensors
    on_gpu = "gloo" not in backend and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flags = torch.tensor([int(bool(stop)), int(incident_id)], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item()), int(flags[1].item())


def _default_name() -> str:
    # torchrun gives every rank the same TORCHELASTIC_RUN_ID: the ranks of one job share a run.
    shared = os.environ.get("RLVITALS_RUN_NAME") or os.environ.get("TORCHELASTIC_RUN_ID")
    if shared and shared != "none":
        return shared
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


_LIVE: weakref.WeakSet[Run] = weakref.WeakSet()


class Run:
    """One training run as seen from one process. Create with ``rlvitals.init(...)``."""

    def __init__(
        self,
        *,
        url: str | None = None,
        project: str = "default",
        name: str | None = None,
        config: dict | None = None,
        api_key: str | None = None,
        mode: str = "online",
        tags: list[str] | tuple[str, ...] = (),
        settings: ClientSettings | None = None,
        spool_dir: str | os.PathLike | None = None,
        transport: Any = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(project, str) or not project:
            raise TypeError(f"project must be a non-empty str, got {project!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty str or None, got {name!r}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        if settings is not None and not isinstance(settings, ClientSettings):
            raise TypeError(f"settings must be a ClientSettings, got {type(settings).__name__}")
        self.settings = settings or ClientSettings()
        self.mode = mode
        self.project = project
        self.name = name or _default_name()
        self.config = dict(config or {})
        self.tags = [str(tag) for tag in tags]
        self.url = (url or os.environ.get("RLVITALS_URL") or DEFAULT_URL).rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        self._api_key = api_key if api_key is not None else os.environ.get("RLVITALS_API_KEY")
        self._transport = transport
        self.spool_root = Path(spool_dir).expanduser() if spool_dir is not None else default_spool_dir()
        self.rank = detect_rank()
        self._send_scalars = self.rank == 0 or self.settings.scalars_all_ranks
        self._send_batches = self.rank == 0 or self.settings.batches_all_ranks
        self.id: str | None = None
        self._spool = Spool(
            self.spool_root,
            RunInfo(self.project, self.name, self.config, self.tags),
            segment_records=self.settings.max_steps_per_request,
            max_bytes=self.settings.max_spool_bytes,
        )
        self._fresh_process_state()
        interval = self.settings.gil_switch_interval
        if interval is not None and sys.getswitchinterval() > interval:
            sys.setswitchinterval(interval)
        if mode == "online":
            self._connect()
        self._start_worker()
        _LIVE.add(self)

    # -- process-local state ------------------------------------------------------------------
    def _fresh_process_state(self) -> None:
        self.state = Lifecycle.OPEN
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._problems = Problems()
        self._stats = Stats()
        self._worker: Worker | None = None
        self._batch_step: int | None = None
        self._last_step = -1
        self._micro_batch = 0
        self._batches_skipped = 0
        self._finish_lock = threading.Lock()
        self._report: FinishReport | None = None
        self._halt: dict | None = None
        self._halt_logged = 0  # steps logged with halt_on: should_stop() waits for their answer
        self._pid = os.getpid()

    def _new_api(self) -> HttpApi:
        return HttpApi(
            self.url,
            api_key=self._api_key,
            timeout=self.settings.timeout,
            connect_timeout=self.settings.connect_timeout,
            transport=self._transport,
            wait_rules=bool(self.settings.halt_on),
        )

    def _connect(self) -> None:
        """Create or resume the run, waiting at most ``init_timeout``; on failure the sender keeps trying."""
        if self.settings.init_timeout <= 0:
            return
        api = self._new_api()
        try:
            self.id = api.create_run(
                project=self.project,
                name=self.name,
                config=self.config,
                tags=self.tags,
                timeout=self.settings.init_timeout,
            )
        except (RetryableError, RejectedError) as exc:
            self._problems.report(
                "unreachable",
                exc.operation,
                exc.cause,
                f"spooling to {self._spool.directory}; will retry in the background",
            )
        finally:
            api.close()

    def _start_worker(self) -> None:
        self._worker = Worker(
            queue=self._queue,
            wake=self._wake,
            spool=self._spool,
            settings=self.settings,
            problems=self._problems,
            stats=self._stats,
            api=self._new_api() if self.mode == "online" else None,
            run_id=self.id,
            online=self.mode == "online",
        )
        self._worker.start()

    def _after_fork_in_child(self) -> None:
        if self.state is Lifecycle.FINISHED:
            return
        self._fresh_process_state()
        self._spool.reset_owner()
        self.rank = detect_rank()
        self._worker = None  # started on first use: threads do not survive fork

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._start_worker()

    # -- the trainer's API --------------------------------------------------------------------
    def log(self, metrics: dict, step: int) -> None:
        """Record scalars for ``step``. Only enqueues (a few µs); NaN/Inf are kept; misuse raises at once."""
        if self.state is not Lifecycle.OPEN:
            raise RuntimeError(f"run {self.name!r} is {self.state.value}; log() needs an open run")
        step = check_step(step)
        if step < self._last_step:
            self._step_went_back(step)
        else:
            self._last_step = step
        values, deferred = check_metrics(metrics)
        if not self._send_scalars:
            return
        device = copy_device_scalars(deferred) if deferred else None
        self._queue.append((step, values, time.time(), device))
        if self._worker is None:
            self._ensure_worker()
        if self.settings.halt_on:
            self._halt_logged += 1
            self._wake.set()  # send now: the answer says whether a critical incident opened

    def should_stop(self, *, all_ranks: bool = True) -> bool:
        """True once the server reported an open critical incident this run opted to halt on
        (``ClientSettings.halt_on``; default: never). Reads what the last metrics write answered: no
        request, never raises. The first time, it logs the incident's id, cause and primary rule
        (logger ``rlvitals``); ``halt_reason`` keeps it.

        Under ``torch.distributed`` with several processes (and ``halt_on`` set), every rank gets the
        same answer at the same step boundary (:func:`agree_across_ranks`): only the rank that sends
        scalars hears of incidents, and ranks that stopped apart would hang the next collective. So
        call it on every rank, at the same point of the loop; ``all_ranks=False`` answers for this
        process alone (then agree across ranks yourself)."""
        stop = self._should_stop_here()
        if not (all_ranks and self.settings.halt_on):
            return stop
        try:
            agreed, incident_id = agree_across_ranks(stop, int((self._halt or {}).get("id") or 0))
        except Exception as exc:  # a broken process group: this process's own answer, said once
            self._problems.warn("halt_ranks", f"rlvitals: could not agree on stopping across ranks: {exc!r}")
            return stop
        if agreed and self._halt is None:
            self._halt = {"id": incident_id or None, "from_another_rank": True}
            _log.warning(
                "rlvitals: stopping run %r at the step boundary: another rank's run reported critical "
                "incident id %s",
                self.name,
                incident_id or "?",
            )
        return agreed

    def _should_stop_here(self) -> bool:
        if self._halt is not None:
            return True
        worker = self._worker
        if not self.settings.halt_on or worker is None:
            return False
        # the answer to the steps logged so far, waited for at most halt_wait seconds: a sender running
        # behind (a loaded machine) would otherwise stop the run steps after its critical incident
        deadline = time.monotonic() + self.settings.halt_wait
        while worker.answered < self._halt_logged and worker.healthy and not worker.critical:
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # not answered in time (spooled, slow): wait only for newer steps next time
                self._halt_logged = worker.answered
                break
            worker.answer.clear()
            if worker.answered >= self._halt_logged:
                break
            worker.answer.wait(min(remaining, 0.05))
        for incident in worker.critical:
            if self.settings.halts_on(incident):
                self._halt = incident
                _log.warning(
                    "rlvitals: stopping run %r at the step boundary: critical incident id %s (#%s of the run) "
                    "cause %s, primary rule %s, since step %s: %s",
                    self.name,
                    incident.get("id"),
                    incident.get("number"),
                    incident.get("cause"),
                    incident.get("primary_rule"),
                    incident.get("onset_step"),
                    incident.get("message", ""),
                )
                return True
        return False

    @property
    def halt_reason(self) -> dict | None:
        """The critical incident that made ``should_stop()`` true (server's short form), else None."""
        return self._halt

    def _step_went_back(self, step: int) -> None:
        # Accepted, not refused: a resumed run re-logs steps and a late eval metric may name an older
        # step. But the server keeps the first value of each (step, metric), so say so, once.
        self._problems.warn(
            "step_backwards",
            f"rlvitals: log() got step {step} after step {self._last_step}; steps should only grow. "
            "Sending it anyway: a metric not yet stored at that step is kept, one already stored keeps "
            "its first value (resumed from a checkpoint? start a new run or log from the next step)",
        )

    def log_batch(
        self,
        step: int,
        *,
        log_prob: Any,
        old_log_prob: Any,
        advantages: Any,
        response_mask: Any,
        ref_log_prob: Any = None,
        entropy: Any = None,
        token_level_rewards: Any = None,
        group_index: Any = None,
        rollout_log_probs: Any = None,
        rollout_is_weights: Any = None,
        teacher_log_probs: Any = None,
        config: Any = None,
        reported: dict | None = None,
        micro_batch: int | None = None,
        sampled: bool | None = None,
    ) -> bool:
        """Capture the tensors one loss call saw (``(batch, response_len)``; ``group_index`` ``(batch,)``)
        and the metrics it reported from them, for the server's audit. Returns True if this call was
        sampled (``batch_every`` steps, first micro-batch by default) and queued.

        ``sampled=True``: the caller already decided to capture this call (an integration's
        ``AuditSampler``); the run then keeps it whatever the step (still only on ranks that send batches).

        ``rollout_log_probs`` are the rollout engine's (vLLM/SGLang) log-probs of the sampled tokens, verl's
        ``rollout_log_probs``: with them the server audits rollout correction (``rollout_corr/*``).
        ``rollout_is_weights`` are the importance weights the loss was multiplied by (verl's name; the
        audit recomputes the weighted loss and compares them with the weights the config gives).
        ``teacher_log_probs`` are an on-policy distillation teacher's log-probs of the sampled tokens
        (verl's ``teacher_logprobs``): with a ``distillation`` config section the server audits the
        ``distillation/*`` metrics.
        """
        if self.state is not Lifecycle.OPEN:
            raise RuntimeError(f"run {self.name!r} is {self.state.value}; log_batch() needs an open run")
        step = check_step(step)
        if reported is not None and not isinstance(reported, dict):
            raise TypeError(f"reported must be a dict of name -> number, got {type(reported).__name__}")
        if step != self._batch_step:
            self._batch_step, self._micro_batch = step, 0
        else:
            self._micro_batch += 1
        index = self._micro_batch if micro_batch is None else micro_batch
        sampled = self._send_batches and (
            bool(sampled)
            if sampled is not None
            else step % self.settings.batch_every == 0
            and (self.settings.batch_micro_batches == "all" or index == 0)
        )
        tensors = {
            "log_prob": log_prob,
            "old_log_prob": old_log_prob,
            "advantages": advantages,
            "response_mask": response_mask,
            "ref_log_prob": ref_log_prob,
            "entropy": entropy,
            "token_level_rewards": token_level_rewards,
            "group_index": group_index,
            "rollout_log_probs": rollout_log_probs,
            "rollout_is_weights": rollout_is_weights,
            "teacher_log_probs": teacher_log_probs,
        }
        if not sampled:
            _cheap_check(tensors)
            self._batches_skipped += 1
            return False
        batch = capture(
            step=step,
            rank=detect_rank(),
            micro_batch=index,
            tensors=tensors,
            config=config,
            reported=reported,
        )
        self._queue.append(batch)
        self._wake.set()
        if self._worker is None:
            self._ensure_worker()
        return True

    def update_config(self, config: dict) -> None:
        """Merge ``config`` into the run's config and send it (resuming the run with a new config replaces
        the stored one, so the server's config-aware health rules see it). For an integration handed a
        run that was started without the trainer's config."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        merged = {**self.config, **config}
        if merged == self.config:
            return
        self.config = merged
        self._spool.set_config(merged)
        if self._worker is not None:
            self._worker.run_id = None  # the sender resumes the run (create-or-resume) with the new config

    def finish(self, timeout: float = DEFAULT_FINISH_TIMEOUT) -> FinishReport:
        """Flush and wait at most ``timeout`` seconds; what is not delivered stays in the spool.

        Returns a ``FinishReport`` (also logged, and warned about when anything is pending or lost).
        Calling it again returns the same report.
        """
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
        with self._finish_lock:
            if self._report is not None:
                return self._report
            self.state = Lifecycle.FINISHING
            if self._worker is not None:
                self._worker.close(timeout)
            self._report = self._make_report()
            self.state = Lifecycle.FINISHED
        _LIVE.discard(self)
        if not self._report.complete:
            self._problems.warn("finish", str(self._report))
        return self._report

    def _make_report(self) -> FinishReport:
        spool = self._spool
        pending_points = sum(points for _, points in spool.sealed)
        stats = self._stats
        return FinishReport(
            run_id=self.id if self._worker is None else (self._worker.run_id or self.id),
            mode=self.mode,
            points_logged=stats.points_logged,
            points_sent=stats.points_sent,
            points_pending=pending_points,
            points_dropped=stats.points_dropped,
            points_rejected=stats.points_rejected,
            batches_logged=stats.batches_logged,
            batches_sent=stats.batches_sent,
            batches_pending=len(spool.batch_files),
            batches_dropped=stats.batches_dropped,
            batches_rejected=stats.batches_rejected,
            batches_skipped=self._batches_skipped,
            spool_dir=str(spool.directory),
            problems=tuple(self._problems.recent),
        )

    @property
    def run_id(self) -> str | None:
        """The server's id of this run (None until the server was reached)."""
        if self._worker is not None and self._worker.run_id is not None:
            return self._worker.run_id
        return self.id

    @property
    def spool_dir(self) -> Path:
        return self._spool.directory

    @property
    def stats(self) -> Stats:
        return self._stats

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.finish()

    def __repr__(self) -> str:
        return (
            f"Run(project={self.project!r}, name={self.name!r}, mode={self.mode!r}, state={self.state.value})"
        )


def _cheap_check(tensors: dict) -> None:
    """Type checks for a call that was not sampled: misuse must raise on every call, not just sampled ones."""
    try:
        rules.check_required(tensors)
    except TypeError as exc:
        raise TypeError(f"log_batch: {exc}") from None


_current: Run | None = None


def init(
    url: str | None = None,
    project: str = "default",
    name: str | None = None,
    config: dict | None = None,
    api_key: str | None = None,
    mode: str = "online",
    **options: Any,
) -> Run:
    """Start (or resume, same project and name) a run and make it current. Usable as a context manager.

    ``url``/``api_key`` default to ``RLVITALS_URL``/``RLVITALS_API_KEY``; ``mode="offline"`` only spools
    (``rlvitals sync`` sends it later). Extra keywords: ``tags``, ``settings`` (a ``ClientSettings``),
    ``spool_dir``, ``batch_every``, ``halt_on`` (stop on critical incidents: ``run.should_stop()``),
    ``transport`` (an ``httpx.BaseTransport``, for tests).
    """
    global _current
    from dataclasses import replace

    for knob in ("batch_every", "halt_on"):
        value = options.pop(knob, None)
        if value is not None:
            options["settings"] = replace(options.get("settings") or ClientSettings(), **{knob: value})
    run = Run(url=url, project=project, name=name, config=config, api_key=api_key, mode=mode, **options)
    _current = run
    return run


def finish(timeout: float = DEFAULT_FINISH_TIMEOUT) -> FinishReport | None:
    """Finish the current run (the last ``init``); None if there is none."""
    run = _current
    return None if run is None else run.finish(timeout)


def _finish_all_at_exit() -> None:
    for run in list(_LIVE):
        if run._pid == os.getpid() and run.state is Lifecycle.OPEN:
            run.finish(timeout=min(10.0, DEFAULT_FINISH_TIMEOUT))


def _after_fork_in_child() -> None:
    for run in list(_LIVE):
        run._after_fork_in_child()


atexit.register(_finish_all_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
