"""A real local HTTP listener that records webhook deliveries (http.server in a thread)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HookServer:
    """Records every POST body; ``status``/``delay`` control how it answers."""

    def __init__(self, port: int = 0, *, status: int = 200, delay: float = 0.0):
        self.received: list[dict] = []
        self.status = status
        self.delay = delay
        self._cond = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"null")
                if outer.delay:
                    time.sleep(outer.delay)
                with outer._cond:
                    outer.received.append({"path": self.path, "body": body, "status": outer.status})
                    outer._cond.notify_all()
                self.send_response(outer.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_for(self, count: int, timeout: float = 15.0, ok_only: bool = True) -> list[dict]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = [r for r in self.received if not ok_only or 200 <= r["status"] < 300]
                if len(got) >= count:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} deliveries, got {len(got)}: {self.received}")
                self._cond.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
