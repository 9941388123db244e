"""Dependencies shared by the routes: the app's services, write authorisation, bounded bodies."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from rlvitals.service.api.limits import client_of
from rlvitals.service.context import Services
from rlvitals.service.errors import BadRequest, PayloadTooLarge, ServiceError, Unavailable
from rlvitals.service.storage.blobs import SpooledBody
from starlette.requests import ClientDisconnect

log = logging.getLogger("rlvitals.service.uploads")

MAX_ID = 2**63 - 1  # ids, steps and offsets are 64-bit in the database

RunId = Annotated[int, Path(ge=0, le=MAX_ID, description="A run id.")]
AuditId = Annotated[int, Path(ge=0, le=MAX_ID, description="An audit id.")]
Offset = Annotated[int, Query(ge=0, le=MAX_ID)]


async def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


async def require_writer(request: Request) -> None:
    """Writes need ``Authorization: Bearer <key>`` once any API key exists."""
    services: Services = request.app.state.services
    services.auth.check_write(request.headers.get("authorization"))


WriteAuth = Depends(require_writer)


class BodyTooSlow(ServiceError):
    status, code = 408, "request_timeout"


def upload_client(request: Request) -> str:
    """Who an upload counts against: its API key (hashed; accepted by ``WriteAuth`` before), or the
    peer address without one (``limits.client_of``, which the parse gate counts JSON bodies by)."""
    return client_of(request.scope, request.app.state.services.auth)


async def spool_body(
    request: Request, limit: int, *, grace: float | None = None, min_rate: int | None = None
) -> SpooledBody:
    """The request body in a temporary file (see ``storage.blobs``), refusing (413) as soon as it
    passes ``limit`` bytes; only one chunk of it is in memory at a time. With ``min_rate``, the body
    is cut off (408) once it falls behind ``grace + received / min_rate`` seconds since it started
    (a whole-body deadline that a steady sender keeps pushing forward, and a dripping one cannot). A
    client that hangs up is logged in one line."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"body of {int(declared)} bytes exceeds the limit of {limit} bytes", detail={"limit": limit}
        )
    expected = int(declared) if declared is not None and declared.isdigit() else None
    try:
        body = SpooledBody()
    except OSError as exc:
        raise _no_room(exc) from exc
    loop = asyncio.get_running_loop()
    started = loop.time()
    chunks = request.stream().__aiter__()
    try:
        while True:
            try:
                if min_rate is None:
                    chunk = await chunks.__anext__()
                else:
                    left = started + (grace or 0.0) + body.size / min_rate - loop.time()
                    if left <= 0:
                        raise TimeoutError
                    chunk = await asyncio.wait_for(chunks.__anext__(), left)
            except StopAsyncIteration:
                break
            except TimeoutError:
                took = loop.time() - started
                log.info(
                    "upload to %s cut off: %d bytes in %.1f s, slower than upload_min_rate (%d B/s)",
                    request.url.path, body.size, took, min_rate,
                )  # fmt: skip
                raise BodyTooSlow(
                    f"the body arrived slower than {min_rate} bytes/s after its first {grace:g} s "
                    f"({body.size} bytes in {took:.1f} s; body_timeout, upload_min_rate)",
                    detail={"received": body.size, "min_rate": min_rate},
                ) from None
            except ClientDisconnect:
                log.info("upload to %s aborted by the client after %d bytes", request.url.path, body.size)
                raise BadRequest(f"the client hung up after {body.size} bytes") from None
            if body.size + len(chunk) > (limit if expected is None else expected):
                if expected is None:
                    raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes", detail={"limit": limit})
                raise BadRequest(f"body is longer than its Content-Length of {expected} bytes")
            try:
                body.write(chunk)
            except OSError as exc:
                raise _no_room(exc) from exc
        if expected is not None and body.size != expected:
            raise BadRequest(f"body ended after {body.size} of its Content-Length of {expected} bytes")
    except BaseException:
        body.close()
        raise
    return body


def _no_room(exc: OSError) -> Unavailable:
    return Unavailable(
        f"the server cannot spool the upload to its temporary directory ({exc.strerror or exc}); "
        "retry later (TMPDIR needs room for max_upload_bytes_in_flight)"
    )
