"""Fixtures for the dashboard's browser tests: a real ``rlvitals serve`` on SQLite, real headless
Chromium (Debian's ``chromium`` package driven by playwright), and a small HTTP client that feeds the
server the way a trainer would.

Screenshots land in ``artifacts/screenshots/`` (gitignored) so a person can look at them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import ServerProcess, start_server

CHROMIUM = os.environ.get("RLVITALS_CHROMIUM", "/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"


# --- the server ----------------------------------------------------------------------------------


@dataclass
class Api:
    """What a trainer does, over real HTTP."""

    base: str
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.base, timeout=60.0)

    def create_run(self, name: str, *, project: str = "default", config: dict | None = None, tags=()) -> int:
        body = {"name": name, "project": project, "config": config or {}, "tags": list(tags)}
        resp = self.client.post("/api/v1/runs", json=body)
        assert resp.status_code in (200, 201), resp.text
        return resp.json()["id"]

    def log(self, run_id: int, steps: list[dict[str, Any]]) -> dict:
        resp = self.client.post(f"/api/v1/runs/{run_id}/metrics", json={"steps": steps})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def log_series(self, run_id: int, series: Callable[[int], dict[str, float]], steps: range, *, chunk=1000):
        t0 = time.time() - len(steps)
        for start in range(steps.start, steps.stop, chunk):
            block = range(start, min(start + chunk, steps.stop))
            self.log(run_id, [{"step": s, "metrics": series(s), "wall_time": t0 + s} for s in block])

    def upload_batch(
        self,
        run_id: int,
        tensors: dict,
        *,
        step: int,
        config: dict,
        reported: dict,
        micro_batch: int | None = None,
    ) -> int:
        from safetensors.torch import save

        meta = {"step": str(step), "config": json.dumps(config), "reported": json.dumps(reported)}
        if micro_batch is not None:
            meta["micro_batch"] = str(micro_batch)
        body = save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
        resp = self.client.post(
            f"/api/v1/runs/{run_id}/batches",
            content=body,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert resp.status_code == 202, resp.text
        return resp.json()["id"]

    def get(self, path: str, **params) -> Any:
        resp = self.client.get(path, params=params)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def wait_audit(self, audit_id: int, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            audit = self.get(f"/api/v1/audits/{audit_id}")
            if audit["status"] in ("done", "error"):
                return audit
            time.sleep(0.1)
        raise TimeoutError(f"audit {audit_id} not finished after {timeout}s")

    def wait_alert(self, run_id: int, rule: str | None, timeout: float = 15.0, *, says: str = "") -> dict:
        """The first alert of ``rule`` (None: any rule) on the run whose message holds ``says``: the
        rules run after the writes and audits answered, so a page opened at once may not show it yet."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for alert in self.get(f"/api/v1/runs/{run_id}/alerts")["data"]:
                if rule in (None, alert["rule"]) and says in (alert.get("message") or ""):
                    return alert
            time.sleep(0.1)
        raise TimeoutError(f"no {rule or 'alert'} saying {says!r} on run {run_id} after {timeout}s")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One real server per test module, with default settings, on SQLite."""
    workdir = tmp_path_factory.mktemp("dash-server")
    proc = start_server(database_url=f"sqlite:///{workdir / 'rlvitals.db'}", workdir=workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api(server: ServerProcess) -> Iterator[Api]:
    client = Api(server.url)
    yield client
    client.client.close()


# --- the browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    # Module scope, not session: playwright's sync API keeps an asyncio loop marked as running on
    # the main thread while it is open, and later test modules that call asyncio.run() would fail.
    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: the dashboard tests need a real browser. "
            "Install Debian's package: apt-get install -y chromium (scripts/services.sh does it)."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield instance
        instance.close()


@dataclass
class Tab:
    """A browser page plus everything it complained about."""

    page: Any
    base: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def open(self, path: str, *, ready: str, timeout: float = 30.0) -> None:
        """Navigate and wait until the page's script says it rendered (``ready``: a JS expression)."""
        self.page.goto(self.base + path)
        self.wait(ready, timeout=timeout)

    def wait(self, expression: str, arg: Any = None, *, timeout: float = 10.0, interval: float = 0.02) -> Any:
        """Poll a JS expression (or a function of ``arg``) until it is truthy; its value. (Polled from
        Python: the pages' CSP forbids the eval that playwright's wait_for_function needs.)"""
        deadline = time.monotonic() + timeout
        while True:
            value = self.page.evaluate(expression, arg)
            if value:
                return value
            if time.monotonic() > deadline:
                self.assert_clean()
                raise AssertionError(f"timed out after {timeout}s waiting for: {expression}")
            time.sleep(interval)

    def js(self, expression: str, arg: Any = None) -> Any:
        return self.page.evaluate(expression, arg)

    def shot(self, name: str, *, full_page: bool = True) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        return path

    def assert_clean(self) -> None:
        problems = self.console_errors + self.page_errors + [f"dialog: {d}" for d in self.dialogs]
        assert not problems, "the page reported errors:\n" + "\n".join(problems)


@pytest.fixture
def tab(browser, server: ServerProcess) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    t = Tab(page=page, base=server.url)
    page.on("console", lambda msg: t.console_errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: t.page_errors.append(str(exc)))

    def on_dialog(dialog) -> None:
        t.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    yield t
    context.close()
