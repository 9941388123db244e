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


def _post(api, run_id: int, step: int):
    return api.post(f"/api/v1/runs/{run_id}/batches", content=make_batch(step), headers=OCTET)


def _busy(response) -> dict:
    assert response.status_code == 429, response.text
    assert int(response.headers["retry-after"]) >= 1
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "detail"}
    assert body["error"]["code"] == "busy"
    return body["error"]


def test_a_run_flooding_the_audit_queue_cannot_get_another_runs_upload_refused(app_client, database_url):
    api = app_client(database_url, audit_workers=0, audit_queue_size=4)  # queued, never drained here
    flood, quiet, third, fourth, fifth = (api.create_run(name) for name in ("flood", "quiet", "c", "d", "e"))
    for step in range(4):  # alone, a run may hold the whole queue
        assert _post(api, flood, step).status_code == 202
    assert _busy(_post(api, flood, 4))["detail"] == {"waiting": 4, "limit": 4}
    # the flooder filled the queue first: another run still gets its share (4 // 2 runs = 2)
    assert _post(api, quiet, 0).status_code == 202
    assert _post(api, quiet, 1).status_code == 202
    held = _busy(_post(api, quiet, 2))
    assert held["detail"] == {"waiting": 6, "limit": 4, "run_waiting": 2, "run_share": 2}, held
    assert "share" in held["message"]
    assert _busy(_post(api, flood, 5))["detail"] == {
        "waiting": 6,
        "limit": 4,
        "run_waiting": 4,
        "run_share": 2,
    }
    # more runs get their share (4 // 3 = 1) while the flooder holds more than its own, up to twice the size
    assert _post(api, third, 0).status_code == 202
    assert _post(api, fourth, 0).status_code == 202
    assert _busy(_post(api, fifth, 0))["detail"] == {"waiting": 8, "limit": 4}


def test_a_run_cannot_take_more_than_its_share_while_another_has_audits_waiting(app_client, database_url):
    api = app_client(database_url, audit_workers=0, audit_queue_size=4)
    flood, quiet = api.create_run("flood"), api.create_run("quiet")
    assert _post(api, quiet, 0).status_code == 202
    accepted = 0
    while (response := _post(api, flood, accepted)).status_code == 202:
        accepted += 1
    assert accepted == 2  # 4 // 2 runs with audits waiting
    assert _busy(response)["detail"] == {"waiting": 3, "limit": 4, "run_waiting": 2, "run_share": 2}
    assert _post(api, quiet, 1).status_code == 202  # the queue still has the quiet run's share
