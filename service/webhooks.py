"""Alert delivery to webhooks, in the background, with retries and exponential backoff.

Alert transitions are queued as ``webhook_deliveries`` rows in the ingest transaction (an outbox);
each destination URL has its own sender thread(s) (``webhook_workers`` per URL), which claim only
that URL's due rows (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so replicas never send one twice),
POST them with a timeout outside any transaction, and record every attempt in ``webhook_attempts``.
So a hanging, failing or redirecting endpoint delays only its own deliveries. A failed attempt
(anything but 2xx; redirects are never followed) is retried after ``webhook_backoff * 2**(attempt-1)``
seconds (capped at ``webhook_backoff_max``) until ``webhook_max_attempts``; then it is ``failed``.

Notifications are rate-limited per (run, rule): at most ``webhook_rule_limit`` transitions per
``webhook_rule_window`` seconds are queued (``notification_budget``); the ones skipped are counted
in the next notification that goes out (a digest line, ``suppressed`` in the generic payload).
Slack text escapes ``&``, ``<`` and ``>`` in everything interpolated (``slack_escape``), so a run
named ``<!channel>`` or ``<https://evil|Click>`` shows as text.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from rlvitals.service.storage.database import Database
from rlvitals.service.telemetry import Telemetry
from rlvitals.service.workers import WorkerThreads

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("rlvitals.service.webhooks")

IDLE_POLL = 1.0  # seconds between checks for due retries when nothing wakes the sender


def backoff_delay(attempts: int, *, base: float, cap: float) -> float:
    """Delay before the next attempt after ``attempts`` failures: base, 2*base, 4*base, ... <= cap."""
    return min(cap, base * (2 ** max(0, attempts - 1)))


def slack_escape(text: object) -> str:
    """Slack's message escaping (api.slack.com/reference/surfaces/formatting#escaping): &, <, >."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def notification_budget(*, session, alert: dict[str, Any], now: float, settings: Settings) -> int | None:
    """``None`` when this transition of ``alert`` is over its rule's rate limit (not queued);
    otherwise how many of the rule's transitions on the run were skipped since the last one queued."""
    limit = settings.webhook_rule_limit
    if limit == 0:
        return 0
    run_id, rule = alert["run_id"], alert["rule"]
    sent, newest = repo.rule_notifications(
        session=session, run_id=run_id, rule=rule, since=now - settings.webhook_rule_window
    )
    if sent >= limit:
        return None
    if newest is None:
        return 0
    return max(0, repo.rule_transitions(session=session, run_id=run_id, rule=rule, after=newest) - 1)


def destinations(settings: Settings) -> list[str]:
    return list(dict.fromkeys([*settings.webhook_urls, *settings.slack_webhook_urls]))


class WebhookSender(WorkerThreads):
    """``webhook_workers`` threads per destination URL, each with its own wake-up event."""

    thread_name = "rlvitals-webhook"

    def __init__(self, settings: Settings, db: Database, telemetry: Telemetry):
        super().__init__()
        self.settings = settings
        self.db = db
        self.telemetry = telemetry
        self.urls = destinations(settings)
        self.enabled = bool(self.urls)
        self._wakes = {url: threading.Event() for url in self.urls}

    def _join_timeout(self) -> float:
        return self.settings.webhook_timeout + 5

    def start(self) -> None:
        self._stop.clear()
        try:  # a URL dropped from the settings still gets what was queued for it
            with self.db.read() as session:
                left = [u for u in repo.pending_delivery_urls(session=session) if u not in self._wakes]
        except Exception as exc:
            log.warning("listing pending webhook deliveries failed: %s", exc)
            left = []
        for url in left:
            self.urls.append(url)
            self._wakes[url] = threading.Event()
        for n, url in enumerate(self.urls):
            for i in range(self.settings.webhook_workers):
                thread = threading.Thread(
                    target=self._run, args=(url,), name=f"{self.thread_name}-{n}-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for event in self._wakes.values():
            event.set()
        deadline = time.monotonic() + self._join_timeout()
        for thread in self._threads:  # one bound for all: a hanging URL does not multiply it
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads.clear()

    def wake(self, _kind: str | None = None) -> None:
        for event in self._wakes.values():
            event.set()

    def _run(self, url: str) -> None:
        import httpx  # only with a webhook configured (~5 MiB)

        with httpx.Client(timeout=self.settings.webhook_timeout, follow_redirects=False) as client:
            while not self._stop.is_set():
                try:
                    delivery = self._claim(url)
                except Exception as exc:  # database away: keep the thread alive, try again later
                    log.warning("claiming a webhook delivery failed: %s", exc)
                    self._stop.wait(IDLE_POLL)
                    continue
                if delivery is None:
                    self._wait_for_work(url)
                    continue
                self._send(client, delivery)

    def _claim(self, url: str) -> dict[str, Any] | None:
        now = time.time()
        stale = now - (self.settings.webhook_timeout * 2 + 30)
        with self.db.write() as session:
            return repo.claim_delivery(session=session, now=now, stale_before=stale, url=url)

    def _wait_for_work(self, url: str) -> None:
        timeout = IDLE_POLL
        try:
            with self.db.read() as session:
                due = repo.next_delivery_due(session=session, url=url)
            if due is not None:
                timeout = max(0.0, min(IDLE_POLL, due - time.time()))
        except Exception as exc:
            log.warning("checking for due webhook deliveries failed: %s", exc)
        wake = self._wakes[url]
        if timeout > 0 and wake.wait(timeout):
            wake.clear()

    def _send(self, client: httpx.Client, delivery: dict[str, Any]) -> None:
        import httpx

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
