"""/api/v1/runs/{id}/metrics: ingest points, query series."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from pydantic import ValidationError
from rlvitals.service import metrics
from rlvitals.service.api.deps import MAX_ID, RunId, ServicesDep, WriteAuth
from rlvitals.service.context import Services
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.errors import BadRequest
from rlvitals.service.schemas import AcceptedPublic, MetricsIn, MetricsPublic
from starlette.requests import Request
from starlette.responses import Response

router = APIRouter(prefix="/api/v1", tags=["metrics"])


class _IngestRoute(APIRoute):
    """``POST …/metrics`` with a fast lane for the well-formed request a trainer sends every step.

    FastAPI's generic request handling (content-type parsing through ``email.message``, dependency
    solving, the response model) cost about as much CPU as storing the points. The fast lane takes a
    body sent as ``application/json`` to a plain run id, checks the API key exactly as ``WriteAuth``
    does, and validates with the same pydantic model FastAPI would use (``MetricsIn``, Python mode).
    It parses with ``orjson``, which is stricter than Starlette's ``json.loads`` (no ``NaN`` tokens,
    no lone surrogates) and otherwise yields the same objects. Anything it does not accept as it is goes
    down FastAPI's own path, so every error keeps its status, shape and message; the OpenAPI
    description is the route's own.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        generic = super().get_route_handler()

        async def handler(request: Request) -> Response:
            fast = await _ingest_fast(request)
            return fast if fast is not None else await generic(request)

        return handler


async def _ingest_fast(request: Request) -> Response | None:
    raw_id = request.path_params.get("run_id")
    if (
        not isinstance(raw_id, str)
        or not (raw_id.isascii() and raw_id.isdigit())
        or int(raw_id) > MAX_ID
        or request.headers.get("content-type") != "application/json"
    ):
        return None
    services: Services = request.app.state.services
    services.auth.check_write(request.headers.get("authorization"))
    body = await request.body()
    if not body:
        return None
    try:
        parsed = MetricsIn.model_validate(orjson.loads(body))
    except (ValueError, ValidationError):  # malformed JSON, wrong types: FastAPI says what is wrong
        return None
    result = await run_in_threadpool(metrics.ingest, services, int(raw_id), parsed.steps)
    return Response(orjson.dumps(result), media_type="application/json")


async def post_metrics(run_id: RunId, body: MetricsIn, services: ServicesDep) -> JSONResponse:
    """Store points. Values: numbers, null, "NaN", "Infinity", "-Infinity" (stored, never rejected).
    Resending a (step, name) never duplicates it."""
    return JSONResponse(await run_in_threadpool(metrics.ingest, services, run_id, body.steps))


router.add_api_route(
    "/runs/{run_id}/metrics",
    post_metrics,
    methods=["POST"],
    response_model=AcceptedPublic,
    dependencies=[WriteAuth],
    route_class_override=_IngestRoute,
)


@router.get(
    "/runs/{run_id}/metrics", response_model=MetricsPublic, responses={304: {"description": "Not modified"}}
)
async def get_metrics(
    run_id: RunId,
    services: ServicesDep,
    names: Annotated[str | None, Query(description="Comma-separated metric names (default: all).")] = None,
    max_points: Annotated[
        int, Query(ge=0, le=100_000_000, description="Most points per series; 0 returns every point.")
    ] = 2000,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """Series of the run's metrics. The answer carries an ETag that changes with every ingest into
    the run: send it back as If-None-Match to get 304 while nothing changed."""
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
    )
    if body is None:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body, media_type="application/json", headers={"ETag": etag})
