"""/api/v1/runs/{id}/export: a run's series as a CSV or Parquet file (see ``service.export``)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.deps import MAX_ID, RunId, ServicesDep
from rlvitals.service.errors import BadRequest
from rlvitals.service.export import FORMATS, export_series
from starlette.responses import Response

router = APIRouter(prefix="/api/v1", tags=["metrics"])


@router.get(
    "/runs/{run_id}/export",
    response_class=Response,
    responses={200: {"content": {media: {} for media in FORMATS.values()}, "description": "the file"}},
)
async def export_run(
    run_id: RunId,
    services: ServicesDep,
    format: Annotated[Literal["csv", "parquet"], Query(description="csv or parquet")] = "csv",
    names: Annotated[str | None, Query(description="Comma-separated metric names (default: all).")] = None,
    start: Annotated[int | None, Query(ge=0, le=MAX_ID, description="First step (inclusive).")] = None,
    end: Annotated[int | None, Query(ge=0, le=MAX_ID, description="Last step (inclusive).")] = None,
) -> Response:
    """Every point of the run's series (or of ``names``), one row per step and one column per metric,
    named as in ``GET …/metrics``; a download (Content-Disposition: attachment)."""
    if start is not None and end is not None and end < start:
        raise BadRequest(f"end ({end}) must not be before start ({start})")
    wanted = None
    if names is not None:
        wanted = [n for n in (part.strip() for part in names.split(",")) if n]
        if not wanted:
            raise BadRequest("names must list at least one metric name (comma-separated)")
    out = await run_in_threadpool(
        export_series, services, run_id, fmt=format, names=wanted, start=start, end=end
    )
    return Response(
        out.body,
        media_type=out.media_type,
        headers={
            "Content-Disposition": f'attachment; filename="{out.filename}"',
            "Cache-Control": "no-store",
        },
    )
