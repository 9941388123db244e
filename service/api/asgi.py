"""The ASGI application: FastAPI with the access checks (``api.access``), the cap on concurrently
parsed request bytes (``api.limits.ParseGate``) and a deadline on each chunk of a POST body in front
of FastAPI's own middleware and routes. Every request, the trainer's per-step metrics write
included, then takes FastAPI's one path: its middleware, route, dependencies and validation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api.access import DOCS_PATHS, AccessPolicy, with_docs_headers
from rlvitals.service.api.limits import ParseGate, client_of
from rlvitals.service.errors import error_response
from rlvitals.service.workers import release_memory
from starlette.exceptions import HTTPException

# after a JSON request this heavy (weighted bytes: a 4 MiB body), freed heap pages go back to the
# system (glibc keeps them otherwise, and RSS stays at the parse's peak)
RELEASE_WEIGHT = 32 * 1024 * 1024

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class App(FastAPI):
    """FastAPI with the access checks (``api.access``), the parse gate (``api.limits``) and the body
    deadline in front."""

    access: AccessPolicy | None = None
    body_timeout: float | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if self.access is not None and scope["type"] in ("http", "websocket"):
            refusal = self.access.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            if scope["path"] in DOCS_PATHS:
                send = with_docs_headers(send)
        gate: ParseGate | None = getattr(self.state, "parsing", None) if scope["type"] == "http" else None
        if (
            gate is not None
            and scope["method"] in ("POST", "PUT", "PATCH")
            and not scope["path"].endswith("/batches")
        ):
            weight = gate.json_weight(scope, self.state.settings.max_request_bytes)
            client = client_of(scope, self.state.services.auth)
            busy = gate.try_hold(weight, client)
            if busy is not None:
                await error_response(429, busy.code, busy.message, busy.detail, busy.headers)(
                    scope, receive, send
                )
                return
            try:
                await self._serve(scope, receive, send)
            finally:
                gate.release(weight, client)
                if weight >= RELEASE_WEIGHT:  # the parsed objects are gone: their pages go back too
                    await run_in_threadpool(release_memory)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            receive = timed_body(receive, self.body_timeout)
        await super().__call__(scope, receive, send)


class BodyTimeout(HTTPException):
    """An HTTPException, so FastAPI's body reader and the routes pass it to the error handlers (408)."""

    def __init__(self, seconds: float):
        super().__init__(408, f"the request body stalled for {seconds:g} s (body_timeout)")


def timed_body(receive: Receive, seconds: float | None) -> Receive:
    """``receive`` with a deadline on each body chunk until the body is complete (then untouched:
    waiting for a disconnect may take as long as it takes)."""
    if not seconds:
        return receive
    done = False

    async def timed() -> Message:
        nonlocal done
        if done:
            return await receive()
        try:
            async with asyncio.timeout(seconds):
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(seconds) from None
        done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return timed
