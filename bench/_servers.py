"""Start, watch and stop the HTTP servers that bench/ingest.py compares.

A ``Server`` is one server command (rlvitals, MLflow or trackio) run as its own process group on a
loopback port, with its stdout/stderr in a log file. The benchmark reads its memory as the sum over
the whole process tree (a uvicorn supervisor plus its workers counts as one server), from /proc:

- RSS: resident set size summed over the tree (pages shared between forked workers count once per
  process, as ``ps`` and most dashboards show them);
- PSS: proportional set size summed over the tree (shared pages split between their users), the
  fairer figure for multi-process servers; read at the end only, since smaps_rollup is slower.

``RssSampler`` polls the tree RSS in a thread and keeps the peak.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it, found through /proc/<pid>/stat parent ids."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: fields start after the last ')'.
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_rss(root: int) -> int:
    """Resident bytes summed over the process tree of ``root`` (0 once it is gone)."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * PAGE_SIZE
        except (OSError, IndexError, ValueError):
            continue
    return total


def tree_pss(root: int) -> int:
    """Proportional set size in bytes summed over the process tree of ``root``."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
                for line in fh:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return total


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds used so far by the live processes of the tree of ``root``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def wait_idle(root: int, *, busy_below: float = 0.05, timeout: float = 30.0) -> float:
    """Wait until the tree of ``root`` uses under ``busy_below`` of a core for a second.

    Some servers keep working after they answer their health check (MLflow starts job runners and
    finishes migrations in the background); measuring through that would charge them for start-up.
    Returns the seconds waited.
    """
    start = time.monotonic()
    before = tree_cpu_seconds(root)
    while time.monotonic() - start < timeout:
        time.sleep(1.0)
        now = tree_cpu_seconds(root)
        if now - before < busy_below:
            break
        before = now
    return time.monotonic() - start


class RssSampler:
    """Polls the tree RSS of one process every ``interval`` seconds and keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> int:
        rss = tree_rss(self.pid)
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


@dataclass
class Server:
    """One server command on 127.0.0.1:``port``; ``ready_path`` answers 200 once it serves."""

    name: str
    argv: Sequence[str]
    port: int
    workdir: Path
    ready_path: str
    env: Mapping[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self, timeout: float) -> Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode} before it was ready:\n{self.log_tail()}"
                )
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} was not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def pid(self) -> int:
        assert self.popen is not None, "server not started"
        return self.popen.pid

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds."""
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=grace)
        except ProcessLookupError:
            pass
        # Workers that outlived their supervisor would keep the port and skew the next server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
