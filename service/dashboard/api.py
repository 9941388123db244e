"""JSON routes the dashboard needs beyond API v1, under ``/dashboard-api/`` (not part of the public API).

- ``GET /dashboard-api/runs/{run_id}/series?names=a,b&start=&end=&max_points=``: metric series with a
  step range and wall times (see ``series``); the charts' only data source besides the SSE stream.
- ``GET /dashboard-api/runs/{run_id}/names``: ``{"names": [...]}``, every metric the run logged.
- ``GET /dashboard-api/runs/{run_id}/health``: ``{"marks": [...], "signals": {...}, "step": N}``: every
  rule's threshold lines and bands with this run's settings, the entropy forecast, and the latest value
  of each canonical signal (an alert's current value beside its onset value).
- ``GET /dashboard-api/audits/{audit_id}/histograms``: histograms of the importance ratio and the
  advantages of the batch behind an audit (see ``histograms.batch_histograms``). Served from the audit
  result (the audit worker stores them there after each audit), else computed from the batch's
  tensors while the server still holds them; otherwise 404 saying why.

Reads need a key exactly where API v1's do (``api.access``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.deps import ServicesDep
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.errors import BadRequest, NotFound
from rlvitals.service.storage import repository as repo


def _audit_blob(session, audit_id: int) -> bytes | None:
    # The one read of a batch's bytes outside the audit worker (repository.get_audit never loads it).
    return repo.get_audit_blob(session=session, audit_id=audit_id)


def audit_histograms(ctx, audit_id: int) -> dict[str, Any]:
    from rlvitals.service.batches import load_tensors
    from rlvitals.service.dashboard.histograms import batch_histograms

    with ctx.db.read() as session:
        row = repo.get_audit(session=session, audit_id=audit_id)
        if row is None:
            raise NotFound(f"audit {audit_id} does not exist")
        stored = (row.get("result") or {}).get("histograms")
        if stored:
            return stored
        blob = _audit_blob(session, audit_id)
    if blob is None:
        raise NotFound(
            f"audit {audit_id} has no histograms and its tensors were dropped; the server stores them "
            "after each audit unless RLVITALS_AUDIT_HISTOGRAMS=false (RLVITALS_KEEP_BATCHES=true keeps "
            "the tensors themselves)"
        )
    return batch_histograms(load_tensors(blob), config=row.get("config") or {})


def run_series(ctx, run_id: int, *, names, start, end, max_points) -> dict[str, Any]:
    from rlvitals.service.dashboard.series import read_series

    with ctx.db.read() as conn:
        if not repo.run_exists(session=conn, run_id=run_id):
            raise NotFound(f"run {run_id} does not exist")
        return read_series(conn, run_id=run_id, names=names, start=start, end=end, max_points=max_points)


def run_metric_names(ctx, run_id: int) -> dict[str, Any]:
    with ctx.db.read() as conn:
        if not repo.run_exists(session=conn, run_id=run_id):
            raise NotFound(f"run {run_id} does not exist")
        return {"names": repo.metric_names(session=conn, run_id=run_id)}


def run_health(ctx, run_id: int) -> dict[str, Any]:
    with ctx.db.read() as conn:
        run = repo.get_run(session=conn, run_id=run_id)
        if run is None:
            raise NotFound(f"run {run_id} does not exist")
        return ctx.health.snapshot(session=conn, run_id=run_id, run_config=run.get("config") or {})


def build_router() -> APIRouter:
    router = APIRouter(prefix="/dashboard-api", include_in_schema=False)

    @router.get("/runs/{run_id}/names")
    async def names(run_id: int, services: ServicesDep) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(run_metric_names, services, run_id))

    @router.get("/runs/{run_id}/health")
    async def health(run_id: int, services: ServicesDep) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(run_health, services, run_id))

    @router.get("/runs/{run_id}/series")
    async def series(
        run_id: int,
        services: ServicesDep,
        names: Annotated[
            str | None, Query(description="Comma-separated metric names (default: all).")
        ] = None,
        start: Annotated[int | None, Query(ge=0, description="First step (inclusive).")] = None,
        end: Annotated[int | None, Query(ge=0, description="Last step (inclusive).")] = None,
        max_points: Annotated[
            int, Query(ge=0, le=100_000_000, description="Most points per series; 0: all.")
        ] = 2000,
    ) -> JSONResponse:
        wanted = None
        if names is not None:
            wanted = [n for n in (part.strip() for part in names.split(",")) if n]
            if not wanted:
                raise BadRequest("names must list at least one metric name (comma-separated)")
        if start is not None and end is not None and end < start:
            raise BadRequest(f"end ({end}) must not be before start ({start})")
        result = await run_in_threadpool(
            run_series, services, run_id, names=wanted, start=start, end=end, max_points=max_points
        )
        return JSONResponse(result)

    @router.get("/audits/{audit_id}/histograms")
    async def histograms(audit_id: int, services: ServicesDep) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(audit_histograms, services, audit_id))

    return router
