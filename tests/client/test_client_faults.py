"""Fault injection with real parts: real ``rlvitals serve`` processes, real signals, a real slow proxy, a
real full filesystem.

Each test runs a trainer in its own process (``TRAINER`` below: logs three metrics per step every few ms,
timing every ``log()`` call) while the test breaks the server around it. Then every scalar point must be
on the server exactly once (``GET /api/v1/runs/{id}/metrics?max_points=0``), or its loss must be counted
in ``finish()``'s report, and no ``log()`` call may block: the tests allow a generous 50 ms (a call that
waits on the network or the disk takes longer than that); the 1 ms target is measured by
``bench/client.py``, where a loaded machine cannot fail the suite.

Timing on a shared machine: the trainer raises itself and the client's threads to SCHED_FIFO when it may
(so other processes cannot preempt them), and ``LatencyProbe`` still tells a call the kernel preempted, or
whose virtual CPU the hypervisor took away (steal time), apart from one that computed or waited on the
client; the bound applies to the latter (see its docstring).

Knobs: ``RLVITALS_FAULT_OUTAGE_S`` (default 30) shortens the closed-port outage while developing;
``RLVITALS_TEST_NO_MOUNT=1`` forces the RLIMIT_FSIZE variant of the full-disk test (used where mounting
a tmpfs is not permitted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from rlvitals.client.testing import DelayProxy

LOG_LIMIT_US = 50_000.0  # sanity only: the 1 ms target lives in bench/client.py (LOG_TARGET_US)
OUTAGE_S = float(os.environ.get("RLVITALS_FAULT_OUTAGE_S", "30"))
METRICS = ("loss", "reward", "kl")

TRAINER = r"""
import dataclasses, json, math, os, sys, time, warnings
args = json.loads(sys.argv[1])
if args.get("fsize"):
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG from write(), not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (args["fsize"], args["fsize"]))
import rlvitals
from rlvitals.client import ClientSettings, ClientWarning, RetryPolicy
from rlvitals.client.testing import LatencyProbe

def realtime(tids):
    try:
        for tid in tids:
            os.sched_setscheduler(tid, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
        return True
    except (OSError, AttributeError):
        return False

import gc
gc_max, gc_start = {}, [0]
def _gc(phase, info):  # collector pauses, reported to explain any slow call
    if phase == "start":
        gc_start[0] = time.perf_counter_ns()
    else:
        gen = info["generation"]
        gc_max[gen] = max(gc_max.get(gen, 0), (time.perf_counter_ns() - gc_start[0]) // 1000)
gc.callbacks.append(_gc)
settings = ClientSettings(retry=RetryPolicy(initial=0.1, maximum=1.0), **args.get("settings", {}))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", ClientWarning)
    run = rlvitals.init(url=args["url"], project="faults", name=args["name"], spool_dir=args["spool"],
                        settings=settings)
    worker = run._worker
    rt = realtime([0, worker._pump.native_id] + ([worker._sender.native_id] if worker._sender else []))
    open(args["ready_file"], "w").close()
    probe = LatencyProbe(0.001)
    step, deadline = 0, time.monotonic() + args["max_seconds"]
    while step < args["min_steps"] or not os.path.exists(args["stop_file"]):
        metrics = {"loss": step * 0.25, "reward": -float(step), "kl": math.nan if step % 97 == 0 else step * 1e-3}
        probe(run.log, metrics, step)
        step += 1
        time.sleep(args["interval"])
        if time.monotonic() > deadline:
            break
    report = run.finish(timeout=args["finish_timeout"])
print(json.dumps({
    "steps": step, "latency": probe.summary(), "report": dataclasses.asdict(report), "run_id": report.run_id,
    "realtime": rt, "gc_max_us": gc_max, "stats": dataclasses.asdict(run.stats),
    "problems": run._problems.counts, "warnings": [str(w.message) for w in caught if issubclass(w.category, ClientWarning)],
}))
"""


class Trainer:
    """The trainer subprocess; ``stop()`` tells it to finish, ``result()`` waits for its JSON line."""

    def __init__(self, tmp_path: Path, url: str, **options) -> None:
        self.ready_file = tmp_path / "trainer.ready"
        self.stop_file = tmp_path / "trainer.stop"
        args = {
            "url": url,
            "name": options.pop("name", "fault-run"),
            "spool": str(options.pop("spool", tmp_path / "spool")),
            "ready_file": str(self.ready_file),
            "stop_file": str(self.stop_file),
            "interval": 0.002,
            "min_steps": 200,
            "max_seconds": 120,
            "finish_timeout": 60,
            **options,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited early:\n{self.proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise TimeoutError("trainer never became ready")
            time.sleep(0.05)

    def stop(self) -> None:
        self.stop_file.touch()

    def result(self, timeout: float = 150.0) -> dict:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"trainer hung:\n{err[-3000:]}") from None
        assert self.proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def server_series(url: str, run_id: str) -> dict[str, dict[int, float]]:
    """Every stored point, by metric then step; raises if any (step, name) appears twice."""
    body = httpx.get(f"{url}/api/v1/runs/{run_id}/metrics", params={"max_points": 0}, timeout=30).json()
    out: dict[str, dict[int, float]] = {}
    for name, series in body["series"].items():
        steps = series["step"]
        assert len(steps) == len(set(steps)), f"{name}: duplicated steps on the server"
        out[name] = dict(zip(steps, series["value"], strict=True))
    return out


def expected(step: int, name: str):
    if name == "loss":
        return step * 0.25
    if name == "reward":
        return -float(step)
    return "NaN" if step % 97 == 0 else step * 1e-3


def assert_exactly_once(url: str, result: dict) -> None:
    steps = result["steps"]
    series = server_series(url, result["run_id"])
    for name in METRICS:
        got = series.get(name, {})
        assert sorted(got) == list(range(steps)), f"{name}: {steps - len(got)} of {steps} steps missing"
        bad = [s for s in range(steps) if got[s] != expected(s, name)]
        assert not bad, f"{name}: wrong values at steps {bad[:5]}"
    report = result["report"]
    assert report["points_logged"] == steps * len(METRICS)
    assert report["points_dropped"] == report["points_rejected"] == report["points_pending"] == 0, report


def assert_never_blocked(result: dict) -> None:
    latency = result["latency"]
    print(f"log() latency: {latency} realtime={result['realtime']} gc_max_us={result['gc_max_us']}")
    assert latency["max_unpreempted_us"] < LOG_LIMIT_US, latency
    assert latency["p99_us"] < LOG_LIMIT_US, latency


@pytest.fixture
def trainers():
    started: list[Trainer] = []
    yield started
    for trainer in started:
        trainer.kill()


@pytest.mark.heavy
def test_server_sigkilled_mid_run_and_restarted_on_the_same_database(serve, tmp_path, trainers):
    server = serve()
    trainer = Trainer(tmp_path, server.url)
    trainers.append(trainer)
    trainer.wait_ready()
    time.sleep(1.0)
    server.kill()  # SIGKILL: no shutdown handlers, requests in flight are cut
    time.sleep(2.0)
    server.start()  # same port, same SQLite file
    time.sleep(1.5)
    trainer.stop()
    result = trainer.result()
    assert_exactly_once(server.url, result)
    assert_never_blocked(result)
    assert len(result["warnings"]) == 1 and "spooling" in result["warnings"][0], result["warnings"]


@pytest.mark.heavy
def test_port_closed_for_30_seconds(serve, tmp_path, trainers):
    server = serve()
    trainer = Trainer(tmp_path, server.url, interval=0.005)
    trainers.append(trainer)
    trainer.wait_ready()
    time.sleep(0.5)
    server.stop()
    closed_at = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/healthz", timeout=1)
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - closed_at)))
    server.start()
    time.sleep(1.0)
    trainer.stop()
    result = trainer.result()
    assert result["steps"] * 0.005 >= OUTAGE_S * 0.5  # the trainer kept logging through the outage
    assert_exactly_once(server.url, result)
    assert_never_blocked(result)
    assert any("unreachable" in w for w in result["warnings"]), result["warnings"]


@pytest.mark.heavy
def test_server_answering_in_2_seconds_per_request(serve, tmp_path, trainers):
    server = serve()
    with DelayProxy(server.url, delay=2.0) as proxy:
        trainer = Trainer(tmp_path, proxy.url, settings={"timeout": 10.0, "init_timeout": 10.0})
        trainers.append(trainer)
        trainer.wait_ready()
        time.sleep(6.0)  # three round trips' worth of logging
        trainer.stop()
        result = trainer.result()
    assert_exactly_once(server.url, result)
    assert_never_blocked(result)
    assert result["warnings"] == []  # slow is not broken: nothing to warn about


def _mount_tiny_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.environ.get("RLVITALS_TEST_NO_MOUNT"):  # exercise the RLIMIT_FSIZE path where mounting works
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.heavy
def test_spool_directory_full_counts_every_lost_point(serve, tmp_path, trainers):
    """Server down from the start, spool on a 64 KiB filesystem: the spool fills (ENOSPC), memory holds
    up to twice its bound, the rest is dropped and counted. Everything not counted arrives exactly once.
    Without the right to mount, the same real ENOSPC-like failure comes from RLIMIT_FSIZE (EFBIG)."""
    spool = tmp_path / "tiny"
    mounted = _mount_tiny_tmpfs(spool)
    options: dict = {"settings": {"max_memory_points": 600}}
    if not mounted:
        options["fsize"] = 64 * 1024
        options["settings"]["max_steps_per_request"] = 100_000  # one growing segment hits the file limit
    server = serve()
    server.stop()
    try:
        trainer = Trainer(tmp_path, server.url, spool=spool, min_steps=3000, interval=0.0005, **options)
        trainers.append(trainer)
        trainer.wait_ready()
        time.sleep(3.0)  # ~3000 steps: the spool fills after ~900, memory after ~400 more
        server.start()
        trainer.stop()
        result = trainer.result()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(spool)], check=False)
    report = result["report"]
    steps = result["steps"]
    logged = steps * len(METRICS)
    series = server_series(server.url, result["run_id"])
    arrived = sum(len(series.get(name, {})) for name in METRICS)
    for name in METRICS:
        assert all(series[name][s] == expected(s, name) for s in series.get(name, {}))
    assert report["points_logged"] == logged
    assert report["points_dropped"] > 0, (report, result["warnings"])  # the disk really filled up
    assert arrived + report["points_dropped"] == logged, json.dumps([arrived, result], indent=1)
    assert report["points_pending"] == 0
    assert any("write spool" in w and ("No space" in w or "too large" in w) for w in result["warnings"]), (
        result["warnings"]
    )
    assert_never_blocked(result)


def test_the_probe_itself_sees_a_blocking_call():
    """The latency bound is only meaningful if the probe catches a call that blocks."""
    from rlvitals.client.testing import LatencyProbe

    lock = threading.Lock()
    lock.acquire()

    def blocked_for_5_ms() -> None:
        # The timer starts inside the probed call, so the whole 5 ms falls within it.
        threading.Timer(0.005, lock.release).start()
        lock.acquire()

    seen = []
    for _ in range(5):  # a call the kernel happened to preempt is (rightly) set aside: try again
        probe = LatencyProbe(0.001)
        probe(blocked_for_5_ms)
        seen.append(probe.summary()["max_unpreempted_us"])
        if seen[-1] >= 4000:
            break
    assert max(seen) >= 4000, seen


def test_the_probe_counts_a_call_that_computes():
    """A call that burns the CPU itself is the client's own time, never set aside as stolen or preempted."""
    from rlvitals.client.testing import LatencyProbe

    def computes_for_3_ms() -> None:
        end = time.thread_time_ns() + 3_000_000  # 3 ms of this thread's own CPU time
        while time.thread_time_ns() < end:
            pass

    seen = []
    try:  # as the fault tests' trainer does: other processes then cannot preempt the busy loop
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        realtime = True
    except (OSError, AttributeError):
        realtime = False
    try:
        for _ in range(50):  # a call the kernel happened to preempt is (rightly) set aside: try again
            probe = LatencyProbe(0.001)
            probe(computes_for_3_ms)
            summary = probe.summary()
            assert summary["stolen_over_limit"] == 0, summary
            seen.append(summary["max_unpreempted_us"])
            if seen[-1] >= 2500:
                break
    finally:
        if realtime:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    assert max(seen) >= 2500, seen
