"""Each client has a share of the parse budget (``max_parsing_bytes``), so one client's parallel
large bodies cannot get another client's request refused.

Before: the budget was one pool; a client with several large JSON bodies in flight held all of it, and
another client's mid-sized write (over the always-admitted ``SMALL_BODY``) got 429 until they finished.
"""

from __future__ import annotations

import asyncio
import json
import time

from rlvitals.service.api.limits import JSON_WEIGHT, SMALL_BODY, ParseGate

MIB = 1024 * 1024


def test_a_client_holding_a_body_is_refused_more_than_its_share():
    gate = ParseGate(limit=16 * MIB)
    assert gate.try_hold(8 * MIB, "hog") is None
    assert gate.try_hold(8 * MIB, "hog") is None  # alone, a client may use the whole budget
    assert gate.try_hold(2 * MIB, "b") is None  # within b's share (16 // 2), while the hog holds more
    refused = gate.try_hold(2 * MIB, "hog")
    assert refused is not None and refused.detail["client_share"] == 8 * MIB
    assert "share" in refused.message and "max_parsing_bytes" in refused.message
    assert gate.try_hold(SMALL_BODY, "hog") is None  # small bodies are always admitted
    gate.release(SMALL_BODY, "hog")
    assert gate.try_hold(8 * MIB, "c") is not None  # over c's share (16 // 3) and past the limit
    assert gate.try_hold(5 * MIB, "c") is None  # within it, while the hog holds more than its own
    assert gate.try_hold(5 * MIB, "d") is not None  # 36 MiB would pass twice the limit
    for nbytes, client in ((8 * MIB, "hog"), (8 * MIB, "hog"), (2 * MIB, "b"), (5 * MIB, "c")):
        gate.release(nbytes, client)
    assert gate.held == 0 and gate.clients == {}


def test_when_nobody_holds_more_than_their_share_the_limit_is_as_before():
    gate = ParseGate(limit=16 * MIB)
    assert gate.try_hold(20 * MIB, "a") is None  # nothing held: any body is admitted
    refused = gate.try_hold(9 * MIB, "b")  # more than b's share (16 // 2): the plain limit applies
    assert refused is not None and refused.detail == {"held": 20 * MIB, "limit": 16 * MIB, "request": 9 * MIB}
    gate.release(20 * MIB, "a")
    assert gate.try_hold(6 * MIB, "a") is None
    assert gate.try_hold(6 * MIB, "b") is None
    refused = gate.try_hold(6 * MIB, "c")  # 18 MiB of 16, and nobody holds more than 16 // 3
    assert refused is not None and "max_parsing_bytes" in refused.message
    refused = gate.try_hold(12 * MIB, "a")  # alone, a would fit; beside b it passes its share
    assert refused is not None and refused.detail["client_held"] == 6 * MIB


async def _drip(total: int, seconds: float):
    yield b'{"steps": ['
    sent, deadline = 11, time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield b" "
        sent += 1
        await asyncio.sleep(0.2)
    yield b" " * (total - sent - 2) + b"]}"


def _start(api, run_id: int, key: str, nbytes: int, seconds: float):
    headers = {
        "content-type": "application/json",
        "authorization": f"Bearer {key}",
        "content-length": str(nbytes),
    }
    coro = api.client.post(f"/api/v1/runs/{run_id}/metrics", content=_drip(nbytes, seconds), headers=headers)
    return asyncio.run_coroutine_threadsafe(coro, api._loop)


def test_a_flooding_client_cannot_get_another_clients_write_refused(app_client, sqlite_url):
    api = app_client(sqlite_url, max_parsing_bytes=16 * MIB)
    run_id = api.create_run()
    held = [_start(api, run_id, "hog", MIB, seconds=3.0) for _ in range(2)]  # 2 x 8 MiB weighted
    time.sleep(0.8)
    steps = [{"step": s, "metrics": {"loss": 0.5, "pad": 0.25}} for s in range(4000)]  # ~160 KB: 1.3 MiB
    assert len(json.dumps({"steps": steps})) * JSON_WEIGHT > SMALL_BODY
    other = api.post(
        f"/api/v1/runs/{run_id}/metrics", json={"steps": steps}, headers={"authorization": "Bearer trainer"}
    )
    assert other.status_code == 200, other.text  # before: 429, the hog held the whole budget
    third = _start(api, run_id, "hog", MIB, seconds=0.1).result(timeout=30)
    assert third.status_code == 429 and third.headers["retry-after"], third.text  # the budget is full
    assert set(third.json()["error"]) == {"code", "message", "detail"}
    assert [f.result(timeout=30).status_code for f in held] == [200, 200]


def _scope(authorization: str | None, address: str = "10.0.0.7") -> dict:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return {"type": "http", "headers": headers, "client": (address, 50000)}


def test_made_up_keys_do_not_make_one_sender_many_clients(tmp_path):
    """Before: the parse gate counted a client by the hash of whatever Authorization header came, before
    authentication, so one sender with a made-up key per request got a share of the budget for each."""
    from rlvitals.service.api.limits import client_of
    from rlvitals.service.app import build_services
    from rlvitals.service.auth import create_key
    from rlvitals.service.settings import Settings

    services = build_services(Settings(database_url=f"sqlite:///{tmp_path}/k.db", data_dir=str(tmp_path)))
    try:
        services.db.migrate()
        auth = services.auth
        # an open server (no key was ever created): any bearer key names its sender, as without auth
        assert auth.enabled() is False
        assert client_of(_scope("Bearer made-up-1"), auth) != client_of(_scope("Bearer made-up-2"), auth)
        _, key = create_key(services.db, name="trainer")
        auth.invalidate()
        assert auth.enabled() is True
        made_up = {client_of(_scope(f"Bearer made-up-{i}"), auth) for i in range(50)}
        assert made_up == {"addr:10.0.0.7"}  # fifty made-up keys from one address: one client
        assert client_of(_scope(f"Bearer {key}"), auth) == "addr:10.0.0.7"  # not yet seen accepted
        auth.check_write(f"Bearer {key}")
        mine = client_of(_scope(f"Bearer {key}"), auth)
        assert mine.startswith("key:") and mine == client_of(_scope(f"Bearer {key}", "10.9.9.9"), auth)
        assert (
            client_of(_scope(None), auth) == client_of(_scope("Basic Zm9vOmJhcg=="), auth) == "addr:10.0.0.7"
        )
        # without an authenticator (the gates' own tests), the key names its sender as before
        assert client_of(_scope("Bearer made-up-1")).startswith("key:")
    finally:
        services.db.dispose()
