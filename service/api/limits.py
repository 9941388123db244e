"""ASGI middleware: JSON bodies over ``max_request_bytes`` are refused with 413 before parsing.

Batch uploads (``/batches``) are exempt here; their route enforces ``max_batch_bytes`` itself.
"""

from __future__ import annotations

from rlvitals.service.errors import error_response
from starlette.exceptions import HTTPException


class _TooLarge(HTTPException):
    """An HTTPException so FastAPI's body reader passes it on to the error handlers as a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"body exceeds the limit of {limit} bytes")


class BodyLimitMiddleware:
    def __init__(self, app, *, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["method"] in ("GET", "HEAD")
            or scope["path"].endswith("/batches")
        ):
            await self.app(scope, receive, send)
            return
        limit = self.limit
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    await self._reject(scope, receive, send, int(value))
                    return
                break
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if started:
                raise
            await self._reject(scope, receive, send, None)

    async def _reject(self, scope, receive, send, size):
        what = f"body of {size} bytes" if size is not None else "body"
        response = error_response(
            413, "payload_too_large", f"{what} exceeds the limit of {self.limit} bytes", {"limit": self.limit}
        )
        await response(scope, receive, send)
