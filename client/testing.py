"""An in-memory stand-in for the HTTP API v1, for unit tests of code that uses the client.

``FakeServer().transport`` plugs into ``rlvitals.init(transport=...)``. It keeps points keyed by
(run, step, name) with insert-or-ignore semantics like the real server, stores batches, and can be told
to fail: ``fail_next(n, status=503, retry_after=None)`` answers the next ``n`` requests with an error,
``down = True`` refuses connections. Integration and fault tests use real ``rlvitals serve`` processes.

Also here: ``DelayProxy`` (a real loopback proxy that answers slowly) and ``LatencyProbe`` (times calls,
separating the callee's own blocking from OS preemption), shared by the fault tests and bench/client.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque

import httpx
from rlvitals.client.values import decode_value


class FakeServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: dict[tuple[str, str], str] = {}
        self.points: dict[str, dict[tuple[int, str], float | None]] = {}
        self.batches: dict[str, list[bytes]] = {}
        self.run_configs: dict[
            str, dict
        ] = {}  # like the server: a resume with a non-empty config replaces it
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
        request.read()
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
                if body.get("config") or created:
                    self.run_configs[run_id] = body.get("config") or {}
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


class DelayProxy:
    """A loopback HTTP/1.1 proxy in a thread that waits ``delay`` seconds before forwarding each request.

    Used by the fault tests and the benchmark to make a real server "answer slowly". ``url`` is where
    clients connect; ``upstream`` is the real server.
    """

    def __init__(self, upstream: str, delay: float) -> None:
        self.upstream = upstream.rstrip("/")
        self.delay = delay
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> DelayProxy:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                time.sleep(proxy.delay)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                try:
                    with httpx.Client(timeout=60.0) as client:
                        upstream = client.request(
                            self.command, proxy.upstream + self.path, content=body, headers=headers
                        )
                    status, content = upstream.status_code, upstream.content
                    reply_headers = [
                        (k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
                    ]
                except httpx.HTTPError:
                    status, content, reply_headers = 502, b'{"error":{"code":"bad_gateway"}}', []
                try:
                    self.send_response(status)
                    for key, value in reply_headers:
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting: fine
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _forward

            def log_message(self, *args) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="delay-proxy", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


class LatencyProbe:
    """Times calls in the calling thread, telling the callee's own waiting from the machine's.

    A call slower than ``limit_s`` is set aside when the time it lost was not the client's:

    - ``preempted``: the kernel involuntarily switched the thread out (``ru_nivcsw`` of
      ``RUSAGE_THREAD`` grew): another process took the CPU, which no library can prevent on a shared
      machine;
    - ``stolen``: the thread never left the CPU as far as the kernel knows (no context switch of either
      kind) and yet ran for under half the call (its ``CLOCK_THREAD_CPUTIME_ID`` time): the hypervisor
      took the virtual CPU away (steal time), invisible to the guest's scheduler.

    Everything else counts: a call that computed (CPU time close to its duration) or that slept on a lock,
    the GIL or I/O (``ru_nvcsw`` grew). ``max_unpreempted_us`` is the worst such call — the client's own
    blocking.
    """

    def __init__(self, limit_s: float = 0.001) -> None:
        self.limit_ns = int(limit_s * 1e9)
        self.samples: list[int] = []
        self.preempted: list[int] = []
        self.stolen: list[int] = []
        self.max_unpreempted = 0

    def __call__(self, fn, *args, **kwargs):
        import resource

        before = resource.getrusage(resource.RUSAGE_THREAD)
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter_ns() - start
        self.samples.append(elapsed)
        if elapsed > self.limit_ns:
            cpu = time.thread_time_ns() - cpu_start
            after = resource.getrusage(resource.RUSAGE_THREAD)
            if after.ru_nivcsw > before.ru_nivcsw:
                self.preempted.append(elapsed)
                return result
            if after.ru_nvcsw == before.ru_nvcsw and cpu < elapsed // 2:
                self.stolen.append(elapsed)
                return result
        if elapsed > self.max_unpreempted:
            self.max_unpreempted = elapsed
        return result

    def summary(self) -> dict:
        ordered = sorted(self.samples)
        if not ordered:
            return {"n": 0}

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000

        return {
            "n": len(ordered),
            "p50_us": pct(0.50),
            "p99_us": pct(0.99),
            "max_us": ordered[-1] / 1000,
            "max_unpreempted_us": self.max_unpreempted / 1000,
            "preempted_over_limit": len(self.preempted),
            "stolen_over_limit": len(self.stolen),
        }
