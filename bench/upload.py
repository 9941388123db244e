"""Peak memory of a batch upload in a real ``rlvitals serve`` process: body size vs peak RSS growth.

A safetensors upload of ``--sizes`` MiB each (float32 tensors) is POSTed to a server on 127.0.0.1
(SQLite file, and PostgreSQL with ``--pg-url``). For each upload the server's resident set is read
from /proc before it, and its peak from ``VmHWM`` after it (reset with ``clear_refs`` first, so the
peak is exact, not sampled). Two phases per database:

- ``upload``: ``RLVITALS_AUDIT_WORKERS=0``: receiving, validating and storing only;
- ``audit``: one audit worker: the upload, then the worker reading the batch back and auditing it.

The ratio column is the peak growth over the body size: 1.0 means the process held about one copy
of the body at its peak. Medians of ``--repeat`` uploads per size.

    .venv/bin/python bench/upload.py                       # SQLite, 64 and 225 MiB
    .venv/bin/python bench/upload.py --pg-url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import Server, free_port

MIB = 1024 * 1024


def make_body(mib: float, seed: int = 0) -> bytes:
    """A valid batch of about ``mib`` MiB: four float32 (batch, length) tensors."""
    length = 4096
    batch = max(1, int(mib * MIB / (4 * 4 * length)))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g)
    tensors = {
        "log_prob": old + 0.01 * torch.randn(batch, length, generator=g),
        "old_log_prob": old,
        "advantages": torch.randn(batch, length, generator=g),
        "response_mask": torch.ones(batch, length),
    }
    return save(tensors, metadata={"step": "0", "config": "{}", "reported": "{}"})


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS


def _request(port: int, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_audit(port: int, audit_id: int, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, data = _request(port, "GET", f"/api/v1/audits/{audit_id}")
        state = json.loads(data)["status"]
        if status == 200 and state not in ("pending", "running"):
            return state
        time.sleep(0.2)
    raise TimeoutError(f"audit {audit_id} still pending after {timeout}s")


def measure(database_url: str, workdir: Path, phase: str, sizes: list[float], repeat: int) -> list[dict]:
    port = free_port()
    env = {
        "RLVITALS_AUDIT_WORKERS": "0" if phase == "upload" else "1",
        "RLVITALS_AUDIT_HISTOGRAMS": "false",
        "RLVITALS_MAX_BATCH_BYTES": str(1024 * MIB),
        "RLVITALS_MAX_AUDIT_TOKENS": str(1 << 30),
    }
    argv = [sys.executable, "-m", "rlvitals.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--database-url", database_url]  # fmt: skip
    rows = []
    with Server(
        name=f"rlvitals-{phase}", argv=argv, port=port, workdir=workdir, ready_path="/healthz", env=env
    ) as srv:
        srv.start(timeout=60)
        _, data = _request(port, "POST", "/api/v1/runs", json.dumps({"name": f"upload-{phase}"}).encode())
        run_id = json.loads(data)["id"]
        # Warm up: torch is imported with the first batch (~180 MiB that is not the upload's).
        status, data = _request(
            port, "POST", f"/api/v1/runs/{run_id}/batches", make_body(1), "application/octet-stream"
        )
        assert status == 202, data
        if phase == "audit":
            _wait_audit(port, json.loads(data)["id"])
        for mib in sizes:
            body = make_body(mib)
            growth = []
            for _ in range(repeat):
                time.sleep(0.5)
                before = _status(srv.pid)["VmRSS"]
                _reset_peak(srv.pid)
                status, data = _request(
                    port, "POST", f"/api/v1/runs/{run_id}/batches", body, "application/octet-stream"
                )
                assert status == 202, data[:300]
                if phase == "audit":
                    state = _wait_audit(port, json.loads(data)["id"])
                    assert state == "done", state
                growth.append(_status(srv.pid)["VmHWM"] - before)
            median = statistics.median(growth)
            rows.append({"phase": phase, "body_mib": len(body) / MIB, "peak_growth_mib": median / MIB,
                         "ratio": median / len(body)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,225", help="upload sizes in MiB, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pg-url", default=None, help="also measure on this PostgreSQL database")
    ap.add_argument("--phases", default="upload,audit")
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="rlvitals-upload-bench-") as tmp:
        work = Path(tmp)
        targets = [("SQLite", f"sqlite:///{work / 'rlvitals.db'}")]
        if args.pg_url:
            targets.append(("PostgreSQL", args.pg_url))
        print("| database | phase | body MiB | peak RSS growth MiB (median) | growth / body |")
        print("|---|---|---:|---:|---:|")
        for name, url in targets:
            for phase in args.phases.split(","):
                for row in measure(url, work, phase, sizes, args.repeat):
                    print(f"| {name} | {row['phase']} | {row['body_mib']:.0f} | {row['peak_growth_mib']:.0f} | "
                          f"{row['ratio']:.2f}x |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
