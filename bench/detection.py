"""Detection quality on the labelled real-log corpus: rlvitals' health rules against the peers, per part.

The corpus (tests/data/real_logs/manifest.json, docs/detection.md) has three parts, reported apart:
``tuning`` (the runs the rules may be tuned on), ``heldout`` (drawn once by a seeded rule; no threshold is
ever tuned on it) and ``more`` (../shared/real_logs/more/, a third check nobody tunes on). Every run is read
by the importer ``rlvitals import`` uses and fed, point by point, to our ``HealthMonitor`` and to each peer
— rldoctor 0.2.0, rlwatch 0.5.1, rlprobe 0.1.0, in their side environment (tests/support/sideenv.py; set
RLVITALS_SIDEENV_DIR to share one) — through the live path each documents. Scoring
(rlvitals.analyzers.health.scoring): an incident is caught by a warning-or-worse alert in
[onset − tolerance, end]; per part the summary gives

- incidents caught / labelled;
- false alarms: warning-or-worse alerts on healthy runs (outside their ignore windows), and apart the
  warning-or-worse alerts on unhealthy runs outside every incident and ignore window;
- notifications per incident, median over the incidents that got at least one: what a user is paged
  with. Ours are incident notifications (``rlvitals.analyzers.health.notify``: an incident opened,
  escalated or reopened at warning or worse, the policy the server's webhooks use) about the incident — of
  a cause family that speaks of its kind, from an incident overlapping its window — each charged to one
  labelled incident, the one whose window opened last before it went out (bench/_detection.py
  ``charged_pages``); a peer has no incidents, so each of its warning-or-worse alerts inside the window is
  one notification. Storms count: a reopen, an escalation, a rule that closes and re-fires is charged
  each time. Beside it, ours: how many incidents a page spoke of and how many had one charged to them,
  the median with the all-clear (resolved) messages counted too, the warning pages on healthy runs and
  the alert-level count this replaced;
- median detection delay: first warning-or-worse alert's step − labelled onset.

Runs whose file is absent from the corpus folder are left out and counted (CI has the first 13 runs and
more/; bench/build_corpus.py rebuilds the rest).

    python bench/detection.py                      # every part, ours and every peer
    python bench/detection.py --no-peers           # ours only (seconds)
    python bench/detection.py --part heldout --detail      # one part, with the per-rule/per-incident tables
    python bench/detection.py --runs ID,ID --peers rlwatch --json out.json
    python bench/detection.py --synthetic          # the synthetic incident corpus (bench/_synthetic.py), ours only
    python bench/detection.py --synthetic --runs healthy,non_finite   # scenarios by name
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlvitals.analyzers.health.scoring import RunScore, Tally, score_run, tally

from bench._detection import (
    PARTS,
    PEER_VERSIONS,
    PEERS,
    corpus_files,
    load_corpus,
    notifications_per_incident,
    our_run,
    pages_elsewhere,
    pages_per_incident,
    peer_alerts,
    told_per_incident,
)

OURS = "rlvitals"


def _delay(t: Tally) -> str:
    return "—" if t.median_delay is None else f"{t.median_delay:+g}"


def _median(values: list[int]) -> str:
    return "—" if not values else f"{statistics.median(values):g}"


@dataclass
class OurPages:
    """Our incident notifications over one part, per labelled incident (bench/_detection.py)."""

    pages: list[int] = field(default_factory=list)  # opened / escalated / reopened charged to each incident
    told: list[bool] = field(default_factory=list)  # some page spoke of it (charged to it or shared)
    timely: list[bool] = field(default_factory=list)  # the same, a page sent by the end of its window
    messages: list[int] = field(default_factory=list)  # the same with the all-clear (resolved) messages
    alerts: list[int] = field(default_factory=list)  # warning+ alerts in the window (the old count)
    on_healthy: int = 0  # warning+ pages on healthy runs (outside their ignore windows)
    elsewhere: int = 0  # warning+ pages about no labelled incident of an unhealthy run

    def line(self) -> str:
        paged = [n for n in self.pages if n]
        return (
            f"{OURS} incident notifications: {sum(self.told)}/{len(self.pages)} labelled incidents paged "
            f"({sum(self.timely)} by the end of their window; {len(paged)} with a page charged to them, the "
            f"others told by one charged to another); per charged incident median {_median(paged)}, "
            f"max {max(paged, default=0)}, "
            f"{_median([m for n, m in zip(self.pages, self.messages, strict=True) if n])} with the all-clear "
            f"messages; {self.on_healthy} warning pages on healthy runs, {self.elsewhere} about no labelled "
            f"incident of an unhealthy run (alert-level count before incidents: median "
            f"{_median([n for n in self.alerts if n])} per incident)"
        )


def render_summary(
    results: dict[str, list[RunScore]],
    notifications: dict[str, list[int]],
    runs,
    *,
    part: str,
    absent: int,
    timed_out: dict[str, list[str]] | None = None,
    ours: OurPages | None = None,
) -> str:
    incidents = sum(len(r.labels.incidents) for r in runs)
    healthy = sum(r.labels.healthy for r in runs)
    repos = len({r.entry["source"]["repository"] for r in runs})
    head = (
        f"Part {part}: {len(runs)} runs from {repos} repositories ({healthy} healthy, {incidents} labelled "
        f"incidents)"
        + (f"; {absent} run(s) of this part absent from the corpus folder, left out" if absent else "")
    )
    lines = [
        head,
        "",
        "| detector | incidents caught | false alarms on healthy runs | other false alerts | "
        "notifications per incident (median) | median delay (steps) |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    timed_out = timed_out or {}
    for name, scores in results.items():
        overall, _ = tally(scores)
        total = sum(len(s.incidents) for s in scores)
        lines.append(
            f"| {name} | {overall.caught}/{total} | {overall.false_on_healthy} | "
            f"{overall.false_alerts - overall.false_on_healthy} | {_median(notifications[name])} | {_delay(overall)} |"
        )
    if ours is not None:
        lines.append("\n" + ours.line())
    for name, ids in timed_out.items():
        if ids:
            lines.append(
                f"\n{name}: not finished within the per-run limit, left out of its row: {', '.join(ids)}"
            )
    return "\n".join(lines)


def render(results: dict[str, list[RunScore]], runs, *, corpus: str = "real runs") -> str:
    incidents = sum(len(r.labels.incidents) for r in runs)
    healthy = sum(r.labels.healthy for r in runs)
    lines = [
        f"Detection on {len(runs)} {corpus} ({healthy} healthy, {incidents} labelled incidents); "
        "delay = first warning+ alert step − labelled onset (median, steps; negative = early)",
        "",
        "| detector | caught | missed | median delay | true alerts | false alerts | of which on healthy runs | info |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    per_rule = {}
    for name, scores in results.items():
        overall, rules = tally(scores)
        per_rule[name] = rules
        lines.append(
            f"| {name} | {overall.caught}/{overall.caught + overall.missed} | {overall.missed} | {_delay(overall)} | "
            f"{overall.true_alerts} | {overall.false_alerts} | {overall.false_on_healthy} | {overall.info_alerts} |"
        )
    lines += [
        "",
        "Per rule",
        "",
        "| detector | rule | incidents caught | median delay | true | false | on healthy | info |",
    ]
    lines.append("|---|---|--:|--:|--:|--:|--:|--:|")
    for name, rules in per_rule.items():
        for rule, t in sorted(rules.items()):
            lines.append(
                f"| {name} | `{rule}` | {t.caught} | {_delay(t)} | {t.true_alerts} | {t.false_alerts} | "
                f"{t.false_on_healthy} | {t.info_alerts} |"
            )
    names = list(results)
    lines += ["", "Per incident (first warning+ alert's delay in steps, or miss)", ""]
    lines.append("| run | incident | onset–end | " + " | ".join(names) + " |")
    lines.append("|---|---|---|" + "--:|" * len(names))
    by_run = {name: {s.run_id: s for s in scores} for name, scores in results.items()}
    for run in runs:
        for i, incident in enumerate(run.labels.incidents):
            cells = []
            for name in names:
                if run.id not in by_run[name]:
                    cells.append("not run")
                    continue
                result = by_run[name][run.id].incidents[i]
                cells.append(f"{result.delay:+d}" if result.caught else "miss")
            end = "…" if incident.end is None else incident.end
            lines.append(
                f"| {run.id} | {incident.kind} | {incident.onset}–{end} | " + " | ".join(cells) + " |"
            )
    lines += ["", "False alerts (warning+ outside every incident and ignore window)", ""]
    for name, scores in results.items():
        false = [f"{s.run_id}: {a.rule}@{a.step}" for s in scores for a in s.false_alerts]
        lines.append(f"- {name}: " + ("; ".join(false) if false else "none"))
    return "\n".join(lines)


def _score_corpus(
    runs, peers: list[str], run_timeout: float | None = None
) -> tuple[dict[str, list[RunScore]], dict[str, list[int]], dict[str, float], dict[str, list[str]], OurPages]:
    results: dict[str, list[RunScore]] = {}
    notifications: dict[str, list[int]] = {}
    timings: dict[str, float] = {}
    timed_out: dict[str, list[str]] = {}
    started = time.perf_counter()
    ours = {r.id: our_run(r) for r in runs}
    alerts = {rid: got[0] for rid, got in ours.items()}
    results[OURS] = [score_run(r.labels, alerts[r.id], last_step=r.last_step) for r in runs]
    mine = OurPages()
    for r in runs:
        pages = ours[r.id][1]
        mine.pages += pages_per_incident(r, pages)
        mine.told += told_per_incident(r, pages)
        mine.timely += told_per_incident(r, pages, by_end=True)
        mine.messages += pages_per_incident(r, pages, all_clear=True)
        mine.alerts += notifications_per_incident(r, alerts[r.id])
        if r.labels.healthy:
            mine.on_healthy += pages_elsewhere(r, pages)
        else:
            mine.elsewhere += pages_elsewhere(r, pages)
    notifications[OURS] = [n for n in mine.pages if n]
    timings[OURS] = time.perf_counter() - started
    for peer in peers:
        started = time.perf_counter()
        alerts = peer_alerts(peer, runs, run_timeout=run_timeout)
        label = f"{peer} {PEER_VERSIONS[peer]}"
        scored = [r for r in runs if alerts[r.id] is not None]
        timed_out[label] = [r.id for r in runs if alerts[r.id] is None]
        results[label] = [score_run(r.labels, alerts[r.id], last_step=r.last_step) for r in scored]
        notifications[label] = [n for r in scored for n in notifications_per_incident(r, alerts[r.id]) if n]
        timings[label] = time.perf_counter() - started
    return results, notifications, timings, timed_out, mine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part", choices=PARTS, action="append", help="a part to report (default: all three)"
    )
    parser.add_argument("--runs", help="comma-separated run ids (default: every run of the parts)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers (default: all)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--detail", action="store_true", help="also print the per-rule and per-incident tables"
    )
    parser.add_argument("--json", help="also write the per-run scores here")
    parser.add_argument(
        "--peer-run-timeout",
        type=float,
        default=900,
        help="seconds a peer may spend on one run; a run it does not finish is left out of its row, and "
        "said so (default 900; 0: no limit, all runs in one call)",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="score the synthetic incident corpus (bench/_synthetic.py) instead, ours only; --runs names scenarios",
    )
    args = parser.parse_args(argv)
    args.peer_run_timeout = args.peer_run_timeout or None
    only = args.runs.split(",") if args.runs else None
    if args.synthetic:
        from bench._synthetic import load_synthetic

        started = time.perf_counter()
        runs = load_synthetic(only)
        if not runs:
            parser.error("no such scenario in the synthetic corpus")
        print(render({OURS: [r.score() for r in runs]}, runs, corpus="synthetic streams"))
        print(f"\nwall time: {OURS} {time.perf_counter() - started:.1f}s")
        return 0
    peers = [] if args.no_peers else [p for p in args.peers.split(",") if p]
    for peer in peers:
        if peer not in PEERS:
            parser.error(f"unknown peer {peer!r}; expected one of {', '.join(PEERS)}")
    dump = {}
    for part in args.part or PARTS:
        runs = load_corpus(only=only, part=part, skip_absent=True)
        absent = len(corpus_files(part)) - len(runs) if only is None else 0
        if not runs:
            if absent:
                why = f"{absent} run(s) absent from the corpus folder"
            elif part == "heldout":
                why = "the manifest holds none: every held-out batch scored and read has been retired, until "
                why += "fresh ones are labelled blind"
            else:
                why = "the manifest holds none"
            print(f"Part {part}: no run of this part here ({why})\n")
            continue
        results, notifications, timings, timed_out, mine = _score_corpus(runs, peers, args.peer_run_timeout)
        print(
            render_summary(
                results, notifications, runs, part=part, absent=absent, timed_out=timed_out, ours=mine
            )
        )
        if args.detail or only:
            print("\n" + render(results, runs, corpus=f"{part} runs"))
        print("\nwall time: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) + "\n")
        dump[part] = {
            name: [
                {
                    "run": s.run_id,
                    "true": [[a.rule, a.step, a.severity] for a in s.true_alerts],
                    "false": [[a.rule, a.step, a.severity] for a in s.false_alerts],
                    "info": [[a.rule, a.step] for a in s.info_alerts],
                    "incidents": [
                        [r.incident.kind, r.incident.onset, r.caught, r.delay, list(r.rules)]
                        for r in s.incidents
                    ],
                }
                for s in scores
            ]
            for name, scores in results.items()
        }
        dump[part]["rlvitals_pages"] = {
            "pages": mine.pages,
            "timely": mine.timely,
            "messages": mine.messages,
            "alerts": mine.alerts,
            "on_healthy": mine.on_healthy,
            "elsewhere": mine.elsewhere,
        }
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
