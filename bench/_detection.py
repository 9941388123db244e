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

from rlvitals.analyzers.health.scoring import Alert, RunLabels, RunScore, incident_window, score_run
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


PARTS = ("tuning", "heldout", "more")
# Each batch of runs added together is split once (bench/build_corpus.py --assign-split writes it into the
# manifest; the corpus test checks the manifest still matches it): a batch the manifest's
# ``heldout_batches`` names is held out whole; any other is drawn by this seeded rule. A draw whose
# held-out runs were studied closely is retired (``retired_heldout``): those runs moved to tuning, each
# keeping what the draw gave it (``drawn``); so is a whole held-out batch once scored and studied
# (``retired_heldout_batches``). The first 13 runs are the tuning part by decree (the rules
# were tuned on them before the split existed); more/ is its own third check.
SPLIT_SEED = 20261206


def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST.read_text())


def split_record(key: str, of: Mapping[str, Any] | None = None) -> list[int]:
    """The batches a split record of the manifest names (``retired_heldout``, ``retired_heldout_batches``,
    ``heldout_batches``), in ``of`` (a manifest already read) or in the manifest on disk."""
    return list((manifest() if of is None else of).get(key, {}).get("batches", ()))


def corpus_files(part: str | None = None) -> list[str]:
    return [e["file"] for e in manifest()["runs"] if part is None or e.get("split") == part]


def stratum(entry: Mapping[str, Any]) -> str:
    """A run's stratum for the split: its trainer family and its label (healthy, or the kind of its
    earliest incident other than zero_grad, else zero_grad)."""
    family = entry["format"].split("-")[0] if entry["format"].startswith(("verl", "trl")) else "trl"
    incidents = sorted(entry["labels"].get("incidents", ()), key=lambda i: (i["onset"], i["kind"]))
    if not incidents:
        return f"{family}/healthy"
    primary = next((i for i in incidents if i["kind"] != "zero_grad"), incidents[0])
    return f"{family}/{primary['kind']}"


def assign_split(entries: Iterable[Mapping[str, Any]], seed: int = SPLIT_SEED) -> dict[str, str]:
    """Run id -> "tuning" | "heldout" for the runs not yet in a part: strata in name order, each stratum's
    runs in the order of sha256(seed:id), assigned alternately (held-out first) across the whole list, so
    every stratum is split within one run and the parts differ by at most one run."""
    import hashlib

    strata: dict[str, list[str]] = {}
    for entry in entries:
        strata.setdefault(stratum(entry), []).append(entry["id"])
    ordered = [
        rid
        for name in sorted(strata)
        for rid in sorted(strata[name], key=lambda r: hashlib.sha256(f"{seed}:{r}".encode()).hexdigest())
    ]
    return {rid: ("heldout", "tuning")[i % 2] for i, rid in enumerate(ordered)}


def corpus_dir() -> Path | None:
    """Where the corpus files are: ``RLVITALS_CORPUS_DIR`` when set, else the first of ``../shared/real_logs``
    and ``tests/data/real_logs`` that holds any file the manifest names; None if neither does. Not every
    run's file need be there (CI has the first 13 and more/): :func:`load_corpus` can skip the absent."""
    env = os.environ.get("RLVITALS_CORPUS_DIR")
    places = (Path(env),) if env else CORPUS_PLACES
    files = corpus_files()
    for place in places:
        if any((place / name).is_file() for name in files):
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
    def part(self) -> str:
        return str(self.entry.get("split") or "")

    @property
    def last_step(self) -> int:
        return self.history.points[-1][0]


def load_corpus(
    directory: Path | None = None,
    *,
    only: Iterable[str] | None = None,
    part: str | None = None,
    skip_absent: bool = True,
) -> list[CorpusRun]:
    """The runs of ``part`` (``tuning``, ``heldout``, ``more``; None: every part), read from ``directory``
    (default: :func:`corpus_dir`). ``skip_absent``: leave out runs whose file is not there (CI has the
    first 13 runs and more/, not the newer ones) instead of failing."""
    directory = directory or corpus_dir()
    if directory is None:
        raise CorpusMissing(MISSING)
    wanted = set(only) if only else None
    runs = []
    for entry in manifest()["runs"]:
        if wanted is not None and entry["id"] not in wanted:
            continue
        if part is not None and entry.get("split") != part:
            continue
        path = directory / entry["file"]
        if skip_absent and not path.is_file():
            continue
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
    return our_run(run, settings)[0]


def our_run(
    run: CorpusRun, settings: Mapping[str, Mapping[str, Any]] | None = None
) -> tuple[list[Alert], list[Page]]:
    """Our rules on ``run``, as ``rlvitals import`` runs them: the scored alerts (:func:`alerts_from_findings`)
    and the incident notifications a user would get (:func:`incident_pages`)."""
    diagnosis = Diagnoser(run_config=run.history.config, settings=settings).feed(run.history.points)
    return (
        alerts_from_findings(diagnosis.findings, diagnosis.firing, last_step=run.last_step),
        incident_pages(diagnosis.incident_updates, last_step=run.last_step),
    )


def alerts_from_findings(
    findings: Iterable[Any], firing: Iterable[Any] = (), *, last_step: int | None = None
) -> list[Alert]:
    """Our findings as scored alerts: one per firing transition, at the step it fired, with the severity
    its episode had at the end (``firing``: the findings still open when the run ended) and the last step
    it was firing (its resolve step; ``last_step`` for one still open at the end). The synthetic corpus
    (bench/_synthetic.py) turns its findings into alerts through this too."""
    findings = list(findings)
    final = {(f.rule, f.onset_step): f for f in firing}
    resolved = {(f.rule, f.onset_step): f for f in findings if f.state == "resolved"}
    alerts = []
    for finding in findings:
        if finding.state != "firing":
            continue
        key = (finding.rule, finding.onset_step)
        last = final.get(key) or resolved.get(key) or finding
        end = resolved[key].step if key in resolved and key not in final else last_step
        alerts.append(
            Alert(
                rule=str(finding.rule),
                step=int(finding.step),
                severity=_severity(last),
                until=None if end is None else int(end),
            )
        )
    return alerts


def _severity(finding: Any) -> str:
    return str(getattr(finding.severity, "value", finding.severity))


def notifications_per_incident(run: CorpusRun, alerts: Iterable[Alert]) -> list[int]:
    """For each labelled incident of ``run``: how many warning-or-worse alerts were raised inside its window
    ``[onset − tolerance, end]`` (every one counts, storms included: a rule that resolves and re-fires is a
    second notification). An alert inside several windows is charged once, to the one that opened last,
    as :func:`charged_pages` charges ours."""
    alerts = [a for a in alerts if a.counts]
    windows = _windows(run)
    counts = [0] * len(windows)
    for alert in alerts:
        inside = [i for i, (lo, hi) in enumerate(windows) if lo <= alert.step <= hi]
        if inside:
            counts[_charged_to(inside, windows, alert.step)] += 1
    return counts


def _windows(run: CorpusRun) -> list[tuple[int, int]]:
    return [incident_window(run.labels, incident, run.last_step) for incident in run.labels.incidents]


def _charged_to(candidates: list[int], windows: list[tuple[int, int]], step: int) -> int:
    """Of the labelled incidents ``candidates`` (indices into ``windows``), the one a notification sent at
    ``step`` is charged to: the one whose window opened last by then (none had: the earliest)."""
    begun = [i for i in candidates if windows[i][0] <= step]
    if begun:
        return max(begun, key=lambda i: (windows[i][0], i))
    return min(candidates, key=lambda i: (windows[i][0], i))


# a labelled incident's kind -> the families of causes (rlvitals.analyzers.health.incidents.FAMILIES) that
# speak of it: an incident notification is about a labelled incident when one of its members' families is
# among these and its span overlaps the incident's window
LABEL_FAMILIES: dict[str, frozenset[str]] = {
    "zero_grad": frozenset({"collapse"}),
    "entropy_collapse": frozenset({"collapse"}),
    "length_collapse": frozenset({"collapse"}),
    "collapse": frozenset({"collapse"}),
    "reward_stagnation": frozenset({"reward_stagnation", "collapse"}),
    "entropy_explosion": frozenset({"degeneration"}),
    "length_explosion": frozenset({"degeneration"}),
    "truncation": frozenset({"degeneration"}),
    "reward_collapse": frozenset({"degeneration"}),
    "rollout_mismatch": frozenset({"degeneration"}),
    "grad_norm_spike": frozenset({"instability"}),
    "kl_blowup": frozenset({"instability"}),
    "clipfrac_high": frozenset({"instability"}),
}


def label_families(kind: str) -> frozenset[str]:
    return LABEL_FAMILIES.get(kind, frozenset({kind}))


@dataclass(frozen=True)
class Page:
    """One incident notification (``rlvitals.analyzers.health.notify``): the step it went out, its severity
    and event (opened, escalated, reopened, resolved), the incident's span and its members' families."""

    step: int
    severity: str
    event: str
    span: tuple[int, int]  # the incident's onset and its resolve step (the run's last step if still open)
    families: frozenset[str] = frozenset()

    @property
    def asks_attention(self) -> bool:
        """Opened, escalated or reopened (a resolve is an all-clear, not a page)."""
        return self.event != "resolved"


def incident_pages(updates: Iterable[Any], *, last_step: int, min_severity: str = "warning") -> list[Page]:
    """The notifications the incident updates of one run send at ``min_severity`` (the default notify
    level): the policy the server's webhooks and ``rlvitals import`` use."""
    from rlvitals.analyzers.health.incidents import family_of
    from rlvitals.analyzers.health.notify import notification_for, notified_after

    updates = list(updates)
    final = {u.number: u.incident for u in updates}
    notified: dict[int, str | None] = {}
    pages = []
    for update in updates:
        event = notification_for(update, notified=notified.get(update.number), min_severity=min_severity)
        notified[update.number] = notified_after(event, update.severity, notified.get(update.number))
        if event is None:
            continue
        record = final[update.number]
        end = record["resolved_step"] if record["state"] == "resolved" else last_step
        families = frozenset(family_of(m["cause"]) for m in record["members"].values())
        pages.append(Page(update.step, str(update.severity), event, (record["onset_step"], end), families))
    return pages


def speaks_of(
    span: tuple[int, int], families: frozenset[str], labels: RunLabels, incident: Any, last_step: int
) -> bool:
    """Whether a notification from an incident spanning ``span`` whose members are of ``families`` speaks
    of the labelled ``incident``: one of the families speaks of its kind and the span overlaps its window."""
    lo, hi = incident_window(labels, incident, last_step)
    return span[0] <= hi and span[1] >= lo and bool(label_families(incident.kind) & families)


def _about(page: Page, run: CorpusRun, incident: Any) -> bool:
    return speaks_of(page.span, page.families, run.labels, incident, run.last_step)


def charged_pages(run: CorpusRun, pages: Iterable[Page]) -> list[list[Page]]:
    """For each labelled incident of ``run``: the notifications charged to it. A notification is charged
    to exactly one labelled incident it speaks of (:func:`_about`): the one whose window had opened most
    recently when it went out (a page sent before every such window opened: the earliest of them). So a
    burst of labelled spikes that one open incident spans is charged page by page (the opening to the
    first spike, a reopen to the spike it reopened for), never every page to every spike; and no page is
    dropped: a storm inside one window is charged to it whole, a late reopen to the last window before it."""
    incidents = run.labels.incidents
    windows = _windows(run)
    charged: list[list[Page]] = [[] for _ in incidents]
    for page in pages:
        about = [i for i, incident in enumerate(incidents) if _about(page, run, incident)]
        if about:
            charged[_charged_to(about, windows, page.step)].append(page)
    return charged


def pages_per_incident(
    run: CorpusRun, pages: Iterable[Page], *, all_clear: bool = False, by_end: bool = False
) -> list[int]:
    """For each labelled incident of ``run``: the incident notifications charged to it
    (:func:`charged_pages`). Every one counts, storms included (a reopen or an escalation is another
    message); ``all_clear`` also counts the resolves; ``by_end`` only those sent by the end of its window."""
    pages = [p for p in pages if all_clear or p.asks_attention]
    counts = []
    for incident, mine in zip(run.labels.incidents, charged_pages(run, pages), strict=True):
        _, hi = incident_window(run.labels, incident, run.last_step)
        counts.append(sum(not by_end or p.step <= hi for p in mine))
    return counts


def told_per_incident(run: CorpusRun, pages: Iterable[Page], *, by_end: bool = False) -> list[bool]:
    """For each labelled incident of ``run``: whether any page (opened, escalated, reopened) spoke of it
    (:func:`_about`), charged to it or to an earlier incident it shares a page with; ``by_end``: one sent
    by the end of its window."""
    pages = [p for p in pages if p.asks_attention]
    told = []
    for incident in run.labels.incidents:
        _, hi = incident_window(run.labels, incident, run.last_step)
        told.append(any(_about(p, run, incident) and (not by_end or p.step <= hi) for p in pages))
    return told


def pages_elsewhere(run: CorpusRun, pages: Iterable[Page]) -> int:
    """Incident pages (opened, escalated, reopened) at warning or worse about no labelled incident of
    ``run`` (on a healthy run: every one of them), outside the run's ignore windows."""
    return sum(
        p.asks_attention
        and p.severity != "info"
        and not any(w.start <= p.step <= w.end for w in run.labels.ignore)
        and not any(_about(p, run, incident) for incident in run.labels.incidents)
        for p in pages
    )


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
    peer: str,
    runs: Iterable[CorpusRun],
    *,
    python: Path | None = None,
    run_timeout: float | None = None,
) -> dict[str, list[Alert] | None]:
    """Run ``peer`` over ``runs`` in its side environment; alerts per run id. With ``run_timeout`` (seconds)
    each run gets its own driver process and a run the peer does not finish in time maps to None (rldoctor
    re-diagnoses the whole history at every point, so a 10,000-step log takes it hours)."""
    import subprocess

    runs = list(runs)
    python = python or peer_python()
    if run_timeout is None:
        return _peer_call(peer, runs, python, timeout=1800)
    out: dict[str, list[Alert] | None] = {}
    for run in runs:
        try:
            out.update(_peer_call(peer, [run], python, timeout=run_timeout))
        except subprocess.TimeoutExpired:
            out[run.id] = None
    return out


def _peer_call(peer: str, runs: list[CorpusRun], python: Path, *, timeout: float) -> dict[str, list[Alert]]:
    import subprocess

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
        [str(python), str(DRIVER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{peer} driver failed ({done.returncode}):\n{done.stderr[-4000:]}")
    answer = json.loads(done.stdout)
    return {
        rid: [Alert(rule=r, step=int(s), severity=sev) for r, s, sev in rows] for rid, rows in answer.items()
    }
