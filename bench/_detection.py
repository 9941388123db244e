"""The labelled real-log corpus and our detector over it (bench/detection.py prints, a test asserts).

``load_corpus()`` reads ``tests/data/real_logs/manifest.json`` (our labels and each file's source) and
each run's points, from ``corpus_dir()``, through the importer ``rlvitals import`` uses; ``our_alerts(run)`` runs the health rules
exactly as ``rlvitals import`` does (a local ``HealthMonitor`` fed the imported points, with the config
the source revealed); ``score(detector, runs)`` scores any detector with
``rlvitals.analyzers.health.scoring``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvitals.analyzers.health.scoring import Alert, RunLabels, RunScore, score_run
from rlvitals.client.importers import Diagnoser, History, read_history

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "tests" / "data" / "real_logs" / "manifest.json"
# The log files themselves are public data fetched from other repositories: they are kept in the steering
# repository's shared/ folder (a copy lies beside every checkout and CI clone), never committed here.
CORPUS_PLACES = (ROOT.parent / "shared" / "real_logs", MANIFEST.parent)
MISSING = (
    "the real-log corpus files are not here: put them in ../shared/real_logs/ or point RLVITALS_CORPUS_DIR "
    "at them (sources and trimming: docs/detection.md)"
)


class CorpusMissing(FileNotFoundError):
    """None of the corpus places holds every file the manifest names."""


def corpus_files() -> list[str]:
    return [entry["file"] for entry in json.loads(MANIFEST.read_text())["runs"]]


def corpus_dir() -> Path | None:
    """The first of ``RLVITALS_CORPUS_DIR``, ``../shared/real_logs`` and ``tests/data/real_logs`` that holds
    every file the manifest names, or None."""
    env = os.environ.get("RLVITALS_CORPUS_DIR")
    places = (Path(env),) if env else CORPUS_PLACES
    files = corpus_files()
    for place in places:
        if all((place / name).is_file() for name in files):
            return place
    return None


@dataclass
class CorpusRun:
    id: str
    kind: str
    path: Path
    labels: RunLabels
    history: History
    entry: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @property
    def last_step(self) -> int:
        return self.history.points[-1][0]


def load_corpus(directory: Path | None = None, *, only: Iterable[str] | None = None) -> list[CorpusRun]:
    directory = directory or corpus_dir()
    if directory is None:
        raise CorpusMissing(MISSING)
    manifest = json.loads(MANIFEST.read_text())
    wanted = set(only) if only else None
    runs = []
    for entry in manifest["runs"]:
        if wanted is not None and entry["id"] not in wanted:
            continue
        path = directory / entry["file"]
        runs.append(
            CorpusRun(
                id=entry["id"],
                kind=entry["format"],
                path=path,
                labels=RunLabels.from_manifest(entry),
                history=read_history(entry["format"], path),
                entry=entry,
            )
        )
    return runs


def our_alerts(run: CorpusRun, settings: Mapping[str, Mapping[str, Any]] | None = None) -> list[Alert]:
    """Every firing transition of our rules on ``run`` (its severity as escalated by the episode's end)."""
    diagnosis = Diagnoser(run_config=run.history.config, settings=settings).feed(run.history.points)
    return alerts_from_findings(diagnosis.findings, diagnosis.firing)


def alerts_from_findings(findings: Iterable[Any], firing: Iterable[Any] = ()) -> list[Alert]:
    """Our findings as scored alerts: one per firing transition, at the step it fired, with the severity
    its episode had at the end (``firing``: the findings still open when the run ended). The synthetic
    corpus (bench/_synthetic.py) turns its findings into alerts through this too."""
    findings = list(findings)
    final = {(f.rule, f.onset_step): f for f in firing}
    resolved = {(f.rule, f.onset_step): f for f in findings if f.state == "resolved"}
    alerts = []
    for finding in findings:
        if finding.state != "firing":
            continue
        key = (finding.rule, finding.onset_step)
        last = final.get(key) or resolved.get(key) or finding
        alerts.append(Alert(rule=str(finding.rule), step=int(finding.step), severity=_severity(last)))
    return alerts


def _severity(finding: Any) -> str:
    return str(getattr(finding.severity, "value", finding.severity))


Detector = Callable[[CorpusRun], list[Alert]]


def score(detector: Detector, runs: Iterable[CorpusRun]) -> list[RunScore]:
    return [score_run(run.labels, detector(run), last_step=run.last_step) for run in runs]


PEERS = ("rldoctor", "rlwatch", "rlprobe")
PEER_VERSIONS = {"rldoctor": "0.2.0", "rlwatch": "0.5.1", "rlprobe": "0.1.0"}
DRIVER = Path(__file__).with_name("_peer_driver.py")


def peer_python() -> Path:
    """The peers' side environment (tests/support/sideenv.py, built on first use)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.support.sideenv import PEERS as PEER_STEPS
    from tests.support.sideenv import ensure

    return ensure("peers", PEER_STEPS)


def _peer_points(run: CorpusRun) -> list[list[Any]]:
    """The run's points as a live integration would have seen them (TensorBoard's ``train/`` prefix off)."""
    points = []
    for step, metrics in run.history.points:
        if run.kind == "tensorboard":
            metrics = {k[len("train/") :] if k.startswith("train/") else k: v for k, v in metrics.items()}
        points.append([step, metrics])
    return points


def peer_alerts(
    peer: str, runs: Iterable[CorpusRun], *, python: Path | None = None
) -> dict[str, list[Alert]]:
    """Run ``peer`` over ``runs`` in its side environment; alerts per run id."""
    import subprocess

    runs = list(runs)
    request = {
        "peer": peer,
        "runs": [
            {
                "id": run.id,
                "format": run.kind,
                "algorithm": "ppo" if run.kind.startswith("verl") else "grpo",
                "config": run.history.config,
                "points": _peer_points(run),
            }
            for run in runs
        ],
    }
    done = subprocess.run(
        [str(python or peer_python()), str(DRIVER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{peer} driver failed ({done.returncode}):\n{done.stderr[-4000:]}")
    answer = json.loads(done.stdout)
    return {
        rid: [Alert(rule=r, step=int(s), severity=sev) for r, s, sev in rows] for rid, rows in answer.items()
    }
