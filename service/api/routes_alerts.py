"""/api/v1 alerts: per run and across runs."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.alerts import list_alerts
from rlvitals.service.api.deps import Offset, RunId, ServicesDep
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.schemas import AlertsPublic

router = APIRouter(prefix="/api/v1", tags=["alerts"])

State = Annotated[Literal["firing", "resolved"] | None, Query()]
Limit = Annotated[int, Query(ge=1, le=10_000)]


@router.get("/runs/{run_id}/alerts", response_model=AlertsPublic)
async def run_alerts(
    run_id: RunId, services: ServicesDep, state: State = None, limit: Limit = 1000, offset: Offset = 0
) -> JSONResponse:
    return JSONResponse(
        await run_in_threadpool(list_alerts, services, run_id=run_id, state=state, limit=limit, offset=offset)
    )


@router.get("/alerts", response_model=AlertsPublic)
async def all_alerts(
    services: ServicesDep, state: State = None, limit: Limit = 1000, offset: Offset = 0
) -> JSONResponse:
    """Alerts of every run, newest first; ``?state=firing`` for what is wrong right now."""
    return JSONResponse(
        await run_in_threadpool(list_alerts, services, run_id=None, state=state, limit=limit, offset=offset)
    )
