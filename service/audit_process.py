"""The audit worker process: audits run in a child of the server process, at a lower CPU priority.

An audit recomputes a batch's losses over every token: seconds of CPU per large batch. Run in the
server's own process it would share the interpreter lock and the cores with every request, so one
client uploading large batches non-stop would slow every other client's writes. So the server
process only stores uploads and queues them (``audits.AuditPool.submit``); a child process, started
by the server when the first audit is queued (never before: a server that only ingests has no
second process), claims them from the database queue exactly as worker threads in the server did
(fair round robin over runs, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, across replicas) with
``audit_workers`` threads, at ``nice`` + ``audit_nice``.

- **It dies with the server.** On Linux the kernel kills it when the server process exits
  (``PR_SET_PDEATHSIG``, even after ``kill -9``); elsewhere it exits when its stdin (a pipe from the
  server) closes. A stopping server closes that pipe: it finishes the audits it is running, then
  exits. It ignores SIGINT and SIGTERM (a Ctrl-C or a stop sent to the whole process group reaches
  the server, which stops it in order).
- **It is restarted if it dies.** The server's supervisor thread starts a new one at once (after a
  crash loop: with a growing pause, at most 30 s). The jobs the dead one had claimed go back to the
  queue when the new one starts (their claimer's pid is gone), as after a ``kill -9`` of a server.
- **It is visible.** ``/metrics`` shows ``rlvitals_audit_worker_up``, its pid and
  ``rlvitals_audit_worker_restarts_total``; the server's log says when it starts, exits and restarts,
  and its own log lines (``rlvitals.*``) reach the same stderr, tagged with its pid.

The child talks back over one pipe of JSON lines: live events for the dashboard when the server
delivers events in-process (SQLite, one process; on PostgreSQL the child's NOTIFY reaches every
replica as before, and with several SQLite workers the shared event table does), audit counts and
timings for ``/metrics``, and wake-ups for the webhook sender. The server wakes the child's idle
threads through its stdin when it queues a job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rlvitals.service.events import Event, EventBus, PostgresBus, SqliteLogBus
from rlvitals.service.settings import Settings
from rlvitals.service.telemetry import Telemetry
from rlvitals.service.workers import MALLOC_ENV

log = logging.getLogger("rlvitals.service.audit_process")

_RESTART_MAX_PAUSE = 30.0  # seconds between restarts of a worker that keeps dying at once
_STOP_GRACE = 30.0  # seconds a stopping worker may take to finish its running audits


# --- the server's side ----------------------------------------------------------------------------


class AuditProcess:
    """Starts, feeds, watches and restarts the audit worker process (one per server process)."""

    def __init__(
        self,
        settings: Settings,
        telemetry: Telemetry,
        *,
        waiting: Callable[[], bool],
        on_frame: Callable[[int, str], None],
        on_job: Callable[[str], None],
    ):
        self.settings = settings
        self.telemetry = telemetry
        self.waiting = waiting  # whether audits wait in the database (this replica or another queued them)
        self.on_frame = on_frame
        self.on_job = on_job
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._wanted = False
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the supervisor thread (the process itself starts once an audit waits)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._supervise, name="rlvitals-audit-supervisor", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """An audit was queued: wake the worker's idle threads, or start the worker."""
        with self._lock:
            proc = self.proc
            if proc is not None and proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(b"w\n")
                    proc.stdin.flush()
                    return
                except (BrokenPipeError, OSError, ValueError):
                    pass  # it is exiting: the supervisor sees that
            self._wanted = True
        self._kick.set()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=_STOP_GRACE + 10)
            self._thread = None

    # --- the supervisor thread (it also owns the process: PR_SET_PDEATHSIG follows this thread) ---
    def _supervise(self) -> None:
        pause, last_start = 0.0, 0.0
        try:
            while not self._stop.is_set():
                proc = self.proc
                if proc is not None and proc.poll() is not None:  # it died
                    code = proc.returncode
                    self._reap(proc)
                    self.telemetry.audit_worker(pid=None, restarted=True)
                    quick = time.monotonic() - last_start < 10.0
                    pause = min(max(pause * 2, 1.0), _RESTART_MAX_PAUSE) if quick else 0.0
                    log.warning(
                        "audit worker process %s exited (%s); starting a new one%s",
                        proc.pid,
                        _exit_text(code),
                        f" in {pause:.0f} s" if pause else "",
                    )
                    with self._lock:
                        self.proc = None
                        self._wanted = True
                    if pause and self._stop.wait(pause):
                        break
                    continue
                if proc is None:
                    with self._lock:
                        wanted, self._wanted = self._wanted, False
                    if wanted or self._has_work():
                        last_start = time.monotonic()
                        self._spawn()
                        continue
                self._kick.wait(self.settings.audit_poll_interval if self.proc is None else 0.5)
                self._kick.clear()
        except Exception:  # never leave the queue without a worker silently
            log.exception("audit worker supervisor failed")
        finally:
            self._shutdown()

    def _has_work(self) -> bool:
        try:
            return self.waiting()
        except Exception as exc:  # database away: look again at the next poll
            log.warning("checking the audit queue failed: %s", exc)
            return False

    def _spawn(self) -> None:
        read_fd, write_fd = os.pipe()
        argv = [sys.executable, "-m", "rlvitals.service.audit_process", str(os.getpid()), str(write_fd)]
        try:
            env = {**MALLOC_ENV, **os.environ}  # a user's own MALLOC_* settings win
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, pass_fds=(write_fd,), close_fds=True, env=env
            )
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            log.error("starting the audit worker process failed: %s", exc)
            self._stop.wait(5.0)
            with self._lock:
                self._wanted = True
            return
        os.close(write_fd)
        assert proc.stdin is not None
        try:
            proc.stdin.write(self.settings.model_dump_json().encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # it died at once: the next turn sees it
        with self._lock:
            self.proc = proc
        self.starts += 1
        self.telemetry.audit_worker(pid=proc.pid, restarted=False)
        reader = threading.Thread(
            target=self._read, args=(read_fd,), name=f"rlvitals-audit-pipe-{proc.pid}", daemon=True
        )
        reader.start()
        log.info(
            "audit worker process %s started (%d thread(s), nice +%d)",
            proc.pid,
            self.settings.audit_workers,
            self.settings.audit_nice,
        )

    def _read(self, fd: int) -> None:
        """The child's messages, one JSON object a line, until it exits."""
        with open(fd, "rb", buffering=1 << 16) as pipe:
            for line in pipe:
                try:
                    message = json.loads(line)
                    kind = message["t"]
                    if kind == "frame":
                        self.on_frame(int(message["run_id"]), str(message["frame"]))
                    elif kind == "job":
                        self.on_job(str(message["kind"]))
                    elif kind == "audit":
                        self.telemetry.observe_audit(
                            status=str(message["status"]), seconds=float(message["s"])
                        )
                    elif kind == "defect":
                        self.telemetry.count_fast_path_defect()
                except Exception as exc:  # one bad line never stops the channel
                    log.warning("ignoring a malformed message from the audit worker: %s", exc)

    def _shutdown(self) -> None:
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            if proc.stdin is not None:  # end of its stdin: finish the running audits, then exit
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(timeout=_STOP_GRACE)
            except subprocess.TimeoutExpired:
                log.warning(
                    "audit worker process %s did not stop in %.0f s; killing it", proc.pid, _STOP_GRACE
                )
                proc.kill()
                proc.wait(timeout=10)
        self._reap(proc)
        self.telemetry.audit_worker(pid=None, restarted=False)
        log.info("audit worker process %s stopped", proc.pid)

    @staticmethod
    def _reap(proc: subprocess.Popen) -> None:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# --- the worker's side ----------------------------------------------------------------------------


class _Channel:
    """The pipe to the server: one JSON object a line, written whole under a lock."""

    def __init__(self, fd: int):
        self._file = open(fd, "wb", buffering=0)  # noqa: SIM115 - held for the process's life
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock, contextlib.suppress(OSError):  # the server is gone: the watcher ends this process
            self._file.write(data)


class _RelayBus(EventBus):
    """The worker's event bus: on PostgreSQL (and with several SQLite workers) events go out as the
    server's own bus sends them (NOTIFY, the event table), so every replica sees them; otherwise the
    server delivers them, sent over the pipe after the commit. Job wake-ups always go over the pipe
    (after the commit) too, so this server's webhook sender starts at once."""

    def __init__(self, inner: EventBus | None, channel: _Channel):
        super().__init__()
        self.inner = inner
        self.channel = channel
        self._jobs: set[str] = set()

    def stage(self, *, session, events: list[Event]) -> None:
        if self.inner is not None:
            self.inner.stage(session=session, events=events)

    def stage_job(self, *, session, kind: str) -> None:
        if self.inner is not None:
            self.inner.stage_job(session=session, kind=kind)
        with self._lock:
            self._jobs.add(kind)

    def flush(self, events: list[Event]) -> None:
        if self.inner is None:
            for event in events:
                self.channel.send({"t": "frame", "run_id": event.run_id, "frame": event.frame()})
        with self._lock:
            jobs, self._jobs = self._jobs, set()
        for kind in sorted(jobs):
            self.channel.send({"t": "job", "kind": kind})


class _RelayTelemetry(Telemetry):
    """The worker's counters go to the server, which serves ``/metrics``."""

    def __init__(self, channel: _Channel):
        super().__init__()
        self.channel = channel

    def observe_audit(self, *, status: str, seconds: float) -> None:
        self.channel.send({"t": "audit", "status": status, "s": seconds})

    def count_fast_path_defect(self) -> None:
        self.channel.send({"t": "defect"})


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the server exits (Linux); the stdin watcher covers the rest."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it exited before the line above
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parent, fd = int(args[0]), int(args[1])
    _die_with_parent(parent)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s %(name)s [audit worker {os.getpid()}]: %(message)s",
    )
    settings = Settings.model_validate_json(sys.stdin.buffer.readline())
    if settings.audit_nice:
        with contextlib.suppress(OSError):
            os.nice(settings.audit_nice)

    from types import SimpleNamespace

    from rlvitals.service.audits import AuditPool
    from rlvitals.service.evaluator import HealthEvaluator
    from rlvitals.service.health import HealthEngine
    from rlvitals.service.storage.database import Database

    if settings.plugins:  # their health rules are registered before the rule settings are read
        from rlvitals.analyzers.plugins import load_plugins

        load_plugins()
    channel = _Channel(fd)
    db = Database(settings.resolved_database_url, pool_size=max(2, settings.audit_workers + 1))
    inner: EventBus | None = None
    if db.is_postgresql:
        inner = PostgresBus(db, queue_size=settings.sse_queue_size)
    elif settings.workers > 1:
        inner = SqliteLogBus(db, queue_size=settings.sse_queue_size)
    bus = _RelayBus(inner, channel)
    health = HealthEngine(settings)
    telemetry = _RelayTelemetry(channel)
    pool = AuditPool(settings, db, bus, health, telemetry, threads_here=True)
    # an audit first waits for the rules to have seen the run's earlier writes (the server's evaluator)
    pool.evaluator = HealthEvaluator(SimpleNamespace(settings=settings, db=db, health=health))

    stop = threading.Event()

    def watch_stdin() -> None:
        for _line in sys.stdin.buffer:  # "w": an audit was queued
            pool.wake()
        stop.set()  # the server closed the pipe (it stops, or it is gone)

    # The server decides when this process stops (it closes the pipe): a Ctrl-C or a SIGTERM sent to
    # the whole process group reaches the server, which then stops this process after its audits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pool.start()
    threading.Thread(target=watch_stdin, name="rlvitals-audit-stdin", daemon=True).start()
    while not stop.wait(0.5):
        pass
    pool.stop()
    db.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
