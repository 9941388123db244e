"""/api/v1 rollout-vs-training mismatch of a run: its series, its audits' reports."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.deps import MAX_ID, RunId, ServicesDep
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.mismatch import run_mismatch
from rlvitals.service.schemas import MismatchPublic

router = APIRouter(prefix="/api/v1", tags=["mismatch"])


@router.get("/runs/{run_id}/mismatch", response_model=MismatchPublic)
async def get_run_mismatch(
    run_id: RunId,
    services: ServicesDep,
    audit_id: Annotated[int | None, Query(ge=0, le=MAX_ID, description="the audit to show in full")] = None,
) -> JSONResponse:
    """The run's mismatch series over steps (``rlvitals/mismatch/*`` from the audits, and the gap metrics
    the trainer logged itself), every audit with a mismatch report, and one report in full: ``audit_id``'s,
    or the latest. 404 for an unknown run or an audit of it without a report."""
    return JSONResponse(await run_in_threadpool(run_mismatch, services, run_id, audit_id=audit_id))
