"""Audits are scheduled fairly across runs (round robin over the runs with queued batches, in the
database, so on SQLite, PostgreSQL and across replicas), and ``/metrics`` shows how long each run's
oldest pending audit has waited.

Before: the queue was first-in-first-out across runs, so a run uploading many batches pushed another
run's audits behind all of its own.
"""

from __future__ import annotations

import time

from tests.service.batchdata import OCTET, make_batch, wait_done


def _upload(api, run_id: int, step: int) -> int:
    response = api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(step), headers=OCTET)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def test_a_busy_run_does_not_push_another_runs_audits_behind_its_own(app_client, database_url, tmp_path):
    api = app_client(database_url, audit_workers=0)  # queue first, audit after
    hog, quiet = api.create_run("hog"), api.create_run("quiet")
    hogs = [_upload(api, hog, step) for step in range(6)]
    quiets = [_upload(api, quiet, step) for step in range(2)]
    time.sleep(1.1)
    metrics = api.get("/metrics").text
    waits = [
        line for line in metrics.splitlines() if line.startswith("rlvitals_audit_oldest_pending_seconds{")
    ]
    assert len(waits) == 2 and all(float(line.split()[-1]) >= 1.0 for line in waits), waits
    assert any(f'run_id="{quiet}"' in line and 'run="quiet"' in line for line in waits)
    api.stop()
    api = app_client(database_url, audit_workers=1)
    done = {audit_id: wait_done(api, audit_id, timeout=60) for audit_id in hogs + quiets}
    order = sorted(done, key=lambda audit_id: done[audit_id]["finished_at"])
    # round robin: hog, quiet, hog, quiet, then the hog's rest
    assert order[:4] == [hogs[0], quiets[0], hogs[1], quiets[1]], order
    assert "rlvitals_audit_oldest_pending_seconds{" not in api.get("/metrics").text
