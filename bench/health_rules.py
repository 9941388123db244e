"""Per-step cost of the health-rule engine (``HealthMonitor.observe``), ours at several commits and the
peers side by side.

The workload is one verl GRPO run's scalar stream: 12 metrics a step (the names verl logs: clip
fraction, ppo_kl, kl_loss, entropy, grad norm, score, reward std's spread, response length and its clip
ratio, pg_loss, the lower clip fraction, a rollout-vs-training probs diff), healthy noise from a fixed
seed, generated before the clock starts. Each version gets a fresh monitor per repeat and is fed the same
points in step order; the table reports the median over repeats of the time per step — CPU time of the
process (``time.process_time``), so a shared, oversubscribed machine does not charge one version for
another process's turn — and a digest of the findings each version produced (versions whose rules are
the same must agree).

Our versions are loaded from git: ``--ref REV`` extracts ``analyzers/health/`` at REV (a self-contained
package) into a temporary folder and imports it under its own name, so one process times them all, in
alternating order (REV, worktree, REV, ...) so they see the same machine load. ``worktree`` is this
checkout.

The peers (rldoctor 0.2.0, rlwatch 0.5.1, rlprobe 0.1.0, in their side environment, see
tests/support/sideenv.py; RLVITALS_SIDEENV_DIR shares one) are fed the same points through the live
path each documents (bench/_peer_driver.py) and timed inside the driver around that loop (CPU time of
the driver's process, all its threads, like ours). rldoctor and
rlprobe re-diagnose the whole history at every step, so their per-step cost grows with the run: they
run on the first ``--peer-steps`` points only and the table says so.

    python bench/health_rules.py                                 # worktree vs the wave-1 rules
    python bench/health_rules.py --ref HEAD~3 --steps 20000 --repeats 7
    python bench/health_rules.py --peers rldoctor,rlwatch,rlprobe --peer-steps 500
    python bench/health_rules.py --identical-to HEAD~1   # same findings and state as REV, every stream
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the rules before the issue-9 redesign (wave 1): the parent of the commit that brought them
WAVE1 = "ebf4b43^"


def workload(steps: int, seed: int = 0) -> list[tuple[int, dict[str, float]]]:
    rng = random.Random(seed)
    points = []
    for step in range(steps):
        learn = 1.0 - math.exp(-step / 3000.0)
        points.append(
            (
                step,
                {
                    "actor/pg_clipfrac": abs(rng.gauss(0.15, 0.02)),
                    "actor/ppo_kl": abs(rng.gauss(4e-4, 2e-4)),
                    "actor/kl_loss": 0.001 + 0.02 * learn + abs(rng.gauss(0, 5e-4)),
                    "actor/entropy": 0.6 - 0.2 * learn + rng.gauss(0, 0.01),
                    "actor/grad_norm": abs(rng.gauss(0.4, 0.05)),
                    "actor/pg_loss": rng.gauss(0.0, 0.02),
                    "actor/pg_clipfrac_lower": abs(rng.gauss(1e-4, 5e-5)),
                    "critic/score/mean": 0.2 + 0.5 * learn + rng.gauss(0, 0.02),
                    "critic/score/max": 1.0,
                    "critic/score/min": 0.0,
                    "response_length/mean": 300 + rng.gauss(0, 10),
                    "response_length/clip_ratio": abs(rng.gauss(0.02, 0.01)),
                },
            )
        )
    return points


def load_health(ref: str) -> object:
    """The health package at git revision ``ref`` (``worktree``: this checkout), imported under its own
    module name; returns its ``HealthMonitor`` class."""
    if ref == "worktree":
        from rlvitals.analyzers.health import HealthMonitor

        return HealthMonitor
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    target = Path(tempfile.mkdtemp(prefix=f"health_{sha}_"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", sha, "analyzers"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    # the health package under a parent of its own, so its relative imports of the rest of analyzers/
    # (``..batch_rules``) resolve to the same revision's files; only what it imports is loaded
    parent = f"_analyzers_at_{sha}"
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(parent, None, is_package=True))
    package.__path__ = [str(target / "analyzers")]
    sys.modules[parent] = package
    name = f"{parent}.health"
    spec = importlib.util.spec_from_file_location(
        name, target / "analyzers" / "health" / "__init__.py", submodule_search_locations=[]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.HealthMonitor


def run_once(monitor_cls, points) -> tuple[float, list]:
    monitor = monitor_cls()
    observe = monitor.observe
    findings = []
    started = time.process_time()
    for step, metrics in points:
        out = observe(step, metrics)
        if out:
            findings.extend(out)
    elapsed = time.process_time() - started
    return elapsed, findings


def digest(findings) -> str:
    rows = [
        [str(f.rule), f.state, f.step, f.onset_step, str(getattr(f.severity, "value", f.severity)), f.message]
        for f in findings
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:12]


def time_peers(peers: list[str], points) -> dict[str, float]:
    """Seconds each peer spends in its own live loop over ``points`` (timed inside the driver)."""
    from bench._detection import peer_python

    python = peer_python()
    request_run = {
        "id": "bench",
        "format": "verl-console",
        "algorithm": "grpo",
        "config": {},
        "points": points,
    }
    out = {}
    for peer in peers:
        request = {"peer": peer, "runs": [request_run], "timing": True}
        done = subprocess.run(
            [str(python), str(ROOT / "bench" / "_peer_driver.py")],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
        )
        out[peer] = json.loads(done.stdout)["__seconds__"]["bench"]
    return out


def _finding_rows(findings) -> list:
    return [json.dumps(f.to_dict(), sort_keys=True, default=str) for f in findings]


def identical(ref: str, *, corpus: bool = True) -> tuple[int, list[str]]:
    """Replay every synthetic scenario (bench/_synthetic.py, all seeds) and, when its files are here, the
    real-log corpus through the rules at ``ref`` and this checkout's: every finding (evidence included),
    the firing list and the final ``state_dict`` must be equal. Returns (streams compared, differences)."""
    from bench._synthetic import SCENARIOS, grpo_stream, run

    versions = {"ref": load_health(ref), "worktree": load_health("worktree")}
    streams, differences = 0, []
    for scenario in SCENARIOS.values():
        for seed in scenario.seeds:
            seen = {}
            for name, cls in versions.items():
                monitor = cls(settings=scenario.settings or None, run_config=scenario.run_config or None)
                stream = grpo_stream(seed, single_update=scenario.single_update)
                found = run(
                    stream, perturb=scenario.perturb, seed=seed, length=scenario.length, monitor=monitor
                )
                seen[name] = (
                    _finding_rows(found),
                    _finding_rows(monitor.firing()),
                    json.dumps(monitor.state_dict(), sort_keys=True),
                )
            streams += 1
            if seen["ref"] != seen["worktree"]:
                differences.append(f"{scenario.name}/seed{seed}")
    if corpus:
        from bench._detection import corpus_dir, load_corpus

        if corpus_dir() is not None:
            for corpus_run in load_corpus():
                seen = {}
                for name, cls in versions.items():
                    monitor = cls(run_config=corpus_run.history.config)
                    found = [
                        f
                        for step, metrics in corpus_run.history.points
                        for f in monitor.observe(step, metrics)
                    ]
                    seen[name] = (_finding_rows(found), json.dumps(monitor.state_dict(), sort_keys=True))
                streams += 1
                if seen["ref"] != seen["worktree"]:
                    differences.append(corpus_run.id)
    return streams, differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ref", action="append", help=f"git revisions to time (default: {WAVE1}, worktree)")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", default="", help="comma-separated: rldoctor,rlwatch,rlprobe")
    parser.add_argument("--peer-steps", type=int, default=500)
    parser.add_argument(
        "--identical-to",
        metavar="REV",
        help="check instead that the rules at REV and this checkout's give the same findings and state on "
        "every synthetic stream and the real-log corpus (exit 1 if not)",
    )
    args = parser.parse_args(argv)
    if args.identical_to:
        streams, differences = identical(args.identical_to)
        print(f"{streams} streams replayed through {args.identical_to} and the worktree: ", end="")
        print("findings, firing and state_dict identical" if not differences else f"differ on {differences}")
        return 1 if differences else 0
    refs = args.ref or [WAVE1, "worktree"]
    if "worktree" not in refs:
        refs.append("worktree")
    points = workload(args.steps)
    versions = {ref: load_health(ref) for ref in refs}
    times: dict[str, list[float]] = {ref: [] for ref in refs}
    digests: dict[str, str] = {}
    counts: dict[str, int] = {}
    for i in range(args.repeats):
        order = refs if i % 2 == 0 else refs[::-1]
        for ref in order:
            elapsed, findings = run_once(versions[ref], points)
            times[ref].append(elapsed / len(points))
            digests[ref], counts[ref] = digest(findings), len(findings)
    base = statistics.median(times["worktree"])
    print(
        f"HealthMonitor.observe per step: {args.steps:,} steps × 12 metrics (verl names), "
        f"median of {args.repeats} repeats, one process, alternating order"
    )
    print()
    print(
        "| version | CPU µs / step (median) | min–max | steps / s | ratio to worktree | findings | digest |"
    )
    print("|---|--:|--:|--:|--:|--:|---|")
    for ref in refs:
        med = statistics.median(times[ref])
        print(
            f"| {ref} | {med * 1e6:.1f} | {min(times[ref]) * 1e6:.1f}–{max(times[ref]) * 1e6:.1f} | "
            f"{1 / med:,.0f} | {med / base:.2f}× | {counts[ref]} | `{digests[ref]}` |"
        )
    peers = [p for p in args.peers.split(",") if p]
    if peers:
        short = points[: args.peer_steps]
        ours = statistics.median(run_once(versions["worktree"], short)[0] for _ in range(args.repeats))
        print()
        print(f"Peers, on the first {len(short):,} steps (their cost per step grows with the run)")
        print()
        print("| detector | CPU µs / step | ratio to rlvitals (worktree) |")
        print("|---|--:|--:|")
        print(f"| rlvitals (worktree) | {ours / len(short) * 1e6:.1f} | 1.00× |")
        for peer, seconds in time_peers(peers, short).items():
            print(f"| {peer} | {seconds / len(short) * 1e6:.1f} | {seconds / ours:.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
