"""Ingest and history-query benchmark: rlvitals against MLflow's tracking server and trackio.

Every server runs on loopback with an embedded SQLite database, started fresh by this script, and
gets the same workload in the same run (one run, 12 metrics per step, PPO/GRPO-like values):

1. per step:   one request per step, 2,000 steps (the way a trainer logs by default);
2. batched:    100 steps per request, 20,000 steps;
3. 8 trainers: eight runs at once, one request per step each, 250 steps each;
4. history:    every point of one metric, and of all 12, over the 20,000 batched steps (median of
               ``--repeats``; every answer is counted and must hold all 20,000 points);
5. memory:     peak RSS summed over the server's process tree (supervisor + workers), and PSS.

Ingest throughput is the median over five equal time windows of the phase (robust to a neighbour
stealing the CPU for a second); p50/p99 are per logical request (MLflow's 1,200-metric batches go out
as two log-batch calls, as its client splits them). Each phase stops at ``--max-seconds``; the ``n``
column says how many requests ran. A keep-alive probe (100 small GETs on one connection) shows
whether a server pays the ~40 ms Nagle/delayed-ACK stall of uvicorn#3149 (``--workers N`` listeners
without TCP_NODELAY).

Peers live in their own virtual environments, outside this repository, found by flag, environment
variable or the default ``<checkout>/../peer-venvs/{mlflow,trackio}/bin/python``; a peer that is not
installed is skipped with a line saying how to install it (or run ``--install-peers``)::

    .venv/bin/python bench/ingest.py                 # full run, a few minutes on 2 cores
    .venv/bin/python bench/ingest.py --quick         # smaller workload, about a minute
    .venv/bin/python bench/ingest.py --only rlvitals,trackio --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers import BenchError, Conn, Mlflow, Req, Rlvitals, Step, Target, Trackio, check_bulk_reply
from _servers import RssSampler, free_port, tree_pids, tree_pss, wait_idle

REPO = Path(__file__).resolve().parent.parent
METRIC_NAMES = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/kl_loss",
    "actor/pg_clipfrac_lower",
    "actor/lr",
    "critic/score/mean",
    "critic/rewards/mean",
    "response_length/mean",
    "timing_s/step",
)
TARGET_NAMES = ("rlvitals", "rlvitals-workers", "mlflow", "mlflow-1", "trackio")


# ----------------------------------------------------------------------------------------- workload


def make_steps(n: int, *, seed: int, start: int = 0) -> list[Step]:
    """``n`` steps of the 12 metrics: healthy PPO/GRPO-like values with noise and slow trends."""
    rng = random.Random(seed)
    t0 = time.time()
    steps = []
    for s in range(start, start + n):
        frac = s / 20_000
        metrics = {
            "actor/pg_loss": rng.gauss(0.0, 0.05),
            "actor/pg_clipfrac": min(max(rng.gauss(0.2, 0.02), 0.12), 0.28),
            "actor/ppo_kl": abs(rng.gauss(0.004, 0.001)),
            "actor/entropy": 1.5 - 0.2 * frac + rng.gauss(0.0, 0.02),
            "actor/grad_norm": abs(rng.gauss(0.5, 0.1)),
            "actor/kl_loss": abs(rng.gauss(0.01, 0.002)),
            "actor/pg_clipfrac_lower": abs(rng.gauss(0.001, 0.0003)),
            "actor/lr": 1e-6,
            "critic/score/mean": 0.3 + 0.4 * frac + rng.gauss(0.0, 0.05),
            "critic/rewards/mean": 0.3 + 0.4 * frac + rng.gauss(0.0, 0.05),
            "response_length/mean": 512.0 + rng.gauss(0.0, 30.0),
            "timing_s/step": 30.0 + rng.gauss(0.0, 2.0),
        }
        steps.append((s, metrics, t0 + 30.0 * s))
    return steps


@dataclass
class Workload:
    per_step: int = 2_000
    batched_steps: int = 20_000
    batch: int = 100
    trainers: int = 8
    trainer_steps: int = 250
    repeats: int = 5
    warmup: int = 50
    max_seconds: float = 30.0
    batched_max_seconds: float = 120.0

    @classmethod
    def quick(cls) -> Workload:
        return cls(per_step=500, batched_steps=5_000, trainer_steps=60, repeats=3, max_seconds=10.0,
                   batched_max_seconds=40.0)  # fmt: skip


# ------------------------------------------------------------------------------------------ phases


@dataclass
class Phase:
    """One ingest phase: per-request latencies and (completion time, points) per request."""

    name: str
    requests: int = 0
    points: int = 0
    seconds: float = 0.0
    capped: bool = False
    latencies: list[float] = field(default_factory=list)
    completions: list[tuple[float, int]] = field(default_factory=list)
    start: float = 0.0

    def rate(self, windows: int = 5) -> float:
        """Median points/s over ``windows`` equal time slices of the phase (total rate if too short)."""
        if not self.completions or self.seconds <= 0:
            return 0.0
        k = min(windows, max(1, len(self.completions) // 10))
        if k == 1:
            return self.points / self.seconds
        width = self.seconds / k
        bins = [0] * k
        for t, pts in self.completions:
            bins[min(int((t - self.start) / width), k - 1)] += pts
        return statistics.median(b / width for b in bins)

    def pct(self, q: float) -> float:
        if not self.latencies:
            return math.nan
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def summary(self) -> dict:
        return {
            "requests": self.requests,
            "points": self.points,
            "seconds": round(self.seconds, 3),
            "capped": self.capped,
            "points_per_s_median": round(self.rate(), 1),
            "points_per_s_total": round(self.points / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": round(self.pct(0.5) * 1e3, 2),
            "p99_ms": round(self.pct(0.99) * 1e3, 2),
        }


def _send(conn: Conn, target: Target, reqs: Sequence[Req]) -> None:
    for req in reqs:
        check_bulk_reply(target, conn.call(req))


def run_sequential(name: str, conn: Conn, target: Target, ops: Sequence[tuple[list[Req], int]],
                   max_seconds: float) -> Phase:  # fmt: skip
    phase = Phase(name, start=time.perf_counter())
    deadline = phase.start + max_seconds
    for reqs, points in ops:
        t = time.perf_counter()
        _send(conn, target, reqs)
        done = time.perf_counter()
        phase.latencies.append(done - t)
        phase.completions.append((done, points))
        phase.requests += 1
        phase.points += points
        if done > deadline:
            phase.capped = phase.requests < len(ops)
            break
    phase.seconds = time.perf_counter() - phase.start
    return phase


def run_concurrent(name: str, port: int, target: Target, per_worker: Sequence[Sequence[tuple[list[Req], int]]],
                   max_seconds: float) -> Phase:  # fmt: skip
    """Each worker thread is one trainer with its own keep-alive connection."""
    phase = Phase(name)
    lock = threading.Lock()
    barrier = threading.Barrier(len(per_worker) + 1)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(ops: Sequence[tuple[list[Req], int]]) -> None:
        conn = Conn(port)
        try:
            barrier.wait()
            deadline = time.perf_counter() + max_seconds
            for reqs, points in ops:
                if stop.is_set():
                    return
                t = time.perf_counter()
                _send(conn, target, reqs)
                done = time.perf_counter()
                with lock:
                    phase.latencies.append(done - t)
                    phase.completions.append((done, points))
                    phase.requests += 1
                    phase.points += points
                if done > deadline:
                    return
        except BaseException as exc:  # reported by the main thread; the other trainers stop
            errors.append(exc)
            stop.set()
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(ops,), daemon=True) for ops in per_worker]
    for th in threads:
        th.start()
    barrier.wait()
    phase.start = time.perf_counter()
    for th in threads:
        th.join()
    phase.seconds = time.perf_counter() - phase.start
    phase.capped = phase.requests < sum(len(ops) for ops in per_worker)
    if errors:
        raise errors[0]
    return phase


def keepalive_probe(conn: Conn, path: str, n: int = 100) -> float:
    """Median seconds of ``n`` small GETs on one keep-alive connection (after a warm-up)."""
    conn.call(Req("GET", path))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        conn.call(Req("GET", path))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_history(conn: Conn, target: Target, run, names: Sequence[str], expect: int, repeats: int,
                  budget: float) -> dict:  # fmt: skip
    times = []
    end = time.perf_counter() + budget
    for _ in range(repeats):
        t = time.perf_counter()
        counts = target.history(conn, run, names)
        times.append(time.perf_counter() - t)
        short = {k: v for k, v in counts.items() if v != expect}
        if short:
            raise BenchError(f"{target.label}: history returned {short} points, expected {expect} each")
        if time.perf_counter() > end:
            break
    return {"seconds_median": statistics.median(times), "repeats": len(times), "points": expect * len(names)}


# ------------------------------------------------------------------------------------------ a target


def bench_target(target: Target, work: Workload, workdir: Path, log) -> dict:
    port = free_port()
    server = target.server(workdir, port)
    t_start = time.perf_counter()
    with server.start(timeout=180):
        startup = time.perf_counter() - t_start
        settled = wait_idle(server.pid)
        log(
            f"  {target.label}: up in {startup:.1f}s on port {port} (pid {server.pid}), idle after {settled:.1f}s"
        )
        with RssSampler(server.pid) as rss:
            rss_idle = rss.sample()
            conn = Conn(port)
            try:
                probe = keepalive_probe(conn, target.probe_path())
                log(f"  keep-alive GET p50 {probe * 1e3:.2f} ms")
                # Warm-up on a run of its own: first-request work (imports, caches, prepared
                # statements) is start-up cost, not ingest throughput.
                warm = target.create_run(conn, "warm-up")
                for step in make_steps(work.warmup, seed=0):
                    _send(conn, target, target.log_requests(warm, [step]))
                target.history(conn, warm, METRIC_NAMES[:1])

                run = target.create_run(conn, "per-step")
                ops = [(target.log_requests(run, [s]), len(METRIC_NAMES))
                       for s in make_steps(work.per_step, seed=1)]  # fmt: skip
                per_step = run_sequential("per_step", conn, target, ops, work.max_seconds)
                log(f"  per step:   {per_step.rate():10.0f} points/s  p50 {per_step.pct(0.5) * 1e3:.2f} ms")

                run_b = target.create_run(conn, "batched")
                data = make_steps(work.batched_steps, seed=2)
                ops = [(target.log_requests(run_b, data[i : i + work.batch]), len(METRIC_NAMES) * len(data[i : i + work.batch]))
                       for i in range(0, len(data), work.batch)]  # fmt: skip
                batched = run_sequential("batched", conn, target, ops, work.batched_max_seconds)
                log(f"  batched:    {batched.rate():10.0f} points/s  p50 {batched.pct(0.5) * 1e3:.2f} ms")

                per_worker = []
                for i in range(work.trainers):
                    run_t = target.create_run(conn, f"trainer-{i}")
                    per_worker.append([(target.log_requests(run_t, [s]), len(METRIC_NAMES))
                                       for s in make_steps(work.trainer_steps, seed=10 + i)])  # fmt: skip
                trainers = run_concurrent("trainers", port, target, per_worker, work.max_seconds)
                log(
                    f"  {work.trainers} trainers: {trainers.rate():10.0f} points/s  p50 {trainers.pct(0.5) * 1e3:.2f} ms"
                )

                steps_b = batched.points // len(METRIC_NAMES)
                budget = max(work.max_seconds, 10.0)
                hist1 = timed_history(conn, target, run_b, METRIC_NAMES[:1], steps_b, work.repeats, budget)
                hist12 = timed_history(conn, target, run_b, METRIC_NAMES, steps_b, work.repeats, budget)
                log(f"  history:    1 metric {hist1['seconds_median'] * 1e3:.1f} ms, "
                    f"12 metrics {hist12['seconds_median'] * 1e3:.1f} ms over {steps_b} steps")  # fmt: skip
            finally:
                conn.close()
            rss_end = rss.sample()
            pss_end = tree_pss(server.pid)
            processes = len(tree_pids(server.pid))
        rss_peak = rss.peak
    db_bytes = sum(
        p.stat().st_size for p in workdir.rglob("*") if p.is_file() and not p.name.endswith(".log")
    )
    return {
        "label": target.label,
        "kind": target.kind,
        "startup_s": round(startup, 2),
        "idle_after_s": round(settled, 1),
        "keepalive_get_p50_ms": round(probe * 1e3, 3),
        "per_step": per_step.summary(),
        "batched": batched.summary(),
        "trainers": trainers.summary(),
        "history_1": hist1,
        "history_12": hist12,
        "history_steps": steps_b,
        "rss_idle_mib": round(rss_idle / 2**20, 1),
        "rss_peak_mib": round(rss_peak / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "pss_end_mib": round(pss_end / 2**20, 1),
        "processes": processes,
        "disk_mib": round(db_bytes / 2**20, 1),
    }


# ------------------------------------------------------------------------------------------- peers


def _default_peer_python(venvs: Path, name: str) -> Path:
    return venvs / name / "bin" / "python"


def _has_module(python: str, module: str) -> bool:
    if not Path(python).exists():
        return False
    try:
        subprocess.run([python, "-c", f"import {module}"], check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return False
    return True


def _serve_supports_workers(python: str) -> bool:
    try:
        out = subprocess.run([python, "-m", "rlvitals.cli", "serve", "--help"], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    except (subprocess.TimeoutExpired, OSError):
        return False
    return "--workers" in out.stdout


def install_peers(venvs: Path) -> None:
    """Create ``venvs/mlflow`` and ``venvs/trackio`` with the peers from PyPI (no torch needed)."""
    for name in ("mlflow", "trackio"):
        env = venvs / name
        if not (env / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", name], check=True)


def select_targets(args: argparse.Namespace, log) -> list[Target]:
    only = set(args.only.split(",")) if args.only else set(TARGET_NAMES)
    unknown = only - set(TARGET_NAMES)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {', '.join(TARGET_NAMES)}")
    targets: list[Target] = []
    if "rlvitals" in only:
        targets.append(Rlvitals(args.rlvitals_python))
    if "rlvitals-workers" in only and args.rlvitals_workers > 1:
        if _serve_supports_workers(args.rlvitals_python):
            targets.append(Rlvitals(args.rlvitals_python, workers=args.rlvitals_workers))
        else:
            log("skip rlvitals --workers: this `rlvitals serve` has no --workers option")
    mlflow_py, trackio_py = args.mlflow_python, args.trackio_python
    if {"mlflow", "mlflow-1"} & only:
        if _has_module(mlflow_py, "mlflow"):
            if "mlflow" in only:
                targets.append(Mlflow(mlflow_py))
            if "mlflow-1" in only:
                targets.append(Mlflow(mlflow_py, workers=1))
        else:
            log(f"skip MLflow: no interpreter with mlflow at {mlflow_py} (pass --mlflow-python, set "
                f"RLVITALS_BENCH_MLFLOW_PYTHON, or run --install-peers)")  # fmt: skip
    if "trackio" in only:
        if _has_module(trackio_py, "trackio"):
            targets.append(Trackio(trackio_py))
        else:
            log(f"skip trackio: no interpreter with trackio at {trackio_py} (pass --trackio-python, set "
                f"RLVITALS_BENCH_TRACKIO_PYTHON, or run --install-peers)")  # fmt: skip
    return targets


# ------------------------------------------------------------------------------------------ report


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def _fmt_ms(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _fmt_ratio(x: float) -> str:
    if not math.isfinite(x):
        return "—"
    return f"{x:,.0f}×" if x >= 10 else f"{x:.1f}×"


def render(results: list[dict], work: Workload) -> str:
    lines = []
    lines.append(
        f"Ingest ({len(METRIC_NAMES)} metrics/step; points/s = median of 5 time windows; ms per request)"
    )
    lines.append("")
    lines.append("| server | per step pts/s | p50 | p99 | batched ×100 pts/s | p50 | p99 | "
                 f"{work.trainers} trainers pts/s | p50 | p99 |")  # fmt: skip
    lines.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        cells = [r["label"]]
        for key in ("per_step", "batched", "trainers"):
            p = r[key]
            mark = "*" if p["capped"] else ""
            cells += [_fmt_rate(p["points_per_s_median"]) + mark, _fmt_ms(p["p50_ms"]), _fmt_ms(p["p99_ms"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    steps = {r["history_steps"] for r in results}
    lines.append(
        f"Queries over {', '.join(map(str, sorted(steps)))} steps (median), memory, keep-alive probe"
    )
    lines.append("")
    lines.append("| server | 1 metric ms | 12 metrics ms | RSS peak MiB | PSS end MiB | processes | "
                 "keep-alive GET p50 ms | startup s |")  # fmt: skip
    lines.append("|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        lines.append(
            f"| {r['label']} | {_fmt_ms(r['history_1']['seconds_median'] * 1e3)} | "
            f"{_fmt_ms(r['history_12']['seconds_median'] * 1e3)} | {r['rss_peak_mib']:,.0f} | "
            f"{r['pss_end_mib']:,.0f} | {r['processes']} | {_fmt_ms(r['keepalive_get_p50_ms'])} | {r['startup_s']} |"
        )
    if any(r[k]["capped"] for r in results for k in ("per_step", "batched", "trainers")):
        lines.append("")
        lines.append(f"* stopped at the time cap ({work.max_seconds:.0f}s; batched {work.batched_max_seconds:.0f}s):"
                     " the rate is over the requests that ran.")  # fmt: skip
    ours = [r for r in results if r["kind"] == "rlvitals"]
    peers = [r for r in results if r["kind"] != "rlvitals"]
    if ours and peers:
        lines.append("")
        lines.append("Ratios (rlvitals ÷ peer for throughput; peer ÷ rlvitals for time and memory)")
        lines.append("")
        lines.append(
            "| rlvitals vs | per step | batched | trainers | 1-metric history | 12-metric history | RSS |"
        )
        lines.append("|---|--:|--:|--:|--:|--:|--:|")
        for o in ours:
            for p in peers:
                lines.append(
                    "| "
                    + " | ".join([f"{o['label']} vs {p['label']}", *map(_fmt_ratio, ratios(o, p))])
                    + " |"
                )
        lines.append("")
        lines.extend(target_lines(ours, peers))
    return "\n".join(lines)


def ratios(o: dict, p: dict) -> list[float]:
    def div(a: float, b: float) -> float:
        return a / b if b > 0 else math.inf

    return [
        div(o["per_step"]["points_per_s_median"], p["per_step"]["points_per_s_median"]),
        div(o["batched"]["points_per_s_median"], p["batched"]["points_per_s_median"]),
        div(o["trainers"]["points_per_s_median"], p["trainers"]["points_per_s_median"]),
        div(p["history_1"]["seconds_median"], o["history_1"]["seconds_median"]),
        div(p["history_12"]["seconds_median"], o["history_12"]["seconds_median"]),
        div(p["rss_peak_mib"], o["rss_peak_mib"]),
    ]


TARGETS = (("per step", 20), ("batched", 30), ("trainers", 20), ("1-metric history", 50),
           ("12-metric history", 50), ("RSS", 10))  # fmt: skip


def target_lines(ours: list[dict], peers: list[dict]) -> list[str]:
    out = []
    for o in ours:
        for p in peers:
            got = ratios(o, p)
            if p["kind"] == "mlflow":
                checks = [f"{name} {_fmt_ratio(x)} {'ok' if x >= goal else f'MISS (<{goal}×)'}"
                          for (name, goal), x in zip(TARGETS, got, strict=True)]  # fmt: skip
            else:
                checks = [f"{name} {'beats' if x > 1 else 'LOSES'} ({_fmt_ratio(x)})"
                          for (name, _), x in zip(TARGETS, got, strict=True)]  # fmt: skip
            out.append(f"- {o['label']} vs {p['label']}: " + "; ".join(checks))
    return out


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    venvs = Path(os.environ.get("RLVITALS_BENCH_PEER_VENVS", REPO.parent / "peer-venvs"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller workload and time caps (about a minute)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(TARGET_NAMES)}")
    ap.add_argument("--peer-venvs", type=Path, default=venvs,
                    help="folder holding mlflow/ and trackio/ virtual environments (default %(default)s; "
                         "env RLVITALS_BENCH_PEER_VENVS)")  # fmt: skip
    ap.add_argument("--mlflow-python", default=os.environ.get("RLVITALS_BENCH_MLFLOW_PYTHON"),
                    help="interpreter with mlflow installed (env RLVITALS_BENCH_MLFLOW_PYTHON)")  # fmt: skip
    ap.add_argument("--trackio-python", default=os.environ.get("RLVITALS_BENCH_TRACKIO_PYTHON"),
                    help="interpreter with trackio installed (env RLVITALS_BENCH_TRACKIO_PYTHON)")  # fmt: skip
    ap.add_argument("--rlvitals-python", default=sys.executable, help="interpreter with rlvitals[server]")
    ap.add_argument("--rlvitals-workers", type=int, default=2,
                    help="also run `rlvitals serve --workers N` when serve supports it (0: don't)")  # fmt: skip
    ap.add_argument("--install-peers", action="store_true", help="create the peer venvs with pip, then run")
    ap.add_argument("--max-seconds", type=float, help="time cap per ingest phase (batched gets 4×)")
    ap.add_argument("--deadline", type=float, default=900.0, help="skip targets not started by then (s)")
    ap.add_argument("--json", type=Path, help="write every number to this file")
    ap.add_argument("--keep", action="store_true", help="keep the databases and server logs")
    args = ap.parse_args(argv)
    args.mlflow_python = args.mlflow_python or str(_default_peer_python(args.peer_venvs, "mlflow"))
    args.trackio_python = args.trackio_python or str(_default_peer_python(args.peer_venvs, "trackio"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.install_peers:
        install_peers(args.peer_venvs)
    work = Workload.quick() if args.quick else Workload()
    if args.max_seconds:
        work.max_seconds, work.batched_max_seconds = args.max_seconds, 4 * args.max_seconds
    targets = select_targets(args, log)
    if not targets:
        log("nothing to run")
        return 1
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="rlvitals-bench-"))
    results = []
    try:
        for i, target in enumerate(targets):
            if time.monotonic() - started > args.deadline:
                log(f"skip {target.label}: past --deadline {args.deadline:.0f}s")
                continue
            log(f"[{i + 1}/{len(targets)}] {target.label}")
            results.append(bench_target(target, work, root / f"{i}-{target.kind}", log))
    finally:
        if args.keep:
            log(f"kept databases and logs in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report = render(results, work)
    print(report)
    if args.json:
        meta = {"workload": asdict(work), "metrics": METRIC_NAMES, "cpus": os.cpu_count(),
                "python": sys.version.split()[0], "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    log(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
