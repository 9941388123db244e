"""The on-disk spool: where records wait while the server is unreachable, memory is full, or mode is offline.

Layout (one directory per run under ``RLVITALS_SPOOL_DIR``, default ``~/.rlvitals/spool``)::

    <spool>/<project>--<name>-<hash>/
        run.json                                   project, name, config, tags (to create/resume the run)
        seg-<pid>-<token>-<n>.jsonl.part           the segment a live process is appending to
        seg-<pid>-<token>-<n>-<points>.jsonl       sealed: one HTTP request's worth of step records
        batch-<pid>-<token>-<n>.safetensors        one tensor batch, exactly the bytes POSTed

Each JSONL line is one API step record (``{"step", "metrics", "wall_time"}``, non-finite values already
spelled "NaN"/"Infinity"/"-Infinity"). Lines are appended and flushed; a failed write is truncated back so
no torn line stays in the middle; a torn last line (a crash mid-write) is skipped on read. Sealing fsyncs
and renames, batches are written to ``.part`` and renamed, so a crash never leaves a half file that looks
whole. Files are deleted only after the server acknowledged them, and resending is harmless because the
server inserts-or-ignores on (run, step, name).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

SEGMENT_SUFFIX = ".jsonl"
PART_SUFFIX = ".part"
BATCH_SUFFIX = ".safetensors"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def run_dir_name(project: str, name: str) -> str:
    digest = hashlib.sha1(f"{project}\0{name}".encode()).hexdigest()[:8]
    return f"{_SAFE.sub('_', project)[:40]}--{_SAFE.sub('_', name)[:80]}-{digest}"


def _owner_pid(path: Path) -> int | None:
    parts = path.name.split("-")
    try:
        return int(parts[1])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lines(path: Path) -> list[bytes]:
    """The whole JSON lines of a segment this process wrote (a torn tail is dropped), unparsed."""
    lines = path.read_bytes().split(b"\n")
    return [line for line in lines[:-1] if line]


def segment_points(path: Path) -> int | None:
    """The point count a sealed segment's name records (None for a ``.part`` segment)."""
    stem = path.name[: -len(SEGMENT_SUFFIX)] if path.name.endswith(SEGMENT_SUFFIX) else ""
    tail = stem.rsplit("-", 1)[-1]
    return int(tail) if stem.count("-") >= 4 and tail.isdigit() else None


def read_segment(path: Path) -> list[dict]:
    """Step records of one segment; a torn or corrupt line is skipped (it was never acknowledged whole)."""
    records = []
    with open(path, "rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                break  # torn tail from a crash mid-append
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record and isinstance(record.get("metrics"), dict):
                records.append(record)
    return records


def count_points(records: list[dict]) -> int:
    return sum(len(record["metrics"]) for record in records)


@dataclass(frozen=True)
class RunInfo:
    project: str
    name: str
    config: dict
    tags: list

    @classmethod
    def load(cls, directory: Path) -> RunInfo:
        data = json.loads((directory / "run.json").read_text())
        return cls(data["project"], data["name"], data.get("config") or {}, data.get("tags") or [])


class Spool:
    """The spool of one run, written by one process (``token`` names its files). Thread-safe."""

    def __init__(self, root: Path, info: RunInfo, *, segment_records: int, max_bytes: int) -> None:
        self.root = Path(root)
        self.info = info
        self.directory = self.root / run_dir_name(info.project, info.name)
        self.segment_records = segment_records
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.reset_owner()

    def reset_owner(self) -> None:
        """A fresh writer identity (also called in a forked child: never append to the parent's files)."""
        self._lock = threading.Lock()
        self.token = os.urandom(4).hex()
        self.prefix = f"{os.getpid()}-{self.token}"
        self._seq = 0
        self._handle = None
        self._open_path: Path | None = None
        self._open_records = 0
        self._open_points = 0
        self._offset = 0
        self._prepared = False
        self.sealed: deque[tuple[Path, int]] = deque()  # own sealed (segment, points), oldest first
        self.batch_files: deque[Path] = deque()  # own spooled batches, oldest first

    # -- writing ------------------------------------------------------------------------------
    def _prepare(self) -> None:
        if self._prepared:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = self.directory / "run.json"
        if not meta.exists():
            tmp = self.directory / f"run.json.{self.prefix}.tmp"
            info = {
                "project": self.info.project,
                "name": self.info.name,
                "config": self.info.config,
                "tags": self.info.tags,
            }
            tmp.write_text(json.dumps(info, allow_nan=False))
            os.replace(tmp, meta)
        self._prepared = True

    def set_config(self, config: dict) -> None:
        """A new run config: kept for the next (re)creation of the run, and in ``run.json`` if written."""
        with self._lock:
            self.info = RunInfo(self.info.project, self.info.name, dict(config), self.info.tags)
            if self._prepared:
                self._prepared = False
                meta = self.directory / "run.json"
                meta.unlink(missing_ok=True)
                self._prepare()

    def _next_path(self, kind: str, suffix: str) -> Path:
        self._seq += 1
        return self.directory / f"{kind}-{self.prefix}-{self._seq:06d}{suffix}"

    def append(self, items: list[tuple[bytes, int]]) -> None:
        """Append (JSON line, point count) records; raises ``OSError`` (disk full, ...) with nothing
        half-written: the file is unbuffered, and a failed write is cut back to the last whole line.
        """
        if not items:
            return
        with self._lock:
            self._prepare()
            start = 0
            while start < len(items):
                if self._handle is None:
                    self._open_path = self._next_path("seg", SEGMENT_SUFFIX + PART_SUFFIX)
                    self._handle = open(self._open_path, "ab", buffering=0)  # noqa: SIM115 - kept open
                    self._open_records = 0
                    self._open_points = 0
                    self._offset = 0
                room = self.segment_records - self._open_records
                chunk = items[start : start + room]
                data = b"\n".join(line for line, _ in chunk) + b"\n"
                try:
                    view = memoryview(data)
                    while view:
                        view = view[self._handle.write(view) :]
                except OSError:
                    self._rollback()
                    raise
                self._offset += len(data)
                self._open_records += len(chunk)
                self._open_points += sum(points for _, points in chunk)
                start += len(chunk)
                if self._open_records >= self.segment_records:
                    self._seal_locked()

    def _rollback(self) -> None:
        """Cut a failed append back to the last whole line, so later appends never follow a torn one."""
        try:
            os.ftruncate(self._handle.fileno(), self._offset)
            self._handle.seek(self._offset)
        except (OSError, ValueError):
            self._seal_locked()  # keep what was written whole; the next append starts a new segment

    def _seal_locked(self) -> None:
        """Close the open segment; rename it sealed (with its point count) if it holds records."""
        if self._handle is None:
            return
        handle, path = self._handle, self._open_path
        records, points = self._open_records, self._open_points
        self._handle = None
        self._open_records = self._open_points = 0
        with contextlib.suppress(OSError):
            os.fsync(handle.fileno())  # unbuffered: nothing is left to flush, only to persist
        with contextlib.suppress(OSError):
            handle.close()
        if records == 0:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return
        base = path.name[: -len(SEGMENT_SUFFIX + PART_SUFFIX)]
        sealed = path.with_name(f"{base}-{points}{SEGMENT_SUFFIX}")
        try:
            os.replace(path, sealed)
        except OSError:
            sealed = path  # still readable under its .part name; sent from there
        self.sealed.append((sealed, points))

    def seal(self) -> bool:
        """Close the open segment so the sender can send it; True if it held records."""
        with self._lock:
            had = self._handle is not None and self._open_records > 0
            self._seal_locked()
            return had

    @property
    def open_records(self) -> int:
        return self._open_records

    def write_batch(self, payload: list[bytes]) -> Path:
        """Store one batch's safetensors bytes (chunks); raises ``OSError`` if the disk or ``max_bytes`` is full."""
        size = sum(len(chunk) for chunk in payload)
        with self._lock:
            self._prepare()
            if self.max_bytes and self.size_bytes() + size > self.max_bytes:
                raise OSError(28, f"spool limit of {self.max_bytes} bytes reached")
            path = self._next_path("batch", BATCH_SUFFIX)
            tmp = path.with_name(path.name + PART_SUFFIX)
            try:
                with open(tmp, "wb") as handle:
                    for chunk in payload:
                        handle.write(chunk)
                    handle.flush()
                    os.fsync(handle.fileno())
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
            self.batch_files.append(path)
            return path

    def size_bytes(self) -> int:
        total = 0
        try:
            for entry in os.scandir(self.directory):
                with contextlib.suppress(OSError):
                    total += entry.stat().st_size
        except OSError:
            pass
        return total

    def has_pending(self) -> bool:
        return bool(self.sealed or self.batch_files or self._open_records)

    def close(self) -> None:
        self.seal()


def pending_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(segments, batches) of a run directory that no live process is still writing, oldest first.

    Includes the ``.part`` segment of a process that died mid-run (a crash must not strand its records).
    """
    segments, batches = [], []
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.startswith("seg-") and name.endswith(SEGMENT_SUFFIX):
            segments.append(path)
        elif name.startswith("seg-") and name.endswith(SEGMENT_SUFFIX + PART_SUFFIX):
            pid = _owner_pid(path)
            if pid is None or not _pid_alive(pid):
                segments.append(path)
        elif name.startswith("batch-") and name.endswith(BATCH_SUFFIX):
            batches.append(path)
    return segments, batches
