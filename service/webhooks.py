"""Alert delivery to webhooks, in the background, with retries and exponential backoff.

Alert transitions are queued as ``webhook_deliveries`` rows in the ingest transaction (an outbox);
each destination URL has its own sender thread(s) (``webhook_workers`` per URL), which claim only
that URL's due rows (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so replicas never send one twice),
POST them with a timeout outside any transaction, and record every attempt in ``webhook_attempts``.
So a hanging, failing or redirecting endpoint delays only its own deliveries. A failed attempt
(anything but 2xx; redirects are never followed) is retried after ``webhook_backoff * 2**(attempt-1)``
seconds (capped at ``webhook_backoff_max``) until ``webhook_max_attempts``; then it is ``failed``.

An attempt has one deadline, ``webhook_timeout``, for all of it (a timer shuts the socket down when
it passes, so a receiver dripping its answer a byte at a time cannot hold the sender); at most
``webhook_response_bytes`` of the answer are read, never decompressed, and discarded.

Notifications are rate-limited per (run, rule): at most ``webhook_rule_limit`` transitions per
``webhook_rule_window`` seconds are queued (``notification_budget``); the ones skipped are counted
in the next notification that goes out (a digest line, ``suppressed`` in the generic payload), and
one catch-up notification is queued for when the window has room, so the receiver's last word is
never a state the alert has left. Every notification is rendered again when it is sent, from the
rule's newest alert on the run: its text says the state at send time, not at queue time.

Each URL gets at most ``webhook_per_minute`` POSTs per rolling minute across all runs (counted in
the database, so across replicas); when the last POST of the minute's budget is due and more
notifications wait, they all go in that one POST as a digest (``"event": "digest"``; for Slack, one
message listing them).
Slack text escapes ``&``, ``<`` and ``>`` in everything interpolated (``slack_escape``), so a run
named ``<!channel>`` or ``<https://evil|Click>`` shows as text.
"""

from __future__ import annotations

import contextlib
import logging
import socket
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
BUDGET_WINDOW = 60.0  # seconds of webhook_per_minute's rolling window
DIGEST_ITEMS = 100  # notifications listed in one generic digest (the rest are counted)
DIGEST_LINES = 20  # lines listed in one Slack digest


def backoff_delay(attempts: int, *, base: float, cap: float) -> float:
    """Delay before the next attempt after ``attempts`` failures: base, 2*base, 4*base, ... <= cap."""
    return min(cap, base * (2 ** max(0, attempts - 1)))


def queue_deliveries(
    *, session, settings: Settings, owner: dict[str, int], generic: Any, slack: Any, now: float
) -> None:
    """One pending delivery per configured URL (generic JSON or Slack text) of what ``owner`` names
    (``{"alert_id": ...}`` or ``{"incident_id": ...}``), in the caller's transaction."""
    rows = [(url, "generic", generic) for url in settings.webhook_urls]
    rows += [(url, "slack", slack) for url in settings.slack_webhook_urls]
    repo.add_deliveries(
        session=session,
        rows=[
            {
                **owner,
                "url": url,
                "kind": kind,
                "payload": payload,
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
            }
            for url, kind, payload in rows
        ],
    )


def slack_escape(text: object) -> str:
    """Slack's message escaping (api.slack.com/reference/surfaces/formatting#escaping): &, <, >."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def notification_budget(*, session, alert: dict[str, Any], now: float, settings: Settings) -> int | None:
    """``None`` when this transition of ``alert`` is over its rule's rate limit (not queued; one
    catch-up notification per URL is queued for when the window has room instead, rendered when it is
    sent); otherwise how many of the rule's transitions on the run were skipped since the last one
    queued."""
    limit = settings.webhook_rule_limit
    if limit == 0:
        return 0
    run_id, rule = alert["run_id"], alert["rule"]
    since = now - settings.webhook_rule_window
    sent, newest = repo.rule_notifications(session=session, run_id=run_id, rule=rule, since=since)
    if sent >= limit:
        _queue_catch_up(session=session, alert=alert, now=now, since=since, settings=settings)
        return None
    if newest is None:
        return 0
    return max(0, repo.rule_transitions(session=session, run_id=run_id, rule=rule, after=newest) - 1)


def _queue_catch_up(*, session, alert: dict[str, Any], now: float, since: float, settings: Settings) -> None:
    run_id, rule = alert["run_id"], alert["rule"]
    if repo.deferred_delivery_pending(session=session, run_id=run_id, rule=rule):
        return  # one waits already: it will say the state at its send time
    oldest = repo.oldest_rule_notification(session=session, run_id=run_id, rule=rule, since=since)
    due = max(now + 1e-3, (oldest or now) + settings.webhook_rule_window)
    placeholder = {"event": f"alert.{alert['state']}", "alert": alert, "suppressed": 0}
    rows = [(url, "generic", placeholder) for url in settings.webhook_urls]
    rows += [(url, "slack", {"text": f"{rule}: {alert['state']}"}) for url in settings.slack_webhook_urls]
    common = {
        "alert_id": alert["id"],
        "status": "pending",
        "attempts": 0,
        "next_attempt_at": due,
        "created_at": now,
    }
    repo.add_deliveries(
        session=session, rows=[{**common, "url": url, "kind": kind, "payload": p} for url, kind, p in rows]
    )


def payload_now(*, session, delivery: dict[str, Any]) -> dict[str, Any]:
    """The delivery's payload rendered again, when it is sent, from its rule's newest alert on the
    run: the text says the state at send time (a firing queued behind a slow receiver, or a
    catch-up, says ``resolved`` if the alert resolved meanwhile); ``suppressed`` counts the rule's
    transitions since the notification before this one, less the one shown."""
    if delivery.get("alert_id") is None:
        return delivery["payload"]  # a digest, or its alert is gone
    queued = repo.get_alert(session=session, alert_id=delivery["alert_id"])
    if queued is None:
        return delivery["payload"]
    run_id, rule = queued["run_id"], queued["rule"]
    latest = repo.latest_alert(session=session, run_id=run_id, rule=rule) or queued
    run = repo.get_run(session=session, run_id=run_id)
    if run is None:
        return delivery["payload"]
    before = repo.newest_rule_notification_before(
        session=session, run_id=run_id, rule=rule, before=delivery["created_at"]
    )
    skipped = 0
    if before is not None:
        skipped = max(0, repo.rule_transitions(session=session, run_id=run_id, rule=rule, after=before) - 1)
    from rlvitals.service.alerts import alert_public, webhook_payloads  # alerts imports this module

    generic, slack = webhook_payloads(alert_public(latest), run, suppressed=skipped)
    return slack if delivery["kind"] == "slack" else generic


def digest_payload(kind: str, payloads: list[dict[str, Any]], *, budget: int) -> dict[str, Any]:
    """One notification standing for ``payloads`` (what passed ``webhook_per_minute``)."""
    if kind == "slack":
        lines = [str(p.get("text", "")).split("\n", 1)[0] for p in payloads[:DIGEST_LINES]]
        more = len(payloads) - len(lines)
        text = f":bell: *{len(payloads)} notifications* (this URL's budget is {budget} a minute):\n"
        text += "\n".join(lines) + (f"\n_...and {more} more._" if more > 0 else "")
        return {"text": text}
    return {
        "event": "digest",
        "count": len(payloads),
        "notifications": payloads[:DIGEST_ITEMS],
        "omitted": max(0, len(payloads) - DIGEST_ITEMS),
        "budget_per_minute": budget,
    }


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

        limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per attempt (its deadline)
        with httpx.Client(
            timeout=self.settings.webhook_timeout, follow_redirects=False, limits=limits
        ) as client:
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
        budget = self.settings.webhook_per_minute
        with self.db.write() as session:
            repo.lock_webhook_url(session=session, url=url)
            used = 0
            if budget:
                used, _oldest = repo.url_posts_since(session=session, url=url, since=now - BUDGET_WINDOW)
                if used >= budget:
                    return None  # the idle poll looks again
            delivery = repo.claim_delivery(session=session, now=now, stale_before=stale, url=url)
            if delivery is None:
                return None
            if budget and used == budget - 1 and delivery["attempts"] == 0:
                folded = repo.fold_due_deliveries(session=session, url=url, kind=delivery["kind"], now=now)
                if folded:
                    return self._digest(session, [delivery, *folded], now)
            delivery["payload"] = payload_now(session=session, delivery=delivery)
            return delivery

    def _digest(self, session, deliveries: list[dict[str, Any]], now: float) -> dict[str, Any]:
        """Fold ``deliveries`` (the first claimed, the rest marked digested) into one new delivery."""
        first = deliveries[0]
        payloads = [payload_now(session=session, delivery=d) for d in deliveries]
        values = {
            "alert_id": None,
            "url": first["url"],
            "kind": first["kind"],
            "payload": digest_payload(first["kind"], payloads, budget=self.settings.webhook_per_minute),
            "status": "sending",
            "attempts": 0,
            "next_attempt_at": now,
            "claimed_at": now,
            "created_at": now,
        }
        values["id"] = repo.insert_delivery(session=session, values=values)
        repo.set_deliveries(
            session=session,
            ids=[d["id"] for d in deliveries],
            values={"status": "digested", "claimed_at": now, "last_error": f"sent in digest {values['id']}"},
        )
        self.telemetry.count_webhook("digest")
        return values

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
        attempt_no = delivery["attempts"] + 1
        started = time.perf_counter()
        status_code, error = self._post(client, delivery["url"], delivery["payload"])
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

    def _post(self, client: httpx.Client, url: str, payload: dict[str, Any]) -> tuple[int | None, str | None]:
        """One POST with one deadline for all of it; at most ``webhook_response_bytes`` of the answer
        are read (raw: never decompressed) and dropped. -> (status code, error or ``None``)."""
        import httpx

        seconds = self.settings.webhook_timeout
        streams: list[Any] = []
        expired = threading.Event()

        def trace(name: str, info: dict[str, Any]) -> None:
            if name == "connection.connect_tcp.complete" and info.get("return_value") is not None:
                streams.append(info["return_value"])

        def expire() -> None:
            expired.set()
            for stream in streams:
                sock = stream.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(seconds, expire)
        timer.daemon = True
        timer.start()
        status_code: int | None = None
        head = b""
        try:
            with client.stream("POST", url, json=payload, extensions={"trace": trace}) as response:
                status_code = response.status_code
                read, limit = 0, self.settings.webhook_response_bytes
                if limit:
                    for chunk in response.iter_raw(chunk_size=min(limit, 16384)):
                        if len(head) < 200:
                            head += chunk[: 200 - len(head)]
                        read += len(chunk)
                        if read >= limit or expired.is_set():
                            break
        except httpx.HTTPError as exc:
            if status_code is None or not 200 <= status_code < 300:
                if expired.is_set():
                    return status_code, f"the attempt passed webhook_timeout ({seconds:g} s) and was cut off"
                return status_code, f"{type(exc).__name__}: {exc}"[:500]
        finally:
            timer.cancel()
        if not 200 <= status_code < 300:
            return status_code, f"HTTP {status_code}: {head.decode('utf-8', 'replace')}"
        return status_code, None
