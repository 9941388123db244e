"""Batch uploads cannot be held open by a slow sender, and one client cannot take every upload slot.

Before: ``body_timeout`` bounded each pause between chunks only, so a body dripping a byte every few
seconds held its upload slot for as long as it liked, and four such bodies from one client held all
of them (every other client got 429).
"""

from __future__ import annotations

import asyncio
import time

BATCHES = "/api/v1/runs/{}/batches"
OCTET = {"content-type": "application/octet-stream"}


async def _drip(seconds: float, every: float = 0.3):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield b"x"
        await asyncio.sleep(every)


def _start(api, run_id: int, key: str, seconds: float):
    headers = {**OCTET, "authorization": f"Bearer {key}", "content-length": str(10 * 1024 * 1024)}
    coro = api.client.post(BATCHES.format(run_id), content=_drip(seconds), headers=headers)
    return asyncio.run_coroutine_threadsafe(coro, api._loop)


def test_a_dripping_upload_is_cut_off_by_the_whole_body_deadline(app_client, sqlite_url):
    api = app_client(sqlite_url, body_timeout=1.0, upload_min_rate=64 * 1024)
    run_id = api.create_run()
    started = time.monotonic()
    response = _start(api, run_id, "a", seconds=8.0).result(timeout=30)
    took = time.monotonic() - started
    assert response.status_code == 408, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    assert "upload_min_rate" in response.json()["error"]["message"]
    assert took < 4.0, f"a byte every 0.3 s held the upload {took:.1f} s"


def test_one_client_cannot_hold_every_upload_slot(app_client, sqlite_url):
    api = app_client(sqlite_url, max_concurrent_uploads=4, max_uploads_per_client=2, upload_min_rate=1)
    run_id, other_run = api.create_run("a"), api.create_run("b")
    held = [_start(api, run_id, "hog", seconds=3.0) for _ in range(2)]
    time.sleep(0.5)
    third = _start(api, run_id, "hog", seconds=0.1).result(timeout=30)  # a third to the same run
    assert third.status_code == 429 and third.headers["retry-after"]
    assert "max_uploads_per_client" in third.json()["error"]["message"]
    held.append(_start(api, other_run, "hog", seconds=3.0))  # its third slot, on another run
    time.sleep(0.5)
    fourth = _start(api, other_run, "hog", seconds=0.1).result(timeout=30)  # the last slot: not for it
    assert fourth.status_code == 429 and fourth.json()["error"]["detail"]["limit"] == 3
    other = api.post(
        BATCHES.format(run_id), content=b"not safetensors", headers={**OCTET, "authorization": "Bearer b"}
    )
    assert other.status_code == 422, other.text  # admitted: refused for its content, not for a slot
    assert [f.result(timeout=30).status_code for f in held] == [400, 400, 400]  # short of their length


def test_bodies_parsed_at_once_are_capped_json_and_uploads_together(app_client, sqlite_url):
    """An upload holding most of max_parsing_bytes makes a JSON write that would pass it wait: 429 with
    Retry-After in the one error shape (before: nothing capped the bodies parsed at once)."""
    api = app_client(sqlite_url, max_parsing_bytes=3 * 1024 * 1024, upload_min_rate=1)
    run_id = api.create_run()
    steps = [
        {"step": s, "metrics": {"loss": 0.5, "pad": 0.25}} for s in range(4000)
    ]  # ~160 KB: 1.3 MB weighted
    assert api.log(run_id, steps[:10]).status_code == 200
    held = _start(api, run_id, "a", seconds=2.0)  # 10 MiB: admitted, nothing else is held
    time.sleep(0.5)
    refused = api.log(run_id, steps)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "busy"
    assert "max_parsing_bytes" in refused.json()["error"]["message"]
    assert held.result(timeout=30).status_code == 400
    assert api.log(run_id, steps).status_code == 200  # released


def test_a_client_under_its_share_of_slots_gets_one_while_another_holds_more(app_client, sqlite_url):
    """Every slot taken, mostly by one client: another client under its share of the slots (4 // the
    clients uploading) still gets one, up to twice the slots; one holding its share does not.
    Before: a client uploading from three threads kept three of four slots, and every other client
    collided on the last one."""
    api = app_client(sqlite_url, max_concurrent_uploads=4, max_uploads_per_client=3, upload_min_rate=1)
    run_id, other_run = api.create_run("a"), api.create_run("b")
    held = [_start(api, run_id, "hog", seconds=3.0) for _ in range(3)]  # all slots but one
    held.append(_start(api, other_run, "b", seconds=3.0))  # the last one
    time.sleep(0.8)
    admitted = api.post(
        BATCHES.format(other_run), content=b"not safetensors", headers={**OCTET, "authorization": "Bearer c"}
    )
    assert admitted.status_code == 422, admitted.text  # admitted: refused for its content, not for a slot
    held.append(_start(api, other_run, "b", seconds=3.0))  # b's second: its share is 4 slots // 2 clients
    time.sleep(0.5)
    refused = _start(api, other_run, "b", seconds=0.1).result(timeout=30)  # b holds its share already
    assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
    assert "max_concurrent_uploads" in refused.json()["error"]["message"]
    assert [f.result(timeout=30).status_code for f in held] == [400] * 5
