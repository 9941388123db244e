"""Webhook receivers cannot hurt the server or the other receivers' notifications, and what they are
told is true when they are told it. Every receiver is a real server on 127.0.0.1 in a thread.

Before: the sender read a receiver's whole answer into memory; ``webhook_timeout`` bounded each read,
not the attempt (a receiver dripping a byte at a time held it for minutes); nothing capped the
notifications one URL got per minute across runs; a flapping alert's last notification said
``firing`` after the alert resolved (its resolution fell under the rule's rate limit).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from rlvitals.service.storage import repository as repo

from tests.service.test_service_webhook_isolation import flap

NAN = [{"step": 0, "metrics": {"actor/pg_loss": "NaN"}}]


class RawReceiver:
    """A bare TCP receiver: reads a request's headers, then runs ``answer(conn)`` (bounded by the
    test); counts the bytes it managed to write before the sender hung up."""

    def __init__(self, answer):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.written = 0
        self.closed_after: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        started = time.monotonic()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            self.requests += 1
            with contextlib.suppress(OSError):
                self.answer(self, conn)
            self.closed_after.append(time.monotonic() - started)

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.written += len(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def _huge_body(receiver: RawReceiver, conn: socket.socket) -> None:
    size = 128 * 1024 * 1024
    receiver.send(conn, f"HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n".encode())
    block = b"x" * (1024 * 1024)
    conn.settimeout(5)
    for _ in range(size // len(block)):
        receiver.send(conn, block)


def _drip_headers(receiver: RawReceiver, conn: socket.socket) -> None:
    receiver.send(conn, b"HTTP/1.1 200 OK\r\n")
    for _ in range(40):  # 20 s at most
        time.sleep(0.5)
        receiver.send(conn, b"x-drip: 1\r\n")


def _drip_body(receiver: RawReceiver, conn: socket.socket) -> None:
    receiver.send(conn, b"HTTP/1.1 500 Oops\r\ncontent-length: 100\r\n\r\n")
    for _ in range(40):
        time.sleep(0.5)
        receiver.send(conn, b"x")


def _attempts(api) -> list[dict]:
    with api.services.db.read() as session:
        return [
            a
            for d in repo.list_deliveries(session=session)
            for a in repo.list_attempts(session=session, delivery_id=d["id"])
        ]


def _wait(predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_huge_answer_is_read_no_further_than_the_limit(app_client, tmp_path):
    receiver = RawReceiver(_huge_body)
    try:
        api = app_client(f"sqlite:///{tmp_path}/huge.db", webhook_urls=[receiver.url()], webhook_timeout=10.0)
        api.log(api.create_run(), NAN)
        attempts = _wait(lambda: _attempts(api))
        assert attempts[0]["ok"] and attempts[0]["status_code"] == 200
        _wait(lambda: receiver.closed_after)
        # the sender hung up after webhook_response_bytes (64 KiB): the receiver could not push its
        # 128 MiB, only what the kernel's socket buffers took
        assert receiver.written < 16 * 1024 * 1024, receiver.written
    finally:
        receiver.close()


def test_a_dripping_receiver_is_cut_off_at_the_attempt_deadline(app_client, tmp_path, hooks):
    headers, body = RawReceiver(_drip_headers), RawReceiver(_drip_body)
    try:
        api = app_client(
            f"sqlite:///{tmp_path}/drip.db",
            webhook_urls=[headers.url(), body.url()],
            webhook_timeout=1.5,
            webhook_backoff=30.0,
        )
        started = time.monotonic()
        api.log(api.create_run(), NAN)
        attempts = _wait(lambda: len(_attempts(api)) >= 2 and _attempts(api))
        took = time.monotonic() - started
        assert took < 5.0, f"the attempts took {took:.1f} s against a 1.5 s deadline"
        assert all(not a["ok"] and a["duration"] < 3.0 for a in attempts), attempts
        assert any("webhook_timeout" in a["error"] for a in attempts), attempts
    finally:
        headers.close()
        body.close()


def test_one_url_gets_at_most_its_budget_per_minute_and_a_digest_for_the_rest(app_client, tmp_path, hooks):
    hook, slack = hooks(), hooks()
    url = f"sqlite:///{tmp_path}/budget.db"
    settings = {
        "webhook_urls": [hook.url("/g")],
        "slack_webhook_urls": [slack.url("/s")],
        "webhook_per_minute": 3,
    }
    api = app_client(url, webhook_workers=0, **settings)  # queue first: 8 runs fire at once
    for n in range(8):
        api.log(api.create_run(f"run{n}"), NAN)
    api.stop()
    app_client(url, **settings)
    got = hook.wait_for(3)
    slack.wait_for(3)
    time.sleep(1.5)  # nothing more within the minute
    assert len(hook.received) == 3 and len(slack.received) == 3
    singles, digest = [r["body"] for r in got[:2]], got[2]["body"]
    assert [b["event"] for b in singles] == ["alert.firing"] * 2
    assert digest["event"] == "digest" and digest["count"] == 6 and digest["omitted"] == 0
    assert {n["run"]["name"] for n in digest["notifications"]} == {f"run{n}" for n in range(2, 8)}
    text = slack.received[2]["body"]["text"]
    assert "6 notifications" in text and all(f"run{n}" in text for n in range(2, 8))


def test_a_flapping_alerts_last_notification_says_it_resolved(app_client, tmp_path, hooks):
    hook, slack = hooks(), hooks()
    api = app_client(
        f"sqlite:///{tmp_path}/flap.db",
        webhook_urls=[hook.url("/g")],
        slack_webhook_urls=[slack.url("/s")],
        webhook_rule_limit=3,
        webhook_rule_window=1.0,
    )
    run_id = api.create_run("flappy")
    flap(api, run_id, cycles=4)  # F R F R F R F R: three sent, the rest over the rule's limit
    got = hook.wait_for(4, timeout=10)  # + one catch-up once the window has room
    time.sleep(1.5)
    assert len(hook.received) == 4
    # each says the state when it went out; the last, the one the alert ended in
    assert got[-1]["body"]["alert"]["state"] == "resolved"
    texts = [r["body"]["text"] for r in slack.wait_for(4)]
    assert "*resolved*" in texts[-1]
