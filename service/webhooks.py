"""Alert delivery to webhooks, in the background, with retries and exponential backoff.

Alert transitions are queued as ``webhook_deliveries`` rows in the ingest transaction (an outbox);
sender threads claim due rows (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so replicas never send one
twice), POST them with a timeout outside any transaction, and record every attempt in
``webhook_attempts``. A failed attempt is retried after ``webhook_backoff * 2**(attempt-1)`` seconds
(capped at ``webhook_backoff_max``) until ``webhook_max_attempts``; then the delivery is ``failed``.
A slow or dead endpoint only ever occupies a sender thread, never an ingest request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database
from rlvitals.service.telemetry import Telemetry
from rlvitals.service.workers import WorkerThreads

log = logging.getLogger("rlvitals.service.webhooks")

IDLE_POLL = 1.0  # seconds between checks for due retries when nothing wakes the sender


def backoff_delay(attempts: int, *, base: float, cap: float) -> float:
    """Delay before the next attempt after ``attempts`` failures: base, 2*base, 4*base, ... <= cap."""
    return min(cap, base * (2 ** max(0, attempts - 1)))


class WebhookSender(WorkerThreads):
    thread_name = "rlvitals-webhook"

    def __init__(self, settings: Settings, db: Database, telemetry: Telemetry):
        super().__init__()
        self.settings = settings
        self.db = db
        self.telemetry = telemetry
        self.enabled = bool(settings.webhook_urls or settings.slack_webhook_urls)

    def _thread_count(self) -> int:
        return self.settings.webhook_workers

    def _join_timeout(self) -> float:
        return self.settings.webhook_timeout + 5

    def _run(self) -> None:
        with httpx.Client(timeout=self.settings.webhook_timeout, follow_redirects=False) as client:
            while not self._stop.is_set():
                try:
                    delivery = self._claim()
                except Exception as exc:  # database away: keep the thread alive, try again later
                    log.warning("claiming a webhook delivery failed: %s", exc)
                    self._stop.wait(IDLE_POLL)
                    continue
                if delivery is None:
                    self._wait_for_work()
                    continue
                self._send(client, delivery)

    def _claim(self) -> dict[str, Any] | None:
        now = time.time()
        stale = now - (self.settings.webhook_timeout * 2 + 30)
        with self.db.write() as session:
            return repo.claim_delivery(session=session, now=now, stale_before=stale)

    def _wait_for_work(self) -> None:
        timeout = IDLE_POLL
        try:
            with self.db.read() as session:
                due = repo.next_delivery_due(session=session)
            if due is not None:
                timeout = max(0.0, min(IDLE_POLL, due - time.time()))
        except Exception as exc:
            log.warning("checking for due webhook deliveries failed: %s", exc)
        if timeout > 0 and self._wake.wait(timeout):
            self._wake.clear()

    def _send(self, client: httpx.Client, delivery: dict[str, Any]) -> None:
        attempt_no = delivery["attempts"] + 1
        started = time.perf_counter()
        status_code: int | None = None
        error: str | None = None
        try:
            response = client.post(delivery["url"], json=delivery["payload"])
            status_code = response.status_code
            if not 200 <= status_code < 300:
                error = f"HTTP {status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        duration = time.perf_counter() - started
        now = time.time()
        ok = error is None
        if ok:
            update = {"status": "delivered", "delivered_at": now, "last_error": None}
        elif attempt_no >= self.settings.webhook_max_attempts:
            update = {"status": "failed", "last_error": error}
            log.warning("webhook %s failed after %d attempts: %s", delivery["url"], attempt_no, error)
        else:
            delay = backoff_delay(
                attempt_no, base=self.settings.webhook_backoff, cap=self.settings.webhook_backoff_max
            )
            update = {"status": "pending", "next_attempt_at": now + delay, "last_error": error}
        update.update(attempts=attempt_no, claimed_at=None)
        self.telemetry.count_webhook("ok" if ok else "error")
        try:
            with self.db.write() as session:
                repo.record_attempt(
                    session=session,
                    delivery_id=delivery["id"],
                    attempt={
                        "attempt": attempt_no,
                        "at": now,
                        "ok": ok,
                        "status_code": status_code,
                        "error": error,
                        "duration": duration,
                    },
                    delivery=update,
                )
        except Exception as exc:  # the row stays 'sending' and is re-claimed once stale
            log.warning(
                "recording webhook attempt %d for delivery %s failed: %s", attempt_no, delivery["id"], exc
            )
