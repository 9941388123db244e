"""Detection quality on the labelled real-log corpus: rlvitals' health rules against the peers.

Every run of tests/data/real_logs/ (see docs/detection.md) is read by the importer ``rlvitals import``
uses and fed, point by point, to our ``HealthMonitor`` and to each peer — rldoctor 0.2.0, rlwatch 0.5.1,
rlprobe 0.1.0, in their side environment (tests/support/sideenv.py; set RLVITALS_SIDEENV_DIR to share
one) — through the live path each documents. Scoring (rlvitals.analyzers.health.scoring): an incident
is caught by a warning-or-worse alert in [onset − tolerance, end]; any other warning-or-worse alert is
false; info alerts are counted apart.

    python bench/detection.py                 # ours and every peer
    python bench/detection.py --no-peers      # ours only (seconds)
    python bench/detection.py --runs ID,ID --peers rlwatch --json out.json
    python bench/detection.py --synthetic     # the synthetic incident corpus (bench/_synthetic.py), ours only
    python bench/detection.py --synthetic --runs healthy,non_finite   # scenarios by name
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlvitals.analyzers.health.scoring import RunScore, Tally, score_run, tally

from bench._detection import PEER_VERSIONS, PEERS, load_corpus, our_alerts, peer_alerts

OURS = "rlvitals"


def _delay(t: Tally) -> str:
    return "—" if t.median_delay is None else f"{t.median_delay:+g}"


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
            f"| {name} | {overall.caught}/{incidents} | {overall.missed} | {_delay(overall)} | "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", help="comma-separated run ids (default: the whole corpus)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers (default: all)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--json", help="also write the per-run scores here")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="score the synthetic incident corpus (bench/_synthetic.py) instead, ours only; --runs names scenarios",
    )
    args = parser.parse_args(argv)
    only = args.runs.split(",") if args.runs else None
    results: dict[str, list[RunScore]] = {}
    timings = {}
    started = time.perf_counter()
    if args.synthetic:
        from bench._synthetic import load_synthetic

        runs = load_synthetic(only)
        if not runs:
            parser.error("no such scenario in the synthetic corpus")
        results[OURS] = [r.score() for r in runs]
    else:
        runs = load_corpus(only=only)
        if not runs:
            parser.error("no such run in the corpus")
        results[OURS] = [score_run(r.labels, our_alerts(r), last_step=r.last_step) for r in runs]
    timings[OURS] = time.perf_counter() - started
    peers = [] if args.no_peers or args.synthetic else [p for p in args.peers.split(",") if p]
    for peer in peers:
        if peer not in PEERS:
            parser.error(f"unknown peer {peer!r}; expected one of {', '.join(PEERS)}")
        started = time.perf_counter()
        alerts = peer_alerts(peer, runs)
        label = f"{peer} {PEER_VERSIONS[peer]}"
        results[label] = [score_run(r.labels, alerts[r.id], last_step=r.last_step) for r in runs]
        timings[label] = time.perf_counter() - started
    print(render(results, runs, corpus="synthetic streams" if args.synthetic else "real runs"))
    print("\nwall time: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
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
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
