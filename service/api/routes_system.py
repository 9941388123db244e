"""/healthz (readiness) and /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.deps import ServicesDep
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.errors import error_response
from starlette.responses import PlainTextResponse

router = APIRouter(tags=["system"])


@router.get("/healthz")
async def healthz(services: ServicesDep) -> JSONResponse:
    """200 once migrations ran and the database answers; 503 otherwise."""
    try:
        await run_in_threadpool(services.db.ping)
    except Exception as exc:
        return error_response(503, "unavailable", f"database unreachable: {type(exc).__name__}")
    return JSONResponse({"status": "ok", "database": services.db.dialect})


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(services: ServicesDep) -> PlainTextResponse:
    text = await run_in_threadpool(
        services.telemetry.render,
        services.db,
        sse_clients=services.bus.subscriber_count(),
        live_signals=services.health.live_signals(),
        ingest_commits=services.writer.groups,
        ingest_queued=services.writer.queued(),
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
