"""Resending a spool later: ``rlvitals sync [DIR]`` calls ``sync_spool``.

``DIR`` is either the spool root (every run directory under it) or one run directory (it holds
``run.json``). For each run: create or resume it by (project, name), send every segment (in requests of
at most ``max_steps_per_request`` records) and every batch, deleting each file once the server
acknowledged it. Segments a live process is still writing are left alone; those of a crashed process are
sent. Safe to run twice or concurrently with a recovering trainer: the server inserts-or-ignores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvitals.client.settings import DEFAULT_URL, ClientSettings, default_spool_dir
from rlvitals.client.spool import RunInfo, count_points, pending_files, read_segment
from rlvitals.client.transport import HttpApi, RejectedError, RetryableError, TransportError, encode_record


@dataclass
class SyncResult:
    """What ``sync_spool`` did. ``ok`` is True when every file found was delivered."""

    runs: int = 0
    points_sent: int = 0
    batches_sent: int = 0
    points_rejected: int = 0
    batches_rejected: int = 0
    files_left: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.files_left == 0 and not self.errors

    def __str__(self) -> str:
        text = f"synced {self.runs} run(s): {self.points_sent} points, {self.batches_sent} tensor batches"
        if self.points_rejected or self.batches_rejected:
            text += (
                f"; rejected by the server: {self.points_rejected} points, {self.batches_rejected} batches"
            )
        if self.files_left:
            text += f"; {self.files_left} file(s) left to retry"
        for error in self.errors:
            text += f"\n  {error}"
        return text


def _run_dirs(directory: Path) -> list[Path]:
    if (directory / "run.json").is_file():
        return [directory]
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if (p / "run.json").is_file())


def sync_spool(
    directory: str | os.PathLike | None = None,
    url: str | None = None,
    api_key: str | None = None,
    *,
    settings: ClientSettings | None = None,
    transport: Any = None,
) -> SyncResult:
    """Send a spool directory to the server; never raises on server trouble (see ``SyncResult.errors``).

    ``directory`` defaults to ``RLVITALS_SPOOL_DIR`` or ``~/.rlvitals/spool``; ``url``/``api_key`` to
    ``RLVITALS_URL``/``RLVITALS_API_KEY``. A missing directory raises ``FileNotFoundError``.
    """
    settings = settings or ClientSettings()
    root = Path(directory).expanduser() if directory is not None else default_spool_dir()
    if not root.exists():
        raise FileNotFoundError(f"no spool at {root}")
    api = HttpApi(
        (url or os.environ.get("RLVITALS_URL") or DEFAULT_URL),
        api_key=api_key if api_key is not None else os.environ.get("RLVITALS_API_KEY"),
        timeout=settings.timeout,
        connect_timeout=settings.connect_timeout,
        transport=transport,
    )
    result = SyncResult()
    try:
        for run_dir in _run_dirs(root):
            _sync_run(api, run_dir, settings, result)
    finally:
        api.close()
    return result


def _sync_run(api: HttpApi, run_dir: Path, settings: ClientSettings, result: SyncResult) -> None:
    segments, batches = pending_files(run_dir)
    if not segments and not batches:
        return
    try:
        info = RunInfo.load(run_dir)
        run_id = api.create_run(project=info.project, name=info.name, config=info.config, tags=info.tags)
    except (OSError, ValueError, KeyError) as exc:
        result.errors.append(f"{run_dir}: unreadable run.json ({exc})")
        result.files_left += len(segments) + len(batches)
        return
    except TransportError as exc:
        result.errors.append(f"{run_dir}: {exc}")
        result.files_left += len(segments) + len(batches)
        return
    result.runs += 1
    limit = settings.max_steps_per_request
    for index, path in enumerate(segments):
        records = read_segment(path)
        try:
            for start in range(0, len(records), limit):
                api.post_metrics(run_id, [encode_record(r) for r in records[start : start + limit]])
        except RejectedError as exc:
            result.points_rejected += count_points(records)
            result.errors.append(f"{path.name}: {exc} (kept as {path.name}.rejected)")
            path.rename(path.with_name(path.name + ".rejected"))
            continue
        except RetryableError as exc:
            result.errors.append(f"{path.name}: {exc}")
            result.files_left += len(segments) - index + len(batches)
            return
        result.points_sent += count_points(records)
        path.unlink(missing_ok=True)
    for index, path in enumerate(batches):
        try:
            api.post_batch(run_id, [path.read_bytes()])
        except RejectedError as exc:
            result.batches_rejected += 1
            result.errors.append(f"{path.name}: {exc} (kept as {path.name}.rejected)")
            path.rename(path.with_name(path.name + ".rejected"))
            continue
        except RetryableError as exc:
            result.errors.append(f"{path.name}: {exc}")
            result.files_left += len(batches) - index
            return
        result.batches_sent += 1
        path.unlink(missing_ok=True)
