"""/api/v1 incidents: a run's incidents, and one incident with the alerts behind it."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.deps import MAX_ID, Offset, RunId, ServicesDep
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.incidents import get_incident, list_incidents
from rlvitals.service.schemas import IncidentDetailPublic, IncidentsPublic

router = APIRouter(prefix="/api/v1", tags=["incidents"])

State = Annotated[Literal["open", "resolved"] | None, Query()]
Limit = Annotated[int, Query(ge=1, le=10_000)]
IncidentId = Annotated[int, Path(ge=0, le=MAX_ID, description="An incident id.")]


@router.get("/runs/{run_id}/incidents", response_model=IncidentsPublic)
async def run_incidents(
    run_id: RunId, services: ServicesDep, state: State = None, limit: Limit = 1000, offset: Offset = 0
) -> JSONResponse:
    """The run's incidents, newest first; ``?state=open`` for what is wrong right now."""
    return JSONResponse(
        await run_in_threadpool(
            list_incidents, services, run_id=run_id, state=state, limit=limit, offset=offset
        )
    )


@router.get("/incidents", response_model=IncidentsPublic)
async def all_incidents(
    services: ServicesDep, state: State = None, limit: Limit = 1000, offset: Offset = 0
) -> JSONResponse:
    """Incidents of every run, newest first; ``?state=open`` for what is wrong right now."""
    return JSONResponse(
        await run_in_threadpool(
            list_incidents, services, run_id=None, state=state, limit=limit, offset=offset
        )
    )


@router.get("/incidents/{incident_id}", response_model=IncidentDetailPublic)
async def incident(incident_id: IncidentId, services: ServicesDep) -> JSONResponse:
    """One incident: its cause, severity, evidence (every finding with its value and step), the GPU-hours
    spent after its onset, and the alerts behind it."""
    return JSONResponse(await run_in_threadpool(get_incident, services, incident_id=incident_id))
