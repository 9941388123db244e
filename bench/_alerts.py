"""Point-to-alert latency under load: how long after a trainer sends the point that breaks a rule the
alert is there to read.

rlvitals runs its health rules after the write has answered (service/evaluator.py). While the
ingest phases run, ``AlertProbe`` (a thread with a connection and a run of its own) sends twelve
clean steps, then one NaN loss (``non_finite`` fires on it), and polls the run's firing alerts until
the alert for that step is there; the time from just before the NaN's POST to the answer that shows
the alert is one sample. The twelve clean steps resolve the previous episode first (the rule resolves
after ten), so every NaN opens a new one.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time

from _peers import Conn, Req

PROBE_TIMEOUT = 10.0  # a sample still without its alert after this long counts as this long


class AlertProbe:
    def __init__(self, port: int, *, pause: float = 0.2) -> None:
        self.port = port
        self.pause = pause
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn = Conn(port)
        body = json.dumps({"name": "alert-probe", "project": "bench"}).encode()
        self.run_id = json.loads(self._conn.call(Req("POST", "/api/v1/runs", body)))["id"]
        self._step = 0

    def __enter__(self) -> AlertProbe:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="alert-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT + 5)

    def close(self) -> None:
        self._conn.close()

    def _post(self, steps: list[dict]) -> None:
        body = json.dumps({"steps": steps}).encode()
        self._conn.call(Req("POST", f"/api/v1/runs/{self.run_id}/metrics", body))

    def _loop(self) -> None:
        while not self._stop.is_set():
            clean = [{"step": self._step + i, "metrics": {"actor/pg_loss": 0.1}} for i in range(12)]
            self._post(clean)
            bad = self._step + 12
            self._step += 13
            self._stop.wait(self.pause)
            t0 = time.perf_counter()
            self._post([{"step": bad, "metrics": {"actor/pg_loss": "NaN"}}])
            while True:
                alerts = json.loads(
                    self._conn.call(Req("GET", f"/api/v1/runs/{self.run_id}/alerts?state=firing&limit=5"))
                )["data"]
                waited = time.perf_counter() - t0
                if any(a["rule"] == "non_finite" and a["first_step"] == bad for a in alerts):
                    self.samples.append(waited)
                    break
                if waited > PROBE_TIMEOUT:
                    self.samples.append(PROBE_TIMEOUT)
                    break
                time.sleep(0.005)
            self._stop.wait(self.pause)

    def summary(self) -> dict:
        ordered = sorted(self.samples)
        if not ordered:
            return {"samples": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return {
            "samples": len(ordered),
            "p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p99_ms": round(p99 * 1e3, 2),
            "max_ms": round(ordered[-1] * 1e3, 2),
        }
