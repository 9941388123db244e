"""/api/v1/runs/{id}/events: Server-Sent Events (``points``, ``alert``, ``audit``) for live dashboards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.deps import RunId, ServicesDep
from rlvitals.service.context import Services
from rlvitals.service.runs import require_run
from starlette.responses import StreamingResponse

router = APIRouter(prefix="/api/v1", tags=["events"])


async def _stream(services: Services, run_id: int, sub) -> AsyncIterator[str]:
    heartbeat = services.settings.sse_heartbeat
    try:
        yield f"retry: 2000\n: connected to run {run_id}\n\n"
        while True:
            try:
                frame = await asyncio.wait_for(sub.queue.get(), timeout=heartbeat)
            except asyncio.TimeoutError:
                yield ": ping\n\n"
                continue
            if frame is None:  # server stopping, or this client fell too far behind
                return
            yield frame
    finally:
        services.bus.unsubscribe(sub)


@router.get(
    "/runs/{run_id}/events",
    responses={200: {"content": {"text/event-stream": {}}, "description": "event: points|alert|audit"}},
)
async def run_events(run_id: RunId, services: ServicesDep) -> StreamingResponse:
    """A live stream: ``event: points`` ({"run_id", "steps": [...]}), ``event: alert`` (an alert),
    ``event: audit`` (an audit), each with a JSON ``data:`` line."""
    await run_in_threadpool(require_run, services, run_id)
    sub = services.bus.subscribe(run_id)
    return StreamingResponse(
        _stream(services, run_id, sub),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
