"""A real server after an upload goes wrong or a large batch is audited: an aborted upload costs one log
line, and the memory of a large batch's audit goes back to the system when the audit is done
(``release_memory``: glibc's ``malloc_trim`` after each job). bench/upload.py prints the peaks."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.service.batchdata import OCTET, make_batch, make_tensors

pytestmark = pytest.mark.heavy  # real servers fed large uploads

MIB = 1024 * 1024


def _rss(pid: int, key: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def _wait_audit(url: str, audit_id: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while (audit := httpx.get(f"{url}/api/v1/audits/{audit_id}").json())["status"] == "pending":
        assert time.monotonic() < deadline, audit
        time.sleep(0.1)
    return audit


def test_an_aborted_upload_logs_one_line_without_a_traceback(serve):
    server = serve()
    run_id = httpx.post(f"{server.url}/api/v1/runs", json={"name": "aborted"}).json()["id"]
    head = (
        f"POST /api/v1/runs/{run_id}/batches HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {8 * MIB}\r\n\r\n"
    )
    start = len(server.log())
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + b"\0" * (256 * 1024))
        time.sleep(0.3)  # the server is inside the body now
    deadline = time.monotonic() + 20
    while "aborted" not in server.log()[start:]:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # anything the abort logs after its line lands now
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    log = server.log()[start:]  # what the server wrote since the upload began
    lines = [line for line in log.splitlines() if "aborted" in line or "disconnect" in line.lower()]
    assert len(lines) == 1, log[-3000:]
    assert f"/api/v1/runs/{run_id}/batches" in lines[0] and "bytes" in lines[0], lines
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


def test_a_large_batch_is_released_after_its_audit(serve):
    """A 96 MiB batch is read back, audited and its histograms drawn; after that the server's resident
    set comes back near where it was before the upload (before: ~1 GB of a 191 MiB batch stayed)."""
    server = serve(env={"RLVITALS_MAX_AUDIT_TOKENS": str(1 << 26), "RLVITALS_AUDIT_WORKERS": "1"}, timeout=60)
    run_id = httpx.post(f"{server.url}/api/v1/runs", json={"name": "big"}).json()["id"]
    url = f"{server.url}/api/v1/runs/{run_id}/batches"
    pid = server.popen.pid
    # torch and the audit's code paths are loaded by a first, small batch of the same kind
    warm = httpx.post(url, content=make_batch(0, tensors=make_tensors(64, 1024)), headers=OCTET, timeout=60)
    assert _wait_audit(server.url, warm.json()["id"])["status"] == "done"
    time.sleep(1.0)
    before = _rss(pid)
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS: the peak below is this upload's and its audit's
    body = make_batch(1, tensors=make_tensors(batch=512, length=12 * 1024))  # 96 MiB: 4 x float32
    response = httpx.post(url, content=body, headers=OCTET, timeout=120)
    assert response.status_code == 202, response.text
    assert _wait_audit(server.url, response.json()["id"])["status"] == "done"
    # the worker draws the histograms after the result is visible, then frees the batch: wait for it
    deadline = time.monotonic() + 60
    while (after := _rss(pid)) - before > len(body) // 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    peak = _rss(pid, "VmHWM") - before
    print(
        f"\n{len(body) / MIB:.0f} MiB batch: peak RSS +{peak / MIB:.0f} MiB ({peak / len(body):.2f}x), "
        f"after its audit +{(after - before) / MIB:.0f} MiB"
    )
    assert after - before < len(body) // 2, (
        f"the server still holds {(after - before) / MIB:.0f} MiB more than before a "
        f"{len(body) / MIB:.0f} MiB batch's audit"
    )
