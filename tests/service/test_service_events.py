"""Live event fan-out: slow SSE clients are cut off instead of buffering without bound, and with
``--workers 2`` on SQLite every worker's events reach every stream."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from rlvitals.service.events import Event, LocalBus

from tests.service.sse import SSEClient


def test_a_client_that_falls_behind_is_disconnected_not_buffered():
    async def scenario():
        bus = LocalBus(queue_size=3)
        bus.start(asyncio.get_running_loop())
        slow = bus.subscribe(7)
        other_run = bus.subscribe(8)
        bus.flush([Event(7, "points", {"run_id": 7, "steps": [{"step": s}]}) for s in range(10)])
        await asyncio.sleep(0.05)  # deliveries hop through call_soon_threadsafe
        frames = []
        while not slow.queue.empty():
            frames.append(slow.queue.get_nowait())
        assert frames[-1] is None and slow.closed  # closed: the stream ends, the client reconnects
        assert len(frames) <= 3
        assert other_run.queue.empty()  # events only reach their run's subscribers
        bus.unsubscribe(slow)
        assert bus.subscriber_count() == 1

    asyncio.run(scenario())


def test_frames_are_server_sent_events():
    frame = Event(1, "alert", {"value": float("nan"), "rule": "non_finite"}).frame()
    assert frame == 'event: alert\ndata: {"value":"NaN","rule":"non_finite"}\n\n'


@pytest.mark.heavy
def test_every_worker_process_feeds_every_stream_on_sqlite(serve):
    server = serve(env={"RLVITALS_SSE_HEARTBEAT": "1"}, args=("--workers", "2"), timeout=120)
    run_id = httpx.post(f"{server.url}/api/v1/runs", json={"name": "two"}).json()["id"]
    stream = SSEClient(f"{server.url}/api/v1/runs/{run_id}/events")
    try:
        for step in range(12):  # fresh connections: the kernel spreads them over both workers
            with httpx.Client() as client:
                body = {"steps": [{"step": step, "metrics": {"loss": 1.0}}]}
                assert client.post(f"{server.url}/api/v1/runs/{run_id}/metrics", json=body).status_code == 200
        seen = set()
        for step in range(12):
            _, data = stream.wait_for(lambda k, d, s=step: k == "points" and d["steps"][0]["step"] == s)
            seen.add(data["steps"][0]["step"])
        assert seen == set(range(12))
    finally:
        stream.close()
