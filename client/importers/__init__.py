"""Retroactive diagnosis of runs that were not instrumented: load their scalar history, run the health
rules locally, print the findings, and (optionally) send the points to a server or the offline spool.

Sources:

- ``verl-jsonl``: the JSONL verl's ``file`` logger writes (``{"step": N, "data": {name: value}}`` per line,
  ``VERL_FILE_LOGGER_PATH``); ``--follow`` keeps tailing it while the job runs.
- ``trl-state``: a transformers/TRL ``trainer_state.json`` (its ``log_history``; entries logged at the same
  step are merged). Never reads ``training_args.bin`` (a pickle).

``rlvitals import verl-jsonl FILE`` and ``rlvitals import trl-state trainer_state.json`` are the CLI.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rlvitals.client.integrations._common import scalars

KINDS = ("verl-jsonl", "trl-state")


def read_trl_state(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, float | int]]]:
    """``(step, numeric metrics)`` from ``trainer_state.json``'s ``log_history``, in step order.

    Entries without a ``step`` are skipped; entries sharing a step (train and eval logs) are merged.
    """
    try:
        state = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{path}: no log_history list (is this a trainer_state.json?)")
    merged: dict[int, dict[str, float | int]] = {}
    for entry in history:
        if not isinstance(entry, dict):
            continue
        step = entry.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            continue
        metrics = scalars({k: v for k, v in entry.items() if k != "step"})
        if metrics:
            merged.setdefault(step, {}).update(metrics)
    yield from sorted(merged.items())


def read_source(kind: str, path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, float | int]]]:
    if kind == "verl-jsonl":
        from rlvitals.client.integrations.verl import read_verl_jsonl

        return read_verl_jsonl(path)
    if kind == "trl-state":
        return read_trl_state(path)
    raise ValueError(f"unknown import kind {kind!r}; expected one of {', '.join(KINDS)}")


@dataclass
class Diagnosis:
    """What an import found: how much was read, every finding transition, and the episodes still open."""

    steps: int = 0
    metric_names: set[str] = field(default_factory=set)
    findings: list[Any] = field(default_factory=list)
    firing: list[Any] = field(default_factory=list)


class Diagnoser:
    """Feeds steps to a local ``HealthMonitor`` (and to a run when given), collecting the findings."""

    def __init__(
        self,
        *,
        run: Any = None,
        run_config: Mapping[str, Any] | None = None,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        echo: TextIO | None = None,
    ) -> None:
        from rlvitals.analyzers import HealthMonitor

        self.monitor = HealthMonitor(settings=settings, run_config=run_config)
        self.run = run
        self.echo = echo
        self.result = Diagnosis()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """The ``run.log`` signature, so a ``JsonlTailer`` can feed it while following a file."""
        self.result.steps += 1
        self.result.metric_names.update(metrics)
        if self.run is not None:
            self.run.log(dict(metrics), step)
        for finding in self.monitor.observe(step, metrics):
            self.result.findings.append(finding)
            if self.echo is not None:
                print(format_finding(finding), file=self.echo, flush=True)

    def log_batch(self, step: int, **batch: Any) -> None:  # a JsonlTailer never sends batches
        raise TypeError("an import carries scalars only")

    def feed(self, stream: Iterable[tuple[int, Mapping[str, Any]]]) -> Diagnosis:
        for step, metrics in stream:
            self.log(metrics, step)
        return self.finish()

    def finish(self) -> Diagnosis:
        self.result.firing = self.monitor.firing()
        return self.result


def format_finding(finding: Any) -> str:
    severity = getattr(finding.severity, "value", finding.severity)
    head = f"[{severity}] {finding.rule} {finding.state} at step {finding.step}"
    if finding.state == "firing" and finding.onset_step != finding.step:
        head += f" (onset {finding.onset_step})"
    lines = [f"{head}: {finding.message}"]
    if finding.state == "firing" and finding.advice:
        lines.append(f"    advice: {finding.advice}")
    return "\n".join(lines)


def run_import(
    kind: str,
    path: str | os.PathLike[str],
    *,
    url: str | None = None,
    project: str = "imported",
    name: str | None = None,
    offline: bool = False,
    upload: bool | None = None,
    config: Mapping[str, Any] | None = None,
    follow: bool = False,
    follow_idle_exit_s: float | None = None,
    out: TextIO = sys.stdout,
) -> Diagnosis:
    """Read ``path``, run the health rules, print findings to ``out``; send points when asked.

    ``upload`` defaults to True when ``url``/``RLVITALS_URL`` is set or ``offline`` is asked for, else the
    import is local only.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown import kind {kind!r}; expected one of {', '.join(KINDS)}")
    if follow and kind != "verl-jsonl":
        raise ValueError("--follow works with verl-jsonl only")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if upload is None:
        upload = bool(offline or url or os.environ.get("RLVITALS_URL"))
    run = None
    if upload:
        import rlvitals.client as client

        run = client.init(
            url=url,
            project=project,
            name=name or path.stem,
            config=dict(config) if config else None,
            mode="offline" if offline else "online",
        )
    diagnoser = Diagnoser(run=run, run_config=config, echo=out)
    result = diagnoser.feed(read_source(kind, path))
    if follow:
        from rlvitals.client.integrations.verl import JsonlTailer

        tailer = JsonlTailer(path, diagnoser, interval=0.5, offset=path.stat().st_size)
        print(f"following {path} (Ctrl-C to stop)", file=out, flush=True)
        tailer.follow(idle_exit_s=follow_idle_exit_s)
        result = diagnoser.finish()
    print(summary(kind, path, result), file=out)
    if run is not None:
        report = run.finish()
        where = (
            f"offline spool {run.spool_dir}" if offline else f"{run.url} as run {run.run_id or run.name!r}"
        )
        print(f"sent to {where}: {report}", file=out)
    elif not upload:
        print(
            "(diagnosed locally only: pass --url or set RLVITALS_URL to send it, or --offline to spool)",
            file=out,
        )
    return result


def summary(kind: str, path: Path, result: Diagnosis) -> str:
    lines = [
        f"rlvitals import {kind} {path}: {result.steps} steps, {len(result.metric_names)} metrics, "
        f"{sum(f.state == 'firing' for f in result.findings)} finding(s) fired"
    ]
    if result.firing:
        lines.append("still firing at the end: " + ", ".join(sorted({f.rule for f in result.firing})))
    elif result.steps:
        lines.append("no health rule is firing at the end of the run")
    return "\n".join(lines)
