"""Ingest and history-query benchmark: rlvitals against MLflow's tracking server and trackio.

Every server runs on loopback with an embedded SQLite database, started fresh by this script, and
gets the same workload in the same run (one run, 12 metrics per step, PPO/GRPO-like values):

1. per step:   one request per step, 2,000 steps (the way a trainer logs by default);
2. batched:    100 steps per request, 20,000 steps;
3. 8 trainers: eight runs at once, one request per step each, 250 steps each;
4. history:    every point of one metric, and of all 12, over the 20,000 batched steps (median of up
               to 5 repeats, fewer once a server's reads pass the time cap; every answer is counted
               and must hold all 20,000 points per metric). rlvitals is read as its client reads it
               (``format=binary``, decoded into arrays by ``rlvitals.client.history``); its default
               JSON answer for all 12 is timed too and printed beside;
5. alerts:     while each ingest round runs on rlvitals, a probe on a run of its own sends a NaN loss
               every ~0.4 s and times how long until the API shows its alert (``_alerts.py``: the
               health rules run after the write answers); p50/p99 over every round;
6. memory:     peak RSS (sampled every 0.5 s) summed over the server's process tree (supervisor + workers),
               over the workload above (rlvitals' JSON-form reads come after it; the peak with them
               is in the JSON output as ``rss_peak_with_json_reads_mib`` and printed), and PSS;
7. ceiling:    SQLite's own insert rate for the same rows (executemany + commit per request, no server,
               ``_ceiling.py``), and where one rlvitals request's time goes (parse, health rules, insert,
               the rest of the transaction), timed in this process with the server's code.

All servers are started first and stay up; each phase then runs in ``--rounds`` interleaved rounds
(each a slice of the phase's requests, the servers taking turns in a rotating order), so a
neighbour stealing the CPU for a while costs every server alike. Throughput is the median over the
rounds; p50/p99 are per logical request over all rounds (MLflow's 1,200-metric batches go out as
two log-batch calls, as its client splits them). A phase stops at ``--max-seconds`` (batched: 4×),
marked ``*``. Server CPU (user + system over its process tree, from /proc) is reported per request:
unlike wall-clock rates it does not move with other load on the machine. A keep-alive probe (100
small GETs on one connection) shows whether a server pays the ~40 ms Nagle/delayed-ACK stall of
uvicorn#3149 (``--workers N`` listeners without TCP_NODELAY).

Targets: rlvitals (1 process and ``--workers 2``, embedded SQLite), MLflow (its default 4 workers
and ``--workers 1``), trackio; opt-in ``rlvitals-pg`` and ``rlvitals-pg-workers`` run rlvitals on a
private database of the PostgreSQL at ``--pg-url``; opt-in ``rlvitals-no-rules`` is a reference, not a
configuration to deploy: rlvitals with every health rule disabled, i.e. what the write path alone
(parse, validation, insert, HTTP) costs, beside the real thing.

Peers live in their own virtual environments, outside this repository, found by flag, environment
variable or the default ``<checkout>/../peer-venvs/{mlflow,trackio}/bin/python``; a peer that is not
installed is skipped with a line saying how to install it (or run ``--install-peers``)::

    .venv/bin/python bench/ingest.py                 # full run, a few minutes on 2 cores
    .venv/bin/python bench/ingest.py --quick         # smaller workload, about a minute
    .venv/bin/python bench/ingest.py --only rlvitals,trackio --json /tmp/bench.json
    .venv/bin/python bench/ingest.py --only rlvitals,rlvitals-pg,rlvitals-pg-workers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _alerts import AlertProbe
from _ceiling import breakdown, sqlite_ceiling
from _peers import Conn, Mlflow, Rlvitals, RunRef, Step, Target, Trackio
from _phases import Phase, Round, chunks, keepalive_probe, run_concurrent, run_sequential, send, timed_history
from _report import render
from _servers import RssSampler, Server, free_port, tree_cpu_seconds, tree_pids, tree_pss, wait_idle
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
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
TARGET_NAMES = (
    "rlvitals",
    "rlvitals-no-rules",
    "rlvitals-workers",
    "rlvitals-pg",
    "rlvitals-pg-workers",
    "mlflow",
    "mlflow-1",
    "trackio",
)
DEFAULT_TARGETS = ("rlvitals", "rlvitals-workers", "mlflow", "mlflow-1", "trackio")


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
    rounds: int = 3
    warmup: int = 50
    max_seconds: float = 30.0
    batched_max_seconds: float = 120.0

    @classmethod
    def quick(cls) -> Workload:
        return cls(per_step=500, batched_steps=5_000, trainer_steps=60, repeats=3, max_seconds=10.0,
                   batched_max_seconds=40.0)  # fmt: skip


# ------------------------------------------------------------------------------------------ servers


@dataclass
class Live:
    """One started server with its connection, its runs, its prepared requests and its results."""

    target: Target
    server: Server
    conn: Conn
    sampler: RssSampler
    startup: float
    settled: float
    probe: float = math.nan
    rss_idle: int = 0
    plans: dict[str, list] = field(default_factory=dict)  # phase -> per-round op lists
    phases: dict[str, Phase] = field(default_factory=dict)
    history: dict[str, list[float]] = field(default_factory=lambda: {"1": [], "12": [], "12json": []})
    history_cpu: dict[str, float] = field(default_factory=lambda: {"1": 0.0, "12": 0.0})
    batched_run: RunRef | None = None
    alerts: AlertProbe | None = None  # rlvitals: point-to-alert latency while the ingest phases run
    rss_workload_peak: int = 0  # the sampler's peak at the end of the workload (before the JSON reads)


@contextlib.contextmanager
def started(target: Target, workdir: Path, log) -> Iterator[Live]:
    port = free_port()
    server = target.server(workdir, port)
    t0 = time.perf_counter()
    with server.start(timeout=180):
        startup = time.perf_counter() - t0
        settled = wait_idle(server.pid)
        log(
            f"  {target.label}: up in {startup:.1f}s on port {port} (pid {server.pid}), idle after {settled:.1f}s"
        )
        conn = Conn(port)
        try:
            with RssSampler(server.pid) as sampler:
                yield Live(target, server, conn, sampler, startup, settled)
        finally:
            conn.close()


def prepare(live: Live, work: Workload) -> None:
    """Probe, warm up, create the runs and build every request before anything is timed."""
    target, conn, rounds = live.target, live.conn, work.rounds
    live.rss_idle = live.sampler.sample()
    live.probe = keepalive_probe(conn, target.probe_path())
    # Warm-up on a run of its own: first-request work (imports, caches, prepared statements) is
    # start-up cost, not ingest throughput.
    warm = target.create_run(conn, "warm-up")
    for step in make_steps(work.warmup, seed=0):
        send(conn, target, target.log_requests(warm, [step]))
    target.history(conn, warm, METRIC_NAMES[:1])

    k = len(METRIC_NAMES)
    run = target.create_run(conn, "per-step")
    live.plans["per_step"] = chunks(
        [(target.log_requests(run, [s]), k) for s in make_steps(work.per_step, seed=1)], rounds
    )
    live.batched_run = target.create_run(conn, "batched")
    data = make_steps(work.batched_steps, seed=2)
    batches = [data[i : i + work.batch] for i in range(0, len(data), work.batch)]
    live.plans["batched"] = chunks(
        [(target.log_requests(live.batched_run, b), k * len(b)) for b in batches], rounds
    )
    per_worker = []
    for i in range(work.trainers):
        run_t = target.create_run(conn, f"trainer-{i}")
        per_worker.append(chunks([(target.log_requests(run_t, [s]), k)
                                  for s in make_steps(work.trainer_steps, seed=10 + i)], rounds))  # fmt: skip
    live.plans["trainers"] = [[worker[r] for worker in per_worker] for r in range(rounds)]
    live.phases = {name: Phase(name) for name in live.plans}
    if target.kind == "rlvitals" and not target.rules_off:  # with every rule off no alert comes
        live.alerts = AlertProbe(live.server.port)


def run_round(live: Live, phase: str, r: int, work: Workload) -> Round:
    pid = live.server.pid
    cap = (work.batched_max_seconds if phase == "batched" else work.max_seconds) / work.rounds
    cpu0 = tree_cpu_seconds(pid)
    with live.alerts if live.alerts is not None else contextlib.nullcontext():
        if phase == "trainers":
            result = run_concurrent(
                live.phases[phase], live.server.port, live.target, live.plans[phase][r], cap
            )
        else:
            result = run_sequential(live.phases[phase], live.conn, live.target, live.plans[phase][r], cap)
    live.phases[phase].cpu_seconds += tree_cpu_seconds(pid) - cpu0
    return result


def history_round(live: Live) -> None:
    steps = live.phases["batched"].points // len(METRIC_NAMES)
    pid = live.server.pid
    for key, names in (("1", METRIC_NAMES[:1]), ("12", METRIC_NAMES)):
        cpu0 = tree_cpu_seconds(pid)
        live.history[key].append(timed_history(live.conn, live.target, live.batched_run, names, steps))
        live.history_cpu[key] += tree_cpu_seconds(pid) - cpu0


def json_history_round(live: Live) -> None:
    """rlvitals only: the 12-metric read in the default JSON form, for the record (after the
    workload's memory peak was taken: the answer cache then holds it too)."""
    steps = live.phases["batched"].points // len(METRIC_NAMES)
    live.history["12json"].append(
        timed_history(live.conn, live.target, live.batched_run, METRIC_NAMES, steps, as_json=True)
    )


def result_of(live: Live, workdir: Path) -> dict:
    pid = live.server.pid
    rss_end = live.sampler.sample()
    steps = live.phases["batched"].points // len(METRIC_NAMES)

    def hist(key: str, names: int) -> dict:
        times = live.history[key]
        return {
            "seconds_median": statistics.median(times) if times else math.nan,
            "repeats": len(times),
            "points": steps * names,
            "server_cpu_s_per_query": round(live.history_cpu[key] / len(times), 4) if times else math.nan,
        }

    db_bytes = sum(
        p.stat().st_size for p in workdir.rglob("*") if p.is_file() and not p.name.endswith(".log")
    )
    return {
        "label": live.target.label,
        "kind": live.target.kind,
        "startup_s": round(live.startup, 2),
        "idle_after_s": round(live.settled, 1),
        "keepalive_get_p50_ms": round(live.probe * 1e3, 3),
        **{name: phase.summary() for name, phase in live.phases.items()},
        "history_1": hist("1", 1),
        "history_12": hist("12", len(METRIC_NAMES)),
        **(
            {"history_12_json_seconds_median": statistics.median(live.history["12json"])}
            if live.history["12json"]
            else {}
        ),
        "history_steps": steps,
        "rss_idle_mib": round(live.rss_idle / 2**20, 1),
        "rss_peak_mib": round(live.rss_workload_peak / 2**20, 1),
        "rss_peak_with_json_reads_mib": round(live.sampler.peak / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "pss_end_mib": round(tree_pss(pid) / 2**20, 1),
        "processes": len(tree_pids(pid)),
        "disk_mib": round(db_bytes / 2**20, 1),
        **({"alert_latency": live.alerts.summary()} if live.alerts is not None else {}),
    }


def rotated(items: list, r: int) -> list:
    """Round ``r``'s running order: nobody always goes first (or right after the heaviest peer)."""
    k = r % len(items)
    return items[k:] + items[:k]


def run_all(targets: list[Target], work: Workload, root: Path, args: argparse.Namespace, log) -> list[dict]:
    """Start every server, then run each phase in interleaved rounds across them."""
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        lives: list[Live] = []
        workdirs: dict[int, Path] = {}
        for i, target in enumerate(targets):
            log(f"[{i + 1}/{len(targets)}] starting {target.label}")
            if isinstance(target, Rlvitals) and target.postgres:
                target.database_url = stack.enter_context(private_pg_database(args.pg_url))
            workdir = root / f"{i}-{target.kind}"
            live = stack.enter_context(started(target, workdir, log))
            prepare(live, work)
            log(f"  keep-alive GET p50 {live.probe * 1e3:.2f} ms")
            workdirs[id(live)] = workdir
            lives.append(live)
        for phase in ("per_step", "batched", "trainers"):
            for r in range(work.rounds):
                if time.monotonic() - t_start > args.deadline:
                    log(f"past --deadline {args.deadline:.0f}s: no more rounds")
                    break
                for live in rotated(lives, r):
                    res = run_round(live, phase, r, work)
                    log(f"  {phase:9s} round {r + 1}/{work.rounds}  {live.target.label:34s} "
                        f"{res.rate:10,.0f} points/s  ({res.requests} requests in {res.seconds:.1f}s)")  # fmt: skip
        for rep in range(work.repeats):
            if rep and time.monotonic() - t_start > args.deadline:
                break
            for live in rotated(lives, rep):
                # A slow server stops repeating once its reads took the phase's time cap; every
                # server gets at least one repeat.
                if rep == 0 or sum(live.history["1"]) + sum(live.history["12"]) < work.max_seconds:
                    history_round(live)
        for live in lives:
            live.rss_workload_peak = live.sampler.peak
            if live.target.kind == "rlvitals":
                for _ in range(len(live.history["12"])):
                    json_history_round(live)
        for live in lives:
            log(f"  history   {live.target.label:34s} 1 metric {statistics.median(live.history['1']) * 1e3:9.1f} ms"
                f"   12 metrics {statistics.median(live.history['12']) * 1e3:9.1f} ms")  # fmt: skip
        return [result_of(live, workdirs[id(live)]) for live in lives]


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


def _pg_connect(admin_url: str, dbname: str | None = None):
    import psycopg

    url = make_url(admin_url).set(drivername="postgresql")
    if dbname is not None:
        url = url.set(database=dbname)
    return psycopg.connect(url.render_as_string(hide_password=False), autocommit=True, connect_timeout=5)


def _pg_problem(admin_url: str) -> str | None:
    try:
        with _pg_connect(admin_url):
            return None
    except Exception as exc:  # any failure means: skip the PostgreSQL targets, saying why
        return f"{type(exc).__name__}: {exc}".splitlines()[0]


@contextlib.contextmanager
def private_pg_database(admin_url: str) -> Iterator[str]:
    """A fresh database on the server of ``admin_url`` (dropped afterwards), as a SQLAlchemy URL."""
    name = f"rlvitals_bench_{uuid.uuid4().hex[:12]}"
    with _pg_connect(admin_url) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with _pg_connect(admin_url) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# The peer versions the published numbers were measured against.
PEER_REQUIREMENTS = {"mlflow": "mlflow", "trackio": "trackio==0.43.*"}


def install_peers(venvs: Path) -> None:
    """Create ``venvs/mlflow`` and ``venvs/trackio`` with the peers from PyPI (no torch needed)."""
    for name, requirement in PEER_REQUIREMENTS.items():
        env = venvs / name
        if not (env / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", requirement], check=True)


def select_targets(args: argparse.Namespace, log) -> list[Target]:
    only = set(args.only.split(",")) if args.only else set(DEFAULT_TARGETS)
    unknown = only - set(TARGET_NAMES)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {', '.join(TARGET_NAMES)}")
    targets: list[Target] = []
    if "rlvitals" in only:
        targets.append(Rlvitals(args.rlvitals_python))
    if "rlvitals-no-rules" in only:
        targets.append(Rlvitals(args.rlvitals_python, rules_off=True))
    if "rlvitals-workers" in only and args.rlvitals_workers > 1:
        if _serve_supports_workers(args.rlvitals_python):
            targets.append(Rlvitals(args.rlvitals_python, workers=args.rlvitals_workers))
        else:
            log("skip rlvitals --workers: this `rlvitals serve` has no --workers option")
    pg_wanted = [name for name in ("rlvitals-pg", "rlvitals-pg-workers") if name in only]
    if pg_wanted:
        problem = _pg_problem(args.pg_url)
        if problem:
            log(
                f"skip {', '.join(pg_wanted)}: PostgreSQL at {args.pg_url} unusable ({problem}); pass --pg-url"
            )
        else:
            if "rlvitals-pg" in only:
                targets.append(Rlvitals(args.rlvitals_python, postgres=True))
            if "rlvitals-pg-workers" in only and args.rlvitals_workers > 1:
                targets.append(Rlvitals(args.rlvitals_python, workers=args.rlvitals_workers, postgres=True))
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
    ap.add_argument("--pg-url", default=os.environ.get("RLVITALS_BENCH_PG_URL", DEFAULT_PG_URL),
                    help="PostgreSQL server for the rlvitals-pg targets; a private database is created and "
                         "dropped (default %(default)s; env RLVITALS_BENCH_PG_URL)")  # fmt: skip
    ap.add_argument("--install-peers", action="store_true", help="create the peer venvs with pip, then run")
    ap.add_argument("--max-seconds", type=float, help="time cap per ingest phase (batched gets 4×)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per phase (default 3)")
    ap.add_argument(
        "--deadline", type=float, default=900.0, help="start no new round after this many seconds"
    )
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
    if args.rounds:
        work.rounds = args.rounds
    if args.max_seconds:
        work.max_seconds, work.batched_max_seconds = args.max_seconds, 4 * args.max_seconds
    targets = select_targets(args, log)
    if not targets:
        log("nothing to run")
        return 1
    started_at = time.monotonic()
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="rlvitals-bench-"))
    try:
        results = run_all(targets, work, root, args, log)
    finally:
        if args.keep:
            log(f"kept databases and logs in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    log("measuring SQLite's own insert rate and where a request's time goes (in this process)")
    floor = {
        "ceiling": {
            "per_step": sqlite_ceiling(make_steps(work.per_step, seed=1), 1),
            "batched": sqlite_ceiling(make_steps(work.batched_steps, seed=2), work.batch),
        },
        "breakdown": {
            "per_step": breakdown(make_steps(min(work.per_step, 1_000), seed=1), 1),
            "batched": breakdown(make_steps(min(work.batched_steps, 5_000), seed=2), work.batch),
        },
    }
    report = render(results, work, len(METRIC_NAMES), floor)
    print(report)
    print(f"\nMachine: {os.cpu_count()} CPUs; load average (1 min) {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after.")  # fmt: skip
    if args.json:
        meta = {"workload": asdict(work), "metrics": METRIC_NAMES, "cpus": os.cpu_count(),
                "python": sys.version.split()[0], "seconds": round(time.monotonic() - started_at, 1),
                "loadavg_before": load_before, "loadavg_after": load_after}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results, **floor}, indent=2))
    log(f"done in {time.monotonic() - started_at:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
