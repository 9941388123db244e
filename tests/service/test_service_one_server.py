"""One ``serve`` per SQLite file, and audits of a dead process reclaimed at restart (issue 13, item 6).

Before: a second ``rlvitals serve`` on the same file started, and each process's health rules saw
only the steps it received; after kill -9 a claimed audit waited the whole 300 s claim timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from rlvitals.service.audits import _PROCESS

from tests.service.batchdata import OCTET, make_batch, wait_done
from tests.support.servers import free_port


def _cli(*args: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlvitals.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)  # fmt: skip


@pytest.mark.heavy
def test_a_second_serve_on_the_same_sqlite_file_refuses_to_start(serve, tmp_path):
    url = f"sqlite:///{tmp_path / 'one.db'}"
    first = serve(database_url=url)
    second = _cli("serve", "--port", str(free_port()), "--database-url", url, cwd=tmp_path)
    assert second.returncode == 2, second.stderr[-2000:]
    assert "already serves" in second.stderr and "--workers" in second.stderr
    assert httpx.get(f"{first.url}/healthz").status_code == 200  # the first one is untouched
    other = f"sqlite:///{tmp_path / 'other.db'}"  # another file is another server
    assert httpx.get(f"{serve(database_url=other).url}/healthz").status_code == 200


@pytest.mark.heavy
def test_serve_with_workers_holds_the_lock_for_its_processes(serve, tmp_path):
    url = f"sqlite:///{tmp_path / 'workers.db'}"
    server = serve(database_url=url, args=("--workers", "2"))
    runs = {httpx.post(f"{server.url}/api/v1/runs", json={"name": f"r{i}"}).status_code for i in range(6)}
    assert runs <= {200, 201}
    again = _cli("serve", "--port", str(free_port()), "--database-url", url, cwd=tmp_path)
    assert again.returncode == 2 and "already serves" in again.stderr


def test_audits_claimed_by_a_dead_process_are_reclaimed_at_restart(app_client, database_url):
    api = app_client(database_url, audit_workers=0)  # nobody audits yet
    run_id = api.create_run()
    mine = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(0), headers=OCTET).json()["id"]
    theirs = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(1), headers=OCTET).json()["id"]
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()  # fmt: skip (a pid that no longer runs)
    host = socket.gethostname()
    claims = {
        mine: f"{host}:{dead}:deadbeef:rlvitals-audit-0",  # killed on this host
        theirs: f"{host}:{os.getpid()}:{'0' * 8}:rlvitals-audit-0",  # this pid, an earlier process
    }
    from rlvitals.service.storage.models import Audit
    from sqlalchemy import update

    with api.services.db.write() as session:
        for audit_id, claimer in claims.items():
            session.execute(update(Audit.__table__).where(Audit.__table__.c.id == audit_id)
                            .values(status="running", claimed_by=claimer, claimed_at=time.time()))  # fmt: skip
    api.stop()
    api.settings = api.settings.model_copy(update={"audit_workers": 1})  # claim timeout stays 300 s
    api.start()
    started = time.monotonic()
    assert wait_done(api, mine, timeout=15)["status"] == "done"
    assert wait_done(api, theirs, timeout=15)["status"] == "done"
    assert time.monotonic() - started < 15
    assert _PROCESS not in claims[theirs]
