"""Audits run in a separate, lower-priority worker process, so a flood of audits cannot take the
request-serving process's CPU (and interpreter lock): it starts with the first queued audit (a server
that only ingests has none), claims from the database queue like the in-process threads did, is
restarted when it dies, dies with the server (even after ``kill -9``) and shows on ``/metrics``.

Before: audits ran in threads of the server process.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from rlvitals.service.storage import repository as repo
from rlvitals.service.workers import MALLOC_ENV, tune_malloc
from sqlalchemy import update

from tests.service.batchdata import OCTET, make_batch, wait_done


def _metric(api_or_text, name: str) -> float:
    text = api_or_text if isinstance(api_or_text, str) else api_or_text.get("/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not on /metrics"
    return float(match.group(1))


def _upload(api, run_id: int, step: int, **shape) -> int:
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(step, **shape), headers=OCTET)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _claimer(api, audit_id: int) -> str:
    with api.services.db.read() as session:
        return repo.get_audit(session=session, audit_id=audit_id)["claimed_by"]


def _gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` exits within ``timeout`` s (a zombie not yet reaped by its parent counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_audits_run_in_a_lower_priority_worker_process_started_with_the_first_audit(app_client, database_url):
    api = app_client(database_url, audit_process=True, audit_nice=7)
    run_id = api.create_run("trainer")
    assert api.log(run_id, [{"step": 0, "metrics": {"loss": 1.0}}]).status_code == 200
    time.sleep(0.3)
    assert api.services.audits.child.pid is None  # writes alone start no second process
    assert _metric(api, "rlvitals_audit_worker_up") == 0

    audit = wait_done(api, _upload(api, run_id, 0), timeout=90)
    assert audit["status"] == "done" and audit["verdict"], audit
    pid = api.services.audits.child.pid
    assert pid is not None and pid != os.getpid()
    # the job was claimed by that process: host:pid:token:thread
    assert _claimer(api, audit["id"]).split(":")[1] == str(pid)
    assert os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0) == 7
    # glibc maps a batch's large buffers on their own and unmaps them when freed, with two arenas
    raw = Path(f"/proc/{pid}/environ").read_text()
    environ = dict(e.split("=", 1) for e in raw.split("\0") if "=" in e)
    assert {k: environ.get(k) for k in MALLOC_ENV} == {
        k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()
    }, environ
    text = api.get("/metrics").text
    assert _metric(text, "rlvitals_audit_worker_up") == 1
    assert _metric(text, "rlvitals_audit_worker_pid") == pid
    assert re.search(r'^rlvitals_audits_total\{status="done"\} 1$', text, re.MULTILINE), text

    api.stop()  # the worker goes with the server
    assert _gone(pid, 40)


@pytest.mark.heavy
def test_the_worker_is_restarted_after_kill_9_and_its_claimed_audit_is_redone(app_client, database_url):
    api = app_client(database_url, audit_process=True, audit_workers=1)
    run_id = api.create_run("trainer")
    wait_done(api, _upload(api, run_id, 0), timeout=90)
    first = api.services.audits.child.pid
    # a claim left by the killed worker (as if it died mid-audit) goes back to the queue at restart
    stuck = _upload(api, run_id, 1)
    os.kill(first, signal.SIGKILL)
    with api.services.db.write() as session:
        session.execute(
            update(repo.AUDITS)
            .where(repo.AUDITS.c.id == stuck)
            .values(
                status="running", claimed_by=f"{socket.gethostname()}:{first}:x:t", claimed_at=time.time()
            )
        )
    assert _gone(first, 10)
    assert wait_done(api, stuck, timeout=90)["status"] == "done"
    assert wait_done(api, _upload(api, run_id, 2), timeout=90)["status"] == "done"
    second = api.services.audits.child.pid
    assert second not in (None, first)
    assert _metric(api, "rlvitals_audit_worker_restarts_total") >= 1


@pytest.mark.heavy
def test_the_worker_dies_with_a_killed_server(serve, tmp_path):
    server = serve()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        run_id = client.post("/api/v1/runs", json={"name": "r"}).json()["id"]
        audit_id = client.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(0), headers=OCTET).json()[
            "id"
        ]
        deadline = time.monotonic() + 90
        while client.get(f"/api/v1/audits/{audit_id}").json()["status"] == "pending":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pid = int(_metric(client.get("/metrics").text, "rlvitals_audit_worker_pid"))
    assert pid and pid != server.popen.pid
    os.kill(server.popen.pid, signal.SIGKILL)  # the server alone, not its process group
    server.popen.wait(timeout=10)
    assert _gone(pid, 10), "the audit worker outlived its server"
    assert "audit worker process" in server.log()


@pytest.mark.heavy
def test_an_audit_flood_leaves_the_request_process_answering(serve):
    """Sanity only (the bound that matters is bench/tenants.py's): while one client uploads large
    batches from three threads non-stop, another's per-step writes keep being answered."""
    server = serve()
    body = make_batch(0, batch=64, length=8192)  # ~8 MB
    stop = threading.Event()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        flood = client.post("/api/v1/runs", json={"name": "flood"}).json()["id"]
        run_id = client.post("/api/v1/runs", json={"name": "trainer"}).json()["id"]

        def upload() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as mine:
                while not stop.is_set():
                    if (
                        mine.post(f"/api/v1/runs/{flood}/batches", content=body, headers=OCTET).status_code
                        == 429
                    ):
                        stop.wait(0.2)

        threads = [threading.Thread(target=upload, daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        latencies = []
        try:
            time.sleep(1.0)
            for step in range(60):
                started = time.perf_counter()
                response = client.post(
                    f"/api/v1/runs/{run_id}/metrics",
                    json={"steps": [{"step": step, "metrics": {"loss": 1.0}}]},
                )
                latencies.append(time.perf_counter() - started)
                assert response.status_code == 200, response.text
                time.sleep(0.05)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
        pid = int(_metric(client.get("/metrics").text, "rlvitals_audit_worker_pid"))
    assert pid and pid != server.popen.pid
    latencies.sort()
    assert latencies[len(latencies) // 2] < 1.0 and latencies[-1] < 5.0, latencies


@pytest.mark.parametrize("gone", ["dead-process", "too-old"])
def test_an_upload_left_unfinished_by_a_dead_process_is_removed_at_start(app_client, database_url, gone):
    api = app_client(database_url)
    run_id = api.create_run("r")
    host = socket.gethostname()
    claimer = f"{host}:999999999:x" if gone == "dead-process" else f"elsewhere:{os.getpid()}:x"
    created = time.time() - (0 if gone == "dead-process" else 10_000)
    with api.services.db.write() as session:
        audit_id = repo.insert_audit(
            session=session,
            values={"run_id": run_id, "step": 0, "rank": 0, "micro_batch": 0, "status": "receiving",
                    "claimed_by": claimer, "config": {}, "reported": {}, "blob": b"x" * 1000,
                    "nbytes": 1000, "created_at": created},
        )  # fmt: skip
    api.restart()
    assert api.get(f"/api/v1/audits/{audit_id}").status_code == 404
    assert api.get(f"/api/v1/runs/{run_id}/audits").json()["count"] == 0


@pytest.mark.heavy
@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_the_workers_audit_events_reach_live_streams(serve, db, request):
    """The worker's events reach the server's subscribers: over its pipe on SQLite (one process
    delivers events in memory), by NOTIFY on PostgreSQL."""
    from tests.service.sse import SSEClient

    url = request.getfixturevalue("pg_url") if db == "postgresql" else None
    server = serve(url, env={"RLVITALS_SSE_HEARTBEAT": "1"})
    run_id = httpx.post(f"{server.url}/api/v1/runs", json={"name": "live"}).json()["id"]
    stream = SSEClient(f"{server.url}/api/v1/runs/{run_id}/events")
    try:
        response = httpx.post(
            f"{server.url}/api/v1/runs/{run_id}/batches", content=make_batch(3), headers=OCTET, timeout=60
        )
        assert response.status_code == 202, response.text
        _, data = stream.wait_for(lambda kind, d: kind == "audit" and d["status"] == "done", timeout=90)
        assert data["id"] == response.json()["id"] and data["step"] == 3
    finally:
        stream.close()


def test_sqlite_passes_the_writer_lock_to_others_while_a_large_batch_is_stored(app_client, sqlite_url):
    """SQLite has one writer at a time: a large batch is written a chunk per transaction, so a
    trainer's write commits while the batch is half stored, and the batch is not claimed before it is
    whole. (Before: the whole batch was written in the upload's one transaction.)"""
    from rlvitals.service import batches
    from rlvitals.service.storage.blobs import SpooledBody

    api = app_client(sqlite_url, audit_workers=1)
    run_id, other = api.create_run("flood"), api.create_run("trainer")
    data = make_batch(0, batch=64, length=8192)  # ~8 MB: over the 4 MiB written in one transaction
    halfway, go_on = threading.Event(), threading.Event()

    class Gated(SpooledBody):
        def chunks(self, size: int = 1024 * 1024):
            for n, chunk in enumerate(super().chunks(size)):
                if n == 2:
                    halfway.set()
                    assert go_on.wait(60)
                yield chunk

    body = Gated()
    body.write(data)
    batch = batches.validate(data)[0]
    submitted: list = []
    thread = threading.Thread(
        target=lambda: submitted.append(api.services.audits.submit(run_id=run_id, batch=batch, blob=body))
    )
    thread.start()
    try:
        assert halfway.wait(30)
        started = time.monotonic()
        assert api.log(other, [{"step": 0, "metrics": {"loss": 1.0}}]).status_code == 200
        assert time.monotonic() - started < 10  # not behind the rest of the batch
        time.sleep(1.0)  # an idle worker polls meanwhile: the half-stored batch is not claimable
        with api.services.db.read() as session:
            (audit,) = repo.list_audits(session=session, run_id=run_id)[0]
        assert audit["status"] == "receiving"
        assert api.get(f"/api/v1/audits/{audit['id']}").json()["status"] == "pending"
    finally:
        go_on.set()
        thread.join(timeout=60)
        body.close()
    audit_id, resent = submitted[0]
    assert resent is None
    assert wait_done(api, audit_id, timeout=90)["status"] == "done"


def test_the_server_process_tunes_glibc_malloc_for_large_buffers():
    # rlvitals serve calls this first; on glibc it takes effect (mallopt), elsewhere it says it did not
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    assert tune_malloc() is bool(libc and libc.startswith("glibc"))
