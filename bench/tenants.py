"""Tenant isolation under load: well-behaved trainers beside one hostile client at a time.

A real ``rlvitals serve`` (SQLite file, loopback only) serves ``--trainers`` well-behaved trainers:
each logs one step of 20 metrics every 50 ms and uploads a small batch (~0.5 MiB) every 2 s to its
own run. Each phase runs ``--seconds`` seconds with one attacker beside them (or none), then stops
by itself; before the next phase the bench waits (at most 60 s) until no audit is queued or running,
so each phase measures its own attack, not the previous one's backlog:

- ``none``: no attacker (the baseline);
- ``slow-uploads``: four sockets declare 256 MiB batch uploads and send a byte every 2 s;
- ``audit-flood``: one client uploads 26 MB batches to its run from 4 threads, non-stop;
- ``json-flood``: 8 threads POST 26 MB JSON bodies at once, non-stop;
- ``big-configs``: runs created with 28 MB configs, and the runs list read in a loop;
- ``metric-names``: one run fed new metric names until the limit, then more;
- ``webhooks``: the server's webhook receiver answers 200 with a 512 MiB body or drips a byte every
  2 s, while the attacker's runs flap an alert every 100 ms.

Each tenant (every trainer, the attacker) has its own API key, as separate teams sharing a server
do, so the per-client limits tell them apart (``--anonymous``: no keys, all one client).

Printed per phase: the well-behaved clients' metric-write latency p50/p99 (ms), their audit wait
(upload accepted -> audit done: p50 and max, s), how many of their uploads were refused (429), the
server's peak RSS over the phase (MB, the process tree: the server and its audit worker process,
sampled every 0.2 s; pages both map are counted twice), its peak PSS (shared pages counted once) and
most processes, the 5xx count (anyone's) and the machine's 1-minute load average at the phase's
start and end (other work on the machine shows there). Targets: p99 < 250 ms, audits done < 30 s,
RSS < 600 MB, no 5xx.

    .venv/bin/python bench/tenants.py                      # every phase, 20 s each
    .venv/bin/python bench/tenants.py --seconds 5 --phases none,slow-uploads
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import RssSampler, Server, free_port, tree_pids, tree_pss
from upload import make_body

MIB = 1024 * 1024
PHASES = ("none", "slow-uploads", "audit-flood", "json-flood", "big-configs", "metric-names", "webhooks")
TARGETS = {"p99_ms": 250.0, "audit_s": 30.0, "rss_mb": 600.0}


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: list[float] = []
        self.audit_wait: list[float] = []
        self.refused = 0
        self.reasons: dict[str, int] = {}  # what the refusals said: the limit named in each 429
        self.server_errors = 0

    def status(self, code: int) -> None:
        if code >= 500:
            with self.lock:
                self.server_errors += 1


def request(port: int, method: str, path: str, body: bytes | None = None, *, ctype: str = "application/json",
            timeout: float = 60.0) -> tuple[int, bytes]:  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=_headers(ctype if body is not None else None))
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


_tenant = threading.local()  # .key: the API key of the tenant this thread acts for (None: anonymous)


def _headers(ctype: str | None) -> dict[str, str]:
    headers = {"Content-Type": ctype} if ctype else {}
    key = getattr(_tenant, "key", None)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def new_run(port: int, name: str, config: dict | None = None) -> int | None:
    status, data = request(
        port, "POST", "/api/v1/runs", json.dumps({"name": name, "config": config or {}}).encode()
    )
    return json.loads(data)["id"] if status in (200, 201) else None


# --- the well-behaved trainers ----------------------------------------------------------------------


def trainer(port: int, n: int, stop: threading.Event, tally: Tally, batch: bytes, key: str | None) -> None:
    _tenant.key = key
    run_id = new_run(port, f"trainer-{n}-{time.monotonic_ns()}")
    step, next_upload, pending = 0, time.monotonic(), []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        body = json.dumps({"steps": [{"step": step, "metrics": {f"train/m{i}": 0.5 + i for i in range(20)}}]})
        started = time.perf_counter()
        try:
            conn.request(
                "POST",
                f"/api/v1/runs/{run_id}/metrics",
                body=body,
                headers=_headers("application/json"),
            )
            resp = conn.getresponse()
            resp.read()
            code = resp.status
        except OSError:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            code = 0
        with tally.lock:
            tally.latency.append(time.perf_counter() - started)
        tally.status(code)
        step += 1
        now = time.monotonic()
        if now >= next_upload:
            next_upload = now + 2.0
            status, data = request(
                port, "POST", f"/api/v1/runs/{run_id}/batches", batch, ctype="application/octet-stream"
            )
            tally.status(status)
            if status == 202:
                pending.append((json.loads(data)["id"], time.monotonic()))
            elif status == 429:
                with tally.lock:
                    tally.refused += 1
                    why = _reason(data)
                    tally.reasons[why] = tally.reasons.get(why, 0) + 1
        pending = [p for p in pending if not _audit_done(port, p, tally)]
        stop.wait(0.05)
    deadline = time.monotonic() + 60  # the phase is over: wait for this trainer's audits (bounded)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not _audit_done(port, p, tally)]
        time.sleep(0.2)
    with tally.lock:
        tally.audit_wait.extend(time.monotonic() - t for _, t in pending)  # never done: counted as waited
    conn.close()


def _reason(data: bytes) -> str:
    """The setting a 429 names (e.g. ``max_uploads_per_client``), else its message's start."""
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "?"
    named = [
        word.strip("();:,") for word in message.split() if word.strip("();:,").startswith(("max_", "audit_"))
    ]
    return named[-1] if named else message[:60]


def _audit_done(port: int, pending: tuple[int, float], tally: Tally) -> bool:
    audit_id, queued = pending
    status, data = request(port, "GET", f"/api/v1/audits/{audit_id}")
    tally.status(status)
    if status == 200 and json.loads(data)["status"] != "pending":
        with tally.lock:
            tally.audit_wait.append(time.monotonic() - queued)
        return True
    return False


# --- the attackers --------------------------------------------------------------------------------


def slow_uploads(port: int, stop: threading.Event, tally: Tally) -> None:
    run_id = new_run(port, "slowloris")

    def one() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(
                        f"POST /api/v1/runs/{run_id}/batches HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        f"Content-Type: application/octet-stream\r\nContent-Length: {256 * MIB}\r\n\r\n".encode()
                    )
                    while not stop.wait(2.0):
                        sock.sendall(b"x")
            except OSError:
                stop.wait(0.5)

    _threads([one] * 4, stop)


def audit_flood(port: int, stop: threading.Event, tally: Tally) -> None:
    run_id = new_run(port, "flood")
    body = make_body(26.7)

    def one() -> None:
        while not stop.is_set():
            status, _ = request(
                port, "POST", f"/api/v1/runs/{run_id}/batches", body, ctype="application/octet-stream"
            )
            tally.status(status)
            if status == 429:
                stop.wait(0.2)

    _threads([one] * 4, stop)


def json_flood(port: int, stop: threading.Event, tally: Tally) -> None:
    run_id = new_run(port, "jsonflood")
    steps = [{"step": s, "metrics": {f"x/{i}": 0.123456789 for i in range(20)}} for s in range(60_000)]
    body = json.dumps({"steps": steps}).encode()  # ~26 MB

    def one() -> None:
        while not stop.is_set():
            status, _ = request(port, "POST", f"/api/v1/runs/{run_id}/metrics", body)
            tally.status(status)
            if status == 429:
                stop.wait(0.2)

    _threads([one] * 8, stop)


def big_configs(port: int, stop: threading.Event, tally: Tally) -> None:
    config = {"blob": "y" * (28 * MIB)}
    for n in range(8):
        if stop.is_set():
            break
        status, _ = request(
            port, "POST", "/api/v1/runs", json.dumps({"name": f"big-{n}", "config": config}).encode()
        )
        tally.status(status)
    while not stop.is_set():
        status, _ = request(port, "GET", "/api/v1/runs?limit=1000")
        tally.status(status)


def metric_names(port: int, stop: threading.Event, tally: Tally) -> None:
    run_id = new_run(port, "names")
    batch = 0
    while not stop.is_set():
        metrics = {f"id/{batch}/{i}": 1.0 for i in range(2000)}
        status, _ = request(port, "POST", f"/api/v1/runs/{run_id}/metrics",
                            json.dumps({"steps": [{"step": batch, "metrics": metrics}]}).encode())  # fmt: skip
        tally.status(status)
        batch += 1
        stop.wait(0.05)


def webhooks(port: int, stop: threading.Event, tally: Tally) -> None:
    runs = [new_run(port, f"flappy-{n}") for n in range(10)]
    step = 0
    while not stop.is_set():
        for run_id in runs:
            value = "NaN" if step % 2 == 0 else 0.1
            steps = [
                {"step": step * 20 + k, "metrics": {"actor/pg_loss": value}}
                for k in range(1 if value == "NaN" else 15)
            ]
            status, _ = request(
                port, "POST", f"/api/v1/runs/{run_id}/metrics", json.dumps({"steps": steps}).encode()
            )
            tally.status(status)
        step += 1
        stop.wait(0.1)


ATTACKS = {"slow-uploads": slow_uploads, "audit-flood": audit_flood, "json-flood": json_flood,
           "big-configs": big_configs, "metric-names": metric_names, "webhooks": webhooks}  # fmt: skip


def _threads(targets, stop: threading.Event) -> None:
    key = getattr(_tenant, "key", None)  # the attacker's threads act for it

    def as_tenant(target):
        def run() -> None:
            _tenant.key = key
            target()

        return run

    threads = [threading.Thread(target=as_tenant(t), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(timeout=10)


class HostileReceiver:
    """A webhook receiver on 127.0.0.1 that alternates: 200 with a 512 MiB body, or a drip."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.count = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.5)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.count += 1
            threading.Thread(target=self._answer, args=(conn, self.count), daemon=True).start()

    def _answer(self, conn: socket.socket, n: int) -> None:
        with conn:
            try:
                conn.settimeout(10)
                conn.recv(65536)
                if n % 2:
                    conn.sendall(f"HTTP/1.1 200 OK\r\ncontent-length: {512 * MIB}\r\n\r\n".encode())
                    block = b"z" * MIB
                    for _ in range(512):
                        conn.sendall(block)
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\n")
                    for _ in range(150):
                        if self.stop.wait(2.0):
                            break
                        conn.sendall(b"x")
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


class PssSampler(threading.Thread):
    """Peak proportional set size of the server's process tree (pages shared between the server and
    its audit worker process, e.g. the torch libraries both map, counted once), and its most
    processes, every 0.5 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.processes = pid, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.peak = max(self.peak, tree_pss(self.pid))
            self.processes = max(self.processes, len(list(tree_pids(self.pid))))


def settle(port: int, limit: float = 60.0) -> None:
    """Between phases: wait (at most ``limit`` s) until no audit is queued or running, so a phase does
    not measure the previous attacker's backlog as well as its own attack, then 2 s more."""
    deadline = time.monotonic() + limit
    pending = re.compile(r'^rlvitals_audit_jobs\{status="(?:pending|running)"\} ([0-9.e+]+)$', re.MULTILINE)
    while time.monotonic() < deadline:
        try:
            status, text = request(port, "GET", "/metrics", timeout=10.0)
        except OSError:
            break
        if status != 200 or not any(float(n) for n in pending.findall(text.decode())):
            break
        time.sleep(0.5)
    time.sleep(2.0)


def run_phase(
    port: int, pid: int, phase: str, seconds: float, trainers: int, batch: bytes, keys: dict[str, str]
) -> dict:
    tally, attacker_tally = Tally(), Tally()
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=trainer, args=(port, n, stop, tally, batch, keys.get(f"trainer-{n}")), daemon=True
        )
        for n in range(trainers)
    ]
    if phase != "none":

        def attack() -> None:
            _tenant.key = keys.get("attacker")
            ATTACKS[phase](port, stop, attacker_tally)

        threads.append(threading.Thread(target=attack, daemon=True))
    pss = PssSampler(pid)
    pss.start()
    load_before = os.getloadavg()[0]
    with RssSampler(pid, interval=0.2) as rss:
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        load_after = os.getloadavg()[0]
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
    pss.stop.set()
    pss.join(timeout=5)
    lat = sorted(tally.latency) or [float("nan")]
    waits = sorted(tally.audit_wait) or [float("nan")]
    return {
        "phase": phase,
        "writes": len(tally.latency),
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "audit_p50_s": statistics.median(waits),
        "audit_max_s": waits[-1],
        "uploads_refused": tally.refused,
        "refused_by": tally.reasons,
        "rss_mb": rss.peak / 1e6,
        "pss_mb": pss.peak / 1e6,
        "processes": pss.processes,
        "5xx": tally.server_errors + attacker_tally.server_errors,
        "load": (load_before, load_after),
    }


def tenant_keys(database_url: str, trainers: int) -> dict[str, str]:
    """One API key per tenant (each trainer, the attacker), made with ``rlvitals keys create``: each
    is its own client to the per-client limits, as separate teams sharing a server are."""
    keys = {}
    for name in [f"trainer-{n}" for n in range(trainers)] + ["attacker"]:
        done = subprocess.run(
            [sys.executable, "-m", "rlvitals.cli", "keys", "--database-url", database_url, "create", "--name", name],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        keys[name] = done.stdout.strip().splitlines()[-1]
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument(
        "--anonymous",
        action="store_true",
        help="no API keys: every tenant is the same client (127.0.0.1) to the per-client limits",
    )
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {list(PHASES)}")
    receiver = HostileReceiver()
    port = free_port()
    env = {
        "RLVITALS_WEBHOOK_URLS": f"http://127.0.0.1:{receiver.port}/hook",
        "RLVITALS_WEBHOOK_BACKOFF": "0.2",
    }
    batch = make_body(0.5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        argv_ = [sys.executable, "-m", "rlvitals.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--database-url", f"sqlite:///{tmp}/tenants.db"]  # fmt: skip
        keys = {} if args.anonymous else tenant_keys(f"sqlite:///{tmp}/tenants.db", args.trainers)
        with Server(
            name="rlvitals", argv=argv_, port=port, workdir=Path(tmp), ready_path="/healthz", env=env
        ) as srv:
            srv.start(timeout=120)
            _tenant.key = keys.get("attacker")
            warm = new_run(port, "warm")  # torch loads with the first batch: not a phase's cost
            request(port, "POST", f"/api/v1/runs/{warm}/batches", batch, ctype="application/octet-stream")
            time.sleep(2.0)
            for phase in phases:
                row = run_phase(port, srv.pid, phase, args.seconds, args.trainers, batch, keys)
                rows.append(row)
                print(json.dumps(row), flush=True)
                settle(port)
    receiver.close()
    print()
    print(
        "| attack | writes | p50 ms | p99 ms | audit p50 s | audit max s | uploads 429 | peak RSS MB | peak PSS MB "
        "| processes | 5xx | load avg | targets |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ok = (r["p99_ms"] < TARGETS["p99_ms"] and r["audit_max_s"] < TARGETS["audit_s"]
              and r["rss_mb"] < TARGETS["rss_mb"] and r["5xx"] == 0)  # fmt: skip
        print(f"| {r['phase']} | {r['writes']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['audit_p50_s']:.2f} | "
              f"{r['audit_max_s']:.2f} | {r['uploads_refused']} | {r['rss_mb']:.0f} | {r['pss_mb']:.0f} | "
              f"{r['processes']} | {r['5xx']} | {r['load'][0]:.1f}-{r['load'][1]:.1f} | "
              f"{'met' if ok else 'MISSED'} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
