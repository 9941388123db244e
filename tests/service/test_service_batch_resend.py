"""Idempotent batch uploads: a batch resent with the same metadata ``record_id`` is stored, counted
and audited once and answers the same id; on SQLite and PostgreSQL, also under concurrent resends."""

from __future__ import annotations

import threading

import pytest
from rlvitals.service.storage import repository as repo

from tests.service.batchdata import OCTET, make_batch, wait_done


def _post(api, run_id, body):
    return api.post(f"/api/v1/runs/{run_id}/batches", content=body, headers=OCTET)


def _audits(api, run_id):
    return api.get(f"/api/v1/runs/{run_id}/audits").json()


def _batches_total(api) -> float:
    for line in api.get("/metrics").text.splitlines():
        if line.startswith("rlvitals_batches_total"):
            return float(line.split()[-1])
    raise AssertionError("rlvitals_batches_total missing from /metrics")


def test_a_resend_answers_the_same_id_and_is_audited_once(api):
    run_id = api.create_run()
    body = make_batch(3, metadata={"record_id": "1a2b-00ff00ff00ff"})
    first = _post(api, run_id, body)
    assert first.status_code == 202, first.text
    assert first.json()["status"] == "pending"
    audit_id = first.json()["id"]
    done = wait_done(api, audit_id)
    again = _post(api, run_id, body)
    assert again.status_code == 200, again.text
    assert again.json() == {"id": audit_id, "status": done["status"]}
    listing = _audits(api, run_id)
    assert listing["count"] == 1 and [a["id"] for a in listing["data"]] == [audit_id]
    assert _batches_total(api) == 1
    assert api.get(f"/api/v1/audits/{audit_id}").json()["finished_at"] == done["finished_at"]  # not rerun


def test_a_resend_while_pending_answers_pending(app_client, database_url):
    api = app_client(database_url, audit_workers=0)  # nothing audits: the job stays queued
    run_id = api.create_run()
    body = make_batch(1, metadata={"record_id": "p-1"})
    audit_id = _post(api, run_id, body).json()["id"]
    again = _post(api, run_id, body)
    assert (again.status_code, again.json()) == (200, {"id": audit_id, "status": "pending"})
    with api.services.db.read() as session:
        assert repo.count_waiting_audits(session=session) == 1


def test_a_resend_is_not_refused_when_the_queue_is_full(app_client, database_url):
    api = app_client(database_url, audit_workers=0, audit_queue_size=1)
    run_id = api.create_run()
    body = make_batch(1, metadata={"record_id": "q-1"})
    audit_id = _post(api, run_id, body).json()["id"]
    assert _post(api, run_id, make_batch(2, metadata={"record_id": "q-2"})).status_code == 429
    assert _post(api, run_id, body).json()["id"] == audit_id


def test_different_record_ids_and_runs_are_different_uploads(api):
    run_a, run_b = api.create_run("a"), api.create_run("b")
    ids = [
        _post(api, run_a, make_batch(1, metadata={"record_id": "r-1"})).json()["id"],
        _post(api, run_a, make_batch(1, metadata={"record_id": "r-2"})).json()["id"],
        _post(api, run_b, make_batch(1, metadata={"record_id": "r-1"})).json()["id"],  # other run
    ]
    assert len(set(ids)) == 3
    assert _audits(api, run_a)["count"] == 2 and _audits(api, run_b)["count"] == 1


def test_uploads_without_a_record_id_are_always_new(api):
    run_id = api.create_run()
    body = make_batch(1)
    responses = [_post(api, run_id, body) for _ in range(2)]
    assert [r.status_code for r in responses] == [202, 202]
    assert responses[0].json()["id"] != responses[1].json()["id"]
    assert _audits(api, run_id)["count"] == 2


@pytest.mark.parametrize(
    "record_id", ["", "has space", "tab\there", "é-accent", "x" * 129, "new\nline", "\x00"]
)
def test_an_invalid_record_id_is_a_422(api, record_id):
    run_id = api.create_run()
    response = _post(api, run_id, make_batch(1, metadata={"record_id": record_id}))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_input" and "record_id" in error["message"]
    assert _audits(api, run_id)["count"] == 0


def test_the_longest_record_id_is_accepted(api):
    run_id = api.create_run()
    body = make_batch(1, metadata={"record_id": "~" * 128})
    assert _post(api, run_id, body).status_code == 202
    assert _post(api, run_id, body).status_code == 200


def test_concurrent_identical_uploads_store_one_row(app_client, database_url):
    """Two replicas on one database, 8 threads sending the same upload at once: one row, one id."""
    slots = {
        "audit_workers": 0,
        "max_concurrent_uploads": 8,
        "max_uploads_per_client": 8,
    }  # one client, 4 at once
    replicas = [app_client(database_url, **slots), app_client(database_url, **slots)]
    run_id = replicas[0].create_run()
    for replica in replicas:  # FastAPI builds routes on first use, muting a pydantic warning with the
        # process-wide warnings.catch_warnings: two apps in one process doing that at once can unmute it
        assert _post(replica, run_id, b"not safetensors").status_code == 422
    body = make_batch(7, metadata={"record_id": "race-0123456789ab"})
    barrier = threading.Barrier(8)
    answers: list = []

    def send(i):
        barrier.wait()
        answers.append(_post(replicas[i % 2], run_id, body))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(r.status_code for r in answers) == [200] * 7 + [202], [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    assert _audits(replicas[0], run_id)["count"] == 1
    with replicas[0].services.db.read() as session:
        assert repo.count_waiting_audits(session=session) == 1


def test_insert_audit_once_finds_the_row_a_conflicting_insert_left(api):
    """The repository's race path: the insert conflicts and the select returns the stored row."""
    run_id = api.create_run()
    values = {"run_id": run_id, "step": 1, "rank": None, "micro_batch": None, "status": "pending",
              "config": {}, "reported": {}, "blob": b"x", "nbytes": 1, "created_at": 0.0,
              "record_id": "direct-1"}  # fmt: skip
    with api.services.db.write() as session:
        first = repo.insert_audit_once(session=session, values=values)
    with api.services.db.write() as session:
        second = repo.insert_audit_once(session=session, values={**values, "step": 2})
        assert repo.audit_id_for_record(session=session, run_id=run_id, record_id="direct-1") == first[0]
    assert first[1] is True and second == (first[0], False)
    assert _audits(api, run_id)["data"][0]["step"] == 1  # the first upload is kept
