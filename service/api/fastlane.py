"""The ingest fast lane: the well-formed ``POST /api/v1/runs/{id}/metrics`` a trainer sends every
step, answered before FastAPI's middleware, routing and dependency machinery.

That machinery (six middleware layers each wrapping ``send``, route matching over every route,
dependency solving, a thread-pool hop) cost ~0.3 ms of CPU per request, as much as storing the
points. ``App.__call__`` sends a request here when its method and path match; the lane checks
exactly what the generic route checks, in the same order (the API key as ``WriteAuth`` does, the
body limit as ``BodyLimitMiddleware`` does, ``MetricsIn`` validation in the same Python mode), hands
the steps to the group-commit writer (which refuses more than ``max_steps_per_request`` itself) and
answers. It parses with
``orjson``, stricter than Starlette's ``json.loads`` (no ``NaN`` tokens, no lone surrogates),
otherwise yielding the same objects.

Anything it does not accept as it is goes down FastAPI's own path with the body it already read
replayed, so every error keeps its status, shape and message; errors the service itself raises
(unknown run, 413) are answered here in the same one error shape. The route stays registered, so
the OpenAPI description is the route's own.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from fastapi import FastAPI
from pydantic import ValidationError
from rlvitals.service import metrics
from rlvitals.service.api.access import DOCS_PATHS, AccessPolicy, with_docs_headers
from rlvitals.service.api.deps import MAX_ID
from rlvitals.service.api.limits import ParseGate
from rlvitals.service.errors import ServiceError, error_response
from rlvitals.service.schemas import MetricsIn
from starlette.exceptions import HTTPException

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_PATH = re.compile(r"/api/v1/runs/([0-9]{1,19})/metrics")
_HEADERS = [(b"content-type", b"application/json")]


class App(FastAPI):
    """FastAPI with the access checks (``api.access``) and the ingest fast lane in front."""

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
            if not gate.try_hold(weight):
                busy = gate.refusal(weight)
                await error_response(429, busy.code, busy.message, busy.detail, busy.headers)(
                    scope, receive, send
                )
                return
            try:
                await self._serve(scope, receive, send)
            finally:
                gate.release(weight)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            receive = timed_body(receive, self.body_timeout)
            match = _PATH.fullmatch(scope["path"])
            if match is not None:
                try:
                    rest = await ingest(self, scope, receive, send, int(match[1]))
                except BodyTimeout as exc:
                    await error_response(408, "request_timeout", exc.detail)(scope, receive, send)
                    return
                if rest is None:
                    return
                receive = rest
        await super().__call__(scope, receive, send)


async def ingest(app: FastAPI, scope: MutableMapping[str, Any], receive: Receive, send: Send,
                 run_id: int) -> Receive | None:  # fmt: skip
    """Answer the request and return ``None``, or return the ``receive`` the generic path must use."""
    services = app.state.services
    settings = services.settings
    content_type = authorization = length = None
    for name, value in scope["headers"]:  # the first of repeated headers, as Starlette's .get() does
        if name == b"content-type":
            content_type = value if content_type is None else content_type
        elif name == b"authorization":
            authorization = value if authorization is None else authorization
        elif name == b"content-length":
            length = value if length is None else length
    limit = settings.max_request_bytes
    if (
        run_id > MAX_ID
        or scope.get("query_string")  # ?wait=rules and anything else: the route's own parameters
        or content_type != b"application/json"
        or (length is not None and not (length.isdigit() and int(length) <= limit))
    ):
        return receive
    try:
        services.auth.check_write(authorization.decode("latin-1") if authorization is not None else None)
    except Exception:  # refused, or the key table unreadable: FastAPI's path answers either
        return receive
    messages: list[Message] = []
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return _replay(messages, receive)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _replay(messages, receive)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        parsed = MetricsIn.model_validate(orjson.loads(body))
    except (ValueError, ValidationError):  # malformed JSON, wrong types: FastAPI says what is wrong
        return _replay(messages, receive)
    try:
        result = metrics.answer(
            services, run_id, await services.writer.submit(run_id, parsed.steps), wait_rules=False
        )
    except ServiceError as exc:
        response = error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)
        await response(scope, receive, send)
        return None
    except Exception:  # the database: the generic path's handlers say what went wrong
        return _replay(messages, receive)
    out = orjson.dumps(result)
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_HEADERS, (b"content-length", str(len(out)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": out})
    return None


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


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out ``messages`` again, then continues with ``receive``."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
