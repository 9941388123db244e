"""/api/v1/runs: create or resume, list, get."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service import runs
from rlvitals.service.api.deps import Offset, RunId, ServicesDep, WriteAuth
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.schemas import HealthPublic, RunCreate, RunPublic, RunsPublic

router = APIRouter(prefix="/api/v1", tags=["runs"])


@router.post(
    "/runs",
    response_model=RunPublic,
    status_code=201,
    dependencies=[WriteAuth],
    responses={200: {"model": RunPublic, "description": "The run already existed: resumed."}},
)
async def create_run(body: RunCreate, services: ServicesDep) -> JSONResponse:
    """Create the run (201), or resume the existing run with the same (project, name) (200, same id)."""
    run, created = await run_in_threadpool(runs.create_or_resume, services, body)
    return JSONResponse(run, status_code=201 if created else 200)


@router.get("/runs", response_model=RunsPublic)
async def list_runs(
    services: ServicesDep,
    project: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
    include: Annotated[
        Literal["config"] | None, Query(description="config: also each run's config (left out by default).")
    ] = None,
) -> JSONResponse:
    """Runs, most recently updated first, each with status (healthy/warning/critical) and firing alerts;
    their configs only with ``?include=config`` (``GET /api/v1/runs/{id}`` always has it)."""
    page = await run_in_threadpool(
        runs.list_runs, services, project=project, limit=limit, offset=offset, config=include == "config"
    )
    return JSONResponse(page)


@router.get("/runs/{run_id}", response_model=RunPublic)
async def get_run(run_id: RunId, services: ServicesDep) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(runs.get_run, services, run_id))


@router.get("/runs/{run_id}/health", response_model=HealthPublic)
async def get_run_health(run_id: RunId, services: ServicesDep) -> JSONResponse:
    """The health rules' chart marks (threshold lines, bands, the entropy forecast) with this run's
    settings, and the latest value of each canonical signal (``step``: the newest step they saw)."""
    return JSONResponse(await run_in_threadpool(runs.run_health, services, run_id))
