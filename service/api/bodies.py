"""Large metric-write bodies, parsed and validated in pieces off the event loop.

FastAPI parses a JSON body with one ``json.loads`` and validates it with one pydantic call, both in
the event loop: a 26 MB body stops every other request of the process for about a second. A
``POST /metrics`` body over ``INLINE_BYTES`` is instead parsed in a worker thread one step, one
metric at a time (each piece a short C call, so the interpreter lock passes to the event loop every
few milliseconds), validated ``CHUNK_POINTS`` points at a time. Its steps and points are counted
first, one step held at a time, and the body is refused as soon as it passes
``max_steps_per_request`` or ``max_points_per_request`` (413): an oversized body is never parsed to
its end, and none of its steps is kept. Small bodies (a trainer's per-step write: 1-100 KB) keep FastAPI's own path.

The answer is the same as FastAPI's for the same body: the same validation errors (422, with the
same locations) and JSON errors, a ``MetricsIn`` for a valid one. Only where a large body has two
problems the first one found is reported (an unexpected key before a JSON error after it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from rlvitals.service.api.fastjson import FastJsonRequest
from rlvitals.service.errors import BodyError, PayloadTooLarge
from rlvitals.service.schemas import MetricsIn, StepIn
from starlette.requests import Request
from starlette.responses import Response

INLINE_BYTES = 256 * 1024  # bodies up to this size take FastAPI's one-call path
STEP_INLINE_CHARS = 64 * 1024  # a step whose metrics end within this many characters: one C call
CHUNK_POINTS = 4096  # points validated per pydantic call

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_STEPS = TypeAdapter(list[StepIn])
_SCALAR_ONLY = "[{"  # a value starting with these is never a valid step number, time or metric value


class _Invalid(Exception):
    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = errors


class MetricsBodyParser:
    """One large ``{"steps": [...]}`` body, parsed in pieces (in a worker thread)."""

    def __init__(self, text: str, *, max_steps: int, max_points: int):
        self.s = text
        self.i = 0
        self.max_steps = max_steps
        self.max_points = max_points

    # --- the JSON tokens ------------------------------------------------------------------------
    def _ws(self) -> None:
        self.i = _WS.match(self.s, self.i).end()  # type: ignore[union-attr]

    def _peek(self) -> str:
        self._ws()
        return self.s[self.i : self.i + 1]

    def _expect(self, char: str, what: str) -> None:
        if self._peek() != char:
            raise json.JSONDecodeError(f"Expecting {what}", self.s, self.i)
        self.i += 1

    def _value(self) -> Any:
        self._ws()
        value, self.i = _DECODER.raw_decode(self.s, self.i)
        return value

    def _key(self) -> str:
        if self._peek() != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", self.s, self.i)
        key = self._value()
        self._expect(":", "':' delimiter")
        return key

    def _empty_object(self) -> bool:
        """Open an object (``{``); whether it closes at once (``}``, consumed too)."""
        self._expect("{", "'{'")
        if self._peek() == "}":
            self.i += 1
            return True
        return False

    def _next(self, close: str) -> bool:
        """After a member: whether another follows (``,``) or the container closed."""
        char = self._peek()
        if char == ",":
            self.i += 1
            return True
        if char == close:
            self.i += 1
            return False
        raise json.JSONDecodeError("Expecting ',' delimiter", self.s, self.i)

    def _scalar(self, loc: tuple) -> Any:
        """A value that must be a scalar: a container is refused before it is parsed."""
        if self._peek() in _SCALAR_ONLY and self.s[self.i : self.i + 1]:
            raise _Invalid(
                [{"type": "invalid_type", "loc": loc, "msg": "Input should be a number, null or a string"}]
            )
        return self._value()

    # --- the body ---------------------------------------------------------------------------------
    def parse(self) -> MetricsIn:
        try:
            steps = self._body()
        except _Invalid as exc:
            raise BodyError(RequestValidationError(exc.errors)) from None
        return MetricsIn.model_construct(steps=steps)

    def _body(self) -> list[StepIn]:
        if self._peek() != "{":
            self._value()  # not JSON: FastAPI's JSON error; else its validation error
            raise _Invalid(
                [
                    {
                        "type": "model_attributes_type",
                        "loc": ("body",),
                        "msg": "Input should be a valid dictionary",
                    }
                ]
            )
        self.i += 1
        steps: list[StepIn] | None = None
        extras: list[dict[str, Any]] = []
        if self._peek() == "}":
            self.i += 1
        else:
            while True:
                key = self._key()
                if key != "steps":  # refused, after the steps' own errors (pydantic's order)
                    extras.append(_extra(("body", key)))
                    self._value()
                elif self._peek() == "[":
                    steps = self._steps()
                else:  # not a list: pydantic says what is wrong with it
                    value = self._value()
                    try:
                        MetricsIn.model_validate({"steps": value})
                    except ValidationError as exc:
                        raise _Invalid(_located(exc, ("body",), 0)) from None
                if not self._next("}"):
                    break
        self._ws()
        if self.i != len(self.s):
            raise json.JSONDecodeError("Extra data", self.s, self.i)
        if steps is None:
            raise _Invalid([{"type": "missing", "loc": ("body", "steps"), "msg": "Field required"}, *extras])
        if extras:
            raise _Invalid(extras)
        return steps

    def _steps(self) -> list[StepIn]:
        self._expect("[", "'['")
        self._within_limits()
        out: list[StepIn] = []
        chunk: list[Any] = []
        chunk_points = count = 0
        if self._peek() == "]":
            self.i += 1
            return out
        while True:
            if self._peek() == "{":
                step = self._step_object(count)
                chunk_points += len(step.get("metrics") or ()) if isinstance(step.get("metrics"), dict) else 1
            else:
                step = self._value()
                chunk_points += 1
            chunk.append(step)
            count += 1  # within the limits: _within_limits counted these steps
            more = self._next("]")
            if chunk_points >= CHUNK_POINTS or not more:
                out.extend(self._validate(chunk, count - len(chunk)))
                chunk, chunk_points = [], 0
            if not more:
                return out

    def _within_limits(self) -> None:
        """Count the steps and points first, keeping none of them: a body over a limit is refused
        (413) having held one step at a time, not every validated step before the limit (a flood of
        oversized bodies would otherwise hold ~8x their size each). Anything else wrong is left to
        the parse proper, which reports it as before; the count only ever says 413."""
        start, points, count = self.i, 0, 0
        try:
            if self._peek() == "]":
                return
            while True:
                if self._peek() == "{":
                    metrics = self._step_object(count).get("metrics")
                    points += len(metrics) if isinstance(metrics, dict) else 1
                else:
                    self._value()
                    points += 1
                count += 1
                if count > self.max_steps or points > self.max_points:
                    break
                if not self._next("]"):
                    return
        except (_Invalid, ValueError):
            return  # not this pass's to say: the parse proper finds it and reports it as before
        finally:
            self.i = start
        raise self._too_large("steps" if count > self.max_steps else "points")

    def _too_large(self, what: str) -> BodyError:
        """The 413 for more than ``max_steps_per_request`` steps or ``max_points_per_request`` points."""
        if what == "steps":
            message = f"more than {self.max_steps} steps in one request; the limit is {self.max_steps}"
            return BodyError(PayloadTooLarge(message, detail={"limit": self.max_steps}))
        message = (
            f"more than {self.max_points} points in one request; the limit is {self.max_points} "
            "(max_points_per_request)"
        )
        return BodyError(PayloadTooLarge(message, detail={"limit": self.max_points}))

    def _step_object(self, index: int) -> Any:
        """One step: parsed in one C call when it is small (its first ``}`` is near and outside any
        string), else key by key and metric by metric."""
        end = self.s.find("}", self.i, self.i + STEP_INLINE_CHARS)
        if end != -1:
            span = self.s[self.i : end]
            if (span.count('"') - span.count('\\"')) % 2 == 0:
                return self._value()
        return self._step(index)

    def _step(self, index: int) -> dict[str, Any]:
        loc = ("body", "steps", index)
        step: dict[str, Any] = {}
        if self._empty_object():
            return step
        while True:
            key = self._key()
            if key == "metrics" and self._peek() == "{":
                step[key] = self._metrics((*loc, "metrics"))
            elif key in ("step", "wall_time", "metrics"):
                step[key] = self._scalar((*loc, key))
            else:
                raise _Invalid([_extra((*loc, key))])
            if not self._next("}"):
                return step

    def _metrics(self, loc: tuple) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if self._empty_object():
            return metrics
        while True:
            key = self._key()
            metrics[key] = self._scalar((*loc, key))
            if len(metrics) > self.max_points:
                raise self._too_large("points")
            if not self._next("}"):
                return metrics

    @staticmethod
    def _validate(chunk: list[Any], offset: int) -> list[StepIn]:
        try:
            return _STEPS.validate_python(chunk)
        except ValidationError as exc:
            raise _Invalid(_located(exc, ("body", "steps"), offset)) from None


def _extra(loc: tuple) -> dict[str, Any]:
    return {"type": "extra_forbidden", "loc": loc, "msg": "Extra inputs are not permitted"}


def _located(exc: ValidationError, prefix: tuple, offset: int) -> list[dict[str, Any]]:
    """pydantic's errors of a chunk, located in the whole body as FastAPI would."""
    errors = []
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        if offset and loc and isinstance(loc[0], int):
            loc = (loc[0] + offset, *loc[1:])
        errors.append({**err, "loc": (*prefix, *loc)})
    return errors


def parse_large(body: bytes, *, max_steps: int, max_points: int) -> Any:
    """The parsed body of a large metrics write (a ``MetricsIn``), or the error FastAPI would give."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text.startswith("\ufeff"):  # another encoding: json.loads finds which
        return json.loads(body)
    return MetricsBodyParser(text, max_steps=max_steps, max_points=max_points).parse()


class MetricsRoute(APIRoute):
    """The route class of ``POST /metrics``: its handler reads the body through ``MetricsRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(MetricsRequest(request.scope, request.receive))

        return handle


class MetricsRequest(FastJsonRequest):
    """A request whose ``json()`` parses a large body in a worker thread, in pieces (see above); a
    small one as every metrics route does (orjson, the standard library for what only it accepts)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= INLINE_BYTES:
                return await super().json()
            from fastapi.concurrency import run_in_threadpool

            settings = self.app.state.settings
            self._json = await run_in_threadpool(
                parse_large,
                body,
                max_steps=settings.max_steps_per_request,
                max_points=settings.max_points_per_request,
            )
        return self._json
