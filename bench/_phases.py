"""Timed request loops for bench/ingest.py: one trainer in sequence, N trainers at once, history reads.

A ``Phase`` collects the rounds of one workload phase on one server. Each round is a slice of the
phase's requests run back to back; the phase's rate is the median over its rounds, and p50/p99 are
over every request of every round. Rounds of different servers are interleaved by the caller, so a
neighbour stealing the CPU for a while hurts every server alike instead of whichever ran then.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from _peers import BenchError, Conn, Req, RunRef, Target, check_bulk_reply

# One logical request (the HTTP calls that send it) and the number of points it carries.
Op = tuple[list[Req], int]


@dataclass
class Round:
    requests: int
    points: int
    seconds: float
    capped: bool

    @property
    def rate(self) -> float:
        return self.points / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Phase:
    name: str
    rounds: list[Round] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0  # CPU the server's process tree used during the phase's rounds

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.rounds)

    @property
    def points(self) -> int:
        return sum(r.points for r in self.rounds)

    @property
    def capped(self) -> bool:
        return any(r.capped for r in self.rounds)

    def rate(self) -> float:
        """Median points/s over the rounds that ran."""
        rates = [r.rate for r in self.rounds if r.requests]
        return statistics.median(rates) if rates else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return math.nan
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def cpu_ms_per_request(self) -> float:
        return 1e3 * self.cpu_seconds / self.requests if self.requests else math.nan

    def summary(self) -> dict:
        seconds = sum(r.seconds for r in self.rounds)
        return {
            "requests": self.requests,
            "points": self.points,
            "seconds": round(seconds, 3),
            "capped": self.capped,
            "points_per_s_median": round(self.rate(), 1),
            "points_per_s_rounds": [round(r.rate, 1) for r in self.rounds],
            "points_per_s_total": round(self.points / seconds, 1) if seconds else 0.0,
            "p50_ms": round(self.pct(0.5) * 1e3, 3),
            "p99_ms": round(self.pct(0.99) * 1e3, 3),
            "server_cpu_s": round(self.cpu_seconds, 3),
            "server_cpu_ms_per_request": round(self.cpu_ms_per_request(), 3),
            "points_per_server_cpu_s": round(self.points / self.cpu_seconds, 1)
            if self.cpu_seconds > 0
            else None,
        }


def send(conn: Conn, target: Target, reqs: Sequence[Req]) -> None:
    for req in reqs:
        check_bulk_reply(target, conn.call(req))


def run_sequential(phase: Phase, conn: Conn, target: Target, ops: Sequence[Op], max_seconds: float) -> Round:
    """One trainer: ``ops`` back to back on one keep-alive connection, stopping at ``max_seconds``."""
    start = time.perf_counter()
    deadline = start + max_seconds
    requests = points = 0
    for reqs, n in ops:
        t = time.perf_counter()
        send(conn, target, reqs)
        done = time.perf_counter()
        phase.latencies.append(done - t)
        requests += 1
        points += n
        if done > deadline:
            break
    result = Round(requests, points, time.perf_counter() - start, capped=requests < len(ops))
    phase.rounds.append(result)
    return result


def run_concurrent(phase: Phase, port: int, target: Target, per_worker: Sequence[Sequence[Op]],
                   max_seconds: float) -> Round:  # fmt: skip
    """N trainers at once, each a thread with its own keep-alive connection."""
    lock = threading.Lock()
    barrier = threading.Barrier(len(per_worker) + 1)
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = [0, 0]  # requests, points

    def worker(ops: Sequence[Op]) -> None:
        conn = Conn(port)
        try:
            barrier.wait()
            deadline = time.perf_counter() + max_seconds
            for reqs, n in ops:
                if stop.is_set():
                    return
                t = time.perf_counter()
                send(conn, target, reqs)
                done = time.perf_counter()
                with lock:
                    phase.latencies.append(done - t)
                    counts[0] += 1
                    counts[1] += n
                if done > deadline:
                    return
        except BaseException as exc:  # re-raised by the caller's thread; the other trainers stop
            errors.append(exc)
            stop.set()
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(ops,), daemon=True) for ops in per_worker]
    for th in threads:
        th.start()
    barrier.wait()
    start = time.perf_counter()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    result = Round(counts[0], counts[1], seconds, capped=counts[0] < sum(len(ops) for ops in per_worker))
    phase.rounds.append(result)
    return result


def keepalive_probe(conn: Conn, path: str, n: int = 100) -> float:
    """Median seconds of ``n`` small GETs on one keep-alive connection (after a warm-up)."""
    conn.call(Req("GET", path))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        conn.call(Req("GET", path))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_history(conn: Conn, target: Target, run: RunRef, names: Sequence[str], expect: int, **kw) -> float:
    """Seconds to fetch every point of ``names``; each must come back with ``expect`` points."""
    t = time.perf_counter()
    counts = target.history(conn, run, names, **kw)
    seconds = time.perf_counter() - t
    short = {k: v for k, v in counts.items() if v != expect}
    if short:
        raise BenchError(f"{target.label}: history returned {short} points, expected {expect} each")
    return seconds


def chunks(items: Sequence, n: int) -> list[list]:
    """``items`` cut into ``n`` contiguous slices of near-equal length."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out
