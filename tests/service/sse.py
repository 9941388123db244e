"""A real SSE client in a thread: collects ``(event, data)`` pairs from a live stream."""

from __future__ import annotations

import json
import threading
import time

import httpx


class SSEClient:
    def __init__(self, url: str):
        self.url = url
        self.events: list[tuple[str, object]] = []
        self.connected = threading.Event()
        self._cond = threading.Condition()
        self._client = httpx.Client(timeout=httpx.Timeout(5.0, read=None))
        self._closed = False
        self.status: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self.connected.wait(10):
            raise AssertionError(f"SSE stream {url} did not open")

    def _run(self) -> None:
        try:
            with self._client.stream("GET", self.url) as response:
                self.status = response.status_code
                kind, data = None, []
                for line in response.iter_lines():
                    if self._closed:
                        return
                    if line.startswith(": connected"):
                        self.connected.set()
                    elif line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif line == "" and kind is not None:
                        with self._cond:
                            self.events.append((kind, json.loads("\n".join(data))))
                            self._cond.notify_all()
                        kind, data = None, []
        except (httpx.HTTPError, RuntimeError, ValueError):
            pass
        finally:
            self.connected.set()

    def wait_for(self, predicate, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if predicate(*event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching event within {timeout}s; got {self.events}")
                self._cond.wait(left)

    def close(self) -> None:
        """Stops at the next line (servers under test send a heartbeat every second)."""
        self._closed = True
        self._client.close()
        self._thread.join(timeout=5)
