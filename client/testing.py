"""An in-memory stand-in for the HTTP API v1, for unit tests of code that uses the client.

``FakeServer().transport`` plugs into ``rlvitals.init(transport=...)``. It keeps points keyed by
(run, step, name) with insert-or-ignore semantics like the real server, stores batches, and can be told
to fail: ``fail_next(n, status=503, retry_after=None)`` answers the next ``n`` requests with an error,
``down = True`` refuses connections. Integration and fault tests use real ``rlvitals serve`` processes.
"""

from __future__ import annotations

import json
import threading
from collections import deque

import httpx
from rlvitals.client.values import decode_value


class FakeServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: dict[tuple[str, str], str] = {}
        self.points: dict[str, dict[tuple[int, str], float | None]] = {}
        self.batches: dict[str, list[bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        self.down = False
        self._failures: deque[tuple[int, float | None]] = deque()
        self.transport = httpx.MockTransport(self._handle)

    def fail_next(self, count: int, *, status: int = 503, retry_after: float | None = None) -> None:
        with self._lock:
            self._failures.extend([(status, retry_after)] * count)

    def series(self, run_id: str, name: str) -> dict[int, float | None]:
        with self._lock:
            return {step: value for (step, key), value in self.points.get(run_id, {}).items() if key == name}

    def _error(self, status: int, message: str, retry_after: float | None = None) -> httpx.Response:
        headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
        body = {"error": {"code": str(status), "message": message, "detail": None}}
        return httpx.Response(status, json=body, headers=headers)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        with self._lock:
            self.requests.append((request.method, path))
            if self.down:
                raise httpx.ConnectError("connection refused", request=request)
            if self._failures:
                status, retry_after = self._failures.popleft()
                return self._error(status, "injected failure", retry_after)
            if request.method == "POST" and path == "/api/v1/runs":
                body = json.loads(request.content)
                key = (body.get("project", "default"), body["name"])
                created = key not in self.runs
                run_id = self.runs.setdefault(key, str(len(self.runs) + 1))
                self.points.setdefault(run_id, {})
                self.batches.setdefault(run_id, [])
                return httpx.Response(201 if created else 200, json={"id": run_id, "name": key[1]})
            parts = path.strip("/").split("/")
            if len(parts) == 5 and parts[:3] == ["api", "v1", "runs"] and request.method == "POST":
                run_id = parts[3]
                if run_id not in self.points:
                    return self._error(404, f"run {run_id} not found")
                if parts[4] == "metrics":
                    body = json.loads(request.content)
                    store = self.points[run_id]
                    for record in body["steps"]:
                        for name, value in record["metrics"].items():
                            store.setdefault((int(record["step"]), name), decode_value(value))
                    return httpx.Response(200, json={"accepted": len(body["steps"])})
                if parts[4] == "batches":
                    self.batches[run_id].append(request.content)
                    return httpx.Response(202, json={"id": str(len(self.batches[run_id]))})
            return self._error(404, f"no route {request.method} {path}")
