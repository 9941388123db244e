"""/api/v1/runs/{id}/metrics: ingest points, query series."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from rlvitals.service import metrics, series_format
from rlvitals.service.api.bodies import MetricsRoute
from rlvitals.service.api.deps import MAX_ID, RunId, ServicesDep, WriteAuth
from rlvitals.service.api.fastjson import FastJsonRoute
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.errors import BadRequest
from rlvitals.service.schemas import AcceptedPublic, MetricNamesPublic, MetricsIn, MetricsPublic
from starlette.responses import Response

router = APIRouter(prefix="/api/v1", tags=["metrics"], route_class=FastJsonRoute)


async def post_metrics(
    run_id: RunId,
    body: MetricsIn,
    services: ServicesDep,
    wait: Annotated[
        Literal["rules"] | None,
        Query(
            description="`rules`: answer once the health rules have evaluated these points (at most "
            "`health_wait` seconds), with the run's open critical incidents (what a halting trainer needs)."
        ),
    ] = None,
) -> JSONResponse:
    """Store points. Values: numbers, null, "NaN", "Infinity", "-Infinity" (stored, never rejected).
    Resending a (step, name) never duplicates it. The answer comes once the points are committed; the
    health rules run on them just after (``?wait=rules`` waits for that too)."""
    outcome = await services.writer.submit(run_id, body.steps)
    if wait is None:
        return JSONResponse(metrics.answer(services, run_id, outcome, wait_rules=False))
    return JSONResponse(await run_in_threadpool(metrics.answer, services, run_id, outcome, wait_rules=True))


router.add_api_route(
    "/runs/{run_id}/metrics",
    post_metrics,
    methods=["POST"],
    response_model=AcceptedPublic,
    dependencies=[WriteAuth],
    route_class_override=MetricsRoute,
)


@router.get(
    "/runs/{run_id}/metrics",
    response_model=MetricsPublic,
    responses={
        200: {"content": {series_format.MEDIA_TYPE: {}}},
        304: {"description": "Not modified"},
    },
)
async def get_metrics(
    run_id: RunId,
    services: ServicesDep,
    names: Annotated[str | None, Query(description="Comma-separated metric names (default: all).")] = None,
    max_points: Annotated[
        int, Query(ge=0, le=100_000_000, description="Most points per series; 0 returns every point.")
    ] = 2000,
    start: Annotated[int | None, Query(ge=0, le=MAX_ID, description="First step (inclusive).")] = None,
    end: Annotated[int | None, Query(ge=0, le=MAX_ID, description="Last step (inclusive).")] = None,
    wall_time: Annotated[
        bool, Query(description="Add each kept point's wall time (Unix seconds; null where none was sent).")
    ] = False,
    fmt: Annotated[
        Literal["json", "binary"],
        Query(
            alias="format",
            description="`binary`: the same series as little-endian int64/float64 columns "
            f"(`{series_format.MEDIA_TYPE}`, see the server docs), read without parsing numbers.",
        ),
    ] = "json",
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """Series of the run's metrics; ``start``/``end`` keep a step range (before downsampling, so a
    zoomed-in chart gets it at full resolution). The answer carries an ETag that changes with every
    ingest into the run: send it back as If-None-Match to get 304 while nothing changed. With
    ``wall_time=true`` each series carries ``wall_time`` beside ``step`` and ``value``."""
    if start is not None and end is not None and end < start:
        raise BadRequest(f"end ({end}) must not be before start ({start})")
    wanted = None
    if names is not None:
        wanted = [n for n in (part.strip() for part in names.split(",")) if n]
        if not wanted:
            raise BadRequest("names must list at least one metric name (comma-separated)")
    etag, body = await run_in_threadpool(
        metrics.query_encoded,
        services,
        run_id,
        names=wanted,
        max_points=max_points,
        if_none_match=if_none_match,
        start=start,
        end=end,
        wall_time=wall_time,
        binary=fmt == "binary",
    )
    return _tagged(etag, body, series_format.MEDIA_TYPE if fmt == "binary" else "application/json")


def _tagged(etag: str, body: bytes | None, media_type: str = "application/json") -> Response:
    if body is None:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body, media_type=media_type, headers={"ETag": etag})


@router.get(
    "/runs/{run_id}/metric-names",
    response_model=MetricNamesPublic,
    responses={304: {"description": "Not modified"}},
)
async def get_metric_names(
    run_id: RunId, services: ServicesDep, if_none_match: Annotated[str | None, Header()] = None
) -> Response:
    """Every metric name the run logged, sorted. ETag as for the series: 304 while nothing changed."""
    etag, body = await run_in_threadpool(metrics.names_encoded, services, run_id, if_none_match=if_none_match)
    return _tagged(etag, body)
