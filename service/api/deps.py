"""Dependencies shared by the routes: the app's services, write authorisation, bounded bodies."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request
from rlvitals.service.context import Services
from rlvitals.service.errors import BadRequest, PayloadTooLarge, Unavailable
from rlvitals.service.storage.blobs import SpooledBody

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


async def spool_body(request: Request, limit: int) -> SpooledBody:
    """The request body in a temporary file (see ``storage.blobs``), refusing (413) as soon as it
    passes ``limit`` bytes; only one chunk of it is in memory at a time."""
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
    try:
        async for chunk in request.stream():
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
