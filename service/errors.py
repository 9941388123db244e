"""One error shape for every 4xx/5xx: ``{"error": {"code": str, "message": str, "detail": any}}``.

Exception hierarchy (raise these from domain code; the handlers below turn them into replies)::

    ServiceError                 500 internal
    ├── BadRequest               400 bad_request
    ├── Unauthorized             401 unauthorized
    ├── NotFound                 404 not_found
    ├── Conflict                 409 conflict
    ├── PayloadTooLarge          413 payload_too_large
    ├── UnsupportedMediaType     415 unsupported_media_type
    ├── InvalidInput             422 invalid_input   (well-formed but wrong: shapes, dtypes, mask values)
    └── Busy                     429 busy            (+ Retry-After)

Framework and database errors are converted at the boundary as well: request validation -> 422
``validation_error``, unknown paths -> 404, wrong methods -> 405, a value the database refuses
(a NUL character for PostgreSQL, an integer beyond 64 bits) -> 422 ``invalid_input``, the database
unreachable or locked -> 503 ``unavailable`` with Retry-After (clients retry), anything unexpected ->
500 ``internal`` (logged with its traceback; the reply never leaks it).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from rlvitals.service.encoding import JSONResponse, jsonable, scrub
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("rlvitals.service")


class ServiceError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, *, detail: Any = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.headers = headers or {}


class BadRequest(ServiceError):
    status, code = 400, "bad_request"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Conflict(ServiceError):
    status, code = 409, "conflict"


class PayloadTooLarge(ServiceError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(ServiceError):
    status, code = 415, "unsupported_media_type"


class InvalidInput(ServiceError):
    status, code = 422, "invalid_input"


class Busy(ServiceError):
    status, code = 429, "busy"

    def __init__(self, message: str, *, retry_after: float = 1.0, detail: Any = None):
        super().__init__(message, detail=detail, headers={"Retry-After": str(max(1, round(retry_after)))})


class Unavailable(ServiceError):
    """The server cannot take this now for want of a resource (not the client's fault): 503."""

    status, code = 503, "unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0, detail: Any = None):
        super().__init__(message, detail=detail, headers={"Retry-After": str(max(1, round(retry_after)))})


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    408: "request_timeout",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    429: "busy",
    503: "unavailable",
}


def error_response(
    status: int, code: str, message: str, detail: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The one helper that builds every error reply."""
    body = {"error": {"code": code, "message": scrub(message), "detail": scrub(jsonable(detail))}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyError(StarletteHTTPException):
    """A refusal raised while FastAPI reads a request body: its reader passes only HTTPExceptions on
    to the handlers, so the error (a ``ServiceError`` or a ``RequestValidationError``) travels inside."""

    def __init__(self, error: ServiceError | RequestValidationError):
        super().__init__(getattr(error, "status", 422), str(error))
        self.error = error


def _validation_detail(exc: RequestValidationError) -> list[dict[str, Any]]:
    out = []
    for err in exc.errors():
        item = {
            "loc": [str(p) for p in err.get("loc", ())],
            "msg": err.get("msg", ""),
            "type": err.get("type"),
        }
        value = err.get("input")
        if (
            value is None
            or isinstance(value, (int, float, bool))
            or (isinstance(value, str) and len(value) < 200)
        ):
            item["input"] = value
        out.append(item)
    return out


def _describe(detail: list[dict[str, Any]]) -> str:
    if not detail:
        return "request is not valid"
    first = detail[0]
    where = ".".join(p for p in first["loc"] if p != "body") or "body"
    more = f" (and {len(detail) - 1} more problem(s))" if len(detail) > 1 else ""
    return f"{where}: {first['msg']}{more}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = _validation_detail(exc)
        return error_response(422, "validation_error", _describe(detail), detail)

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, exc: BodyError) -> JSONResponse:
        if isinstance(exc.error, RequestValidationError):
            return await _validation_error(request, exc.error)
        return await _service_error(request, exc.error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):  # FastAPI's json.loads
            return error_response(422, "invalid_input", "body JSON is nested too deeply to parse", None)
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no such path: {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, code, message, None, dict(exc.headers or {}))

    refused, unavailable = _database_errors()

    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return error_response(422, "invalid_input", f"a value was refused by the database: {first}", None)

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
        return error_response(
            503,
            "unavailable",
            "the database is unavailable or busy; retry shortly",
            None,
            {"Retry-After": "1"},
        )

    for cls in refused:
        app.add_exception_handler(cls, _refused)
    for cls in unavailable:
        app.add_exception_handler(cls, _unavailable)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal server error; see the server log", None)


def _database_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(errors meaning "this value is not storable", errors meaning "the database is away/busy"),
    from SQLAlchemy and from the drivers (the hot paths use driver cursors directly)."""
    import sqlite3

    from sqlalchemy import exc as sa_exc

    refused: list[type[BaseException]] = [sa_exc.DataError, OverflowError, sqlite3.DataError]
    unavailable: list[type[BaseException]] = [
        sa_exc.OperationalError,
        sa_exc.TimeoutError,
        sqlite3.OperationalError,
    ]
    # Loaded by then when the database is PostgreSQL (the engine imports its driver); on SQLite its
    # ~10 MiB would be imported for nothing.
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None:
        refused.append(psycopg.DataError)
        unavailable.append(psycopg.OperationalError)
    return tuple(refused), tuple(unavailable)
