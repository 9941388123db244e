"""Service-test fixtures: an in-process app (real lifespan, real database) driven through httpx's
ASGI transport from synchronous tests. A new, empty database is given the newest schema from a
template before the app starts (tests/support/schema.py): the app then finds it current, as a
restarted server does, instead of migrating it in a child process for every test.

``app_client(database_url, **settings)`` -> ``AppClient`` with ``get``/``post``/... returning
``httpx.Response``; ``restart()`` builds a fresh app on the same database (a server restart). ``hooks(**kwargs)`` -> a
real webhook receiver (``tests/service/hooks.py``), closed after the test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import httpx
import pytest
from rlvitals.service.app import create_app
from rlvitals.service.settings import Settings

from tests.service.hooks import HookServer
from tests.support.schema import at_head


class AppClient:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="app-loop", daemon=True)
        self._thread.start()
        self._stopped: asyncio.Event | None = None
        self._lifespan: Future | None = None
        self.start()

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> AppClient:
        self.app = create_app(self.settings)
        self.services = self.app.state.services
        ready: Future = Future()

        async def lifespan():
            self._stopped = asyncio.Event()
            try:
                async with self.app.router.lifespan_context(self.app):
                    ready.set_result(None)
                    await self._stopped.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._lifespan = asyncio.run_coroutine_threadsafe(lifespan(), self._loop)
        ready.result(timeout=60)
        transport = httpx.ASGITransport(app=self.app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")
        return self

    def stop(self) -> None:
        if self._lifespan is None:
            return
        self._call(self.client.aclose())
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._lifespan.result(timeout=60)
        self._lifespan = None

    def restart(self) -> AppClient:
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # --- requests ------------------------------------------------------------------------------
    def _call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    def request(self, method: str, url: str, **kwargs) -> httpx.Response:
        return self._call(self.client.request(method, url, **kwargs))

    def get(self, url: str, **kwargs) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def put(self, url: str, **kwargs) -> httpx.Response:
        return self.request("PUT", url, **kwargs)

    def delete(self, url: str, **kwargs) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    # --- helpers -------------------------------------------------------------------------------
    def create_run(self, name: str = "run", **body) -> int:
        response = self.post("/api/v1/runs", json={"name": name, **body})
        assert response.status_code in (200, 201), response.text
        return response.json()["id"]

    def log(self, run_id: int, steps: list[dict], **kwargs) -> httpx.Response:
        response = self.post(f"/api/v1/runs/{run_id}/metrics", json={"steps": steps}, **kwargs)
        return response


@pytest.fixture
def app_client(tmp_path) -> Iterator:
    """Factory: ``app_client(database_url, **settings)``; every app is stopped after the test."""
    made: list[AppClient] = []

    def _make(database_url: str, **settings) -> AppClient:
        settings.setdefault("data_dir", tmp_path)
        # the webhook tests written per alert transition keep that mode; tests/service/test_service_incidents.py
        # covers the default (incident notifications)
        settings.setdefault("webhook_events", "alerts")
        # audits in threads of the test's own process (they may patch the analyzers); the audit worker
        # process is covered by tests/service/test_service_audit_process.py and every real-server test
        settings.setdefault("audit_process", False)
        resolved = Settings(database_url=database_url, **settings)
        at_head(resolved.resolved_database_url)  # a new database gets the schema without a migration
        client = AppClient(resolved)
        made.append(client)
        return client

    yield _make
    for client in made:
        client.close()


@pytest.fixture
def api(app_client, database_url) -> AppClient:
    """An app on the parametrized database (SQLite and PostgreSQL)."""
    return app_client(database_url)


@pytest.fixture
def hooks():
    """Factory: ``hooks(**kwargs)`` -> a real webhook receiver on 127.0.0.1 (``tests/service/hooks.py``),
    closed after the test."""
    made: list[HookServer] = []

    def _make(**kwargs) -> HookServer:
        server = HookServer(**kwargs)
        made.append(server)
        return server

    yield _make
    for server in made:
        server.close()
