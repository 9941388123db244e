"""The app factory: ``create_app(settings)`` builds one FastAPI app with its own services.

Nothing is read from the environment here (``Settings`` does that, once, in the CLI), so tests and
embedders build as many independent apps as they like. Migrations, the event bus, the audit pool and
the webhook sender start in the lifespan and stop with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from rlvitals.service.api import (
    routes_alerts,
    routes_audits,
    routes_events,
    routes_export,
    routes_incidents,
    routes_metrics,
    routes_mismatch,
    routes_runs,
    routes_system,
)
from rlvitals.service.api.access import AccessPolicy
from rlvitals.service.api.asgi import App
from rlvitals.service.api.limits import BodyLimitMiddleware, ParseGate, UploadGate, run_body_limit
from rlvitals.service.audits import AuditPool
from rlvitals.service.auth import Authenticator
from rlvitals.service.cache import SeriesCache
from rlvitals.service.columns import SeriesColumns
from rlvitals.service.context import Services
from rlvitals.service.encoding import JSONResponse
from rlvitals.service.errors import install_error_handlers
from rlvitals.service.evaluator import HealthEvaluator
from rlvitals.service.events import EventBus, LocalBus, PostgresBus, SqliteLogBus
from rlvitals.service.health import HealthEngine
from rlvitals.service.settings import Settings
from rlvitals.service.storage.database import Database
from rlvitals.service.telemetry import Telemetry
from rlvitals.service.webhooks import WebhookSender
from rlvitals.service.writer import IngestWriter

from rlvitals import __version__

log = logging.getLogger("rlvitals.service")


def build_services(settings: Settings) -> Services:
    # plugins first: their health rules must be registered before the rule settings are read
    from rlvitals.analyzers.plugins import load_plugins

    plugins = load_plugins() if settings.plugins else []
    db = Database(settings.resolved_database_url, pool_size=settings.db_pool_size)
    bus: EventBus
    if db.is_postgresql:
        bus = PostgresBus(db, queue_size=settings.sse_queue_size)
    elif settings.workers > 1:  # worker processes share one SQLite file: tail an event table
        bus = SqliteLogBus(db, queue_size=settings.sse_queue_size)
    else:
        bus = LocalBus(queue_size=settings.sse_queue_size)
    telemetry = Telemetry()
    health = HealthEngine(settings)
    services = Services(
        settings=settings,
        db=db,
        bus=bus,
        health=health,
        auth=Authenticator(db),
        telemetry=telemetry,
        webhooks=WebhookSender(settings, db, telemetry),
        audits=AuditPool(settings, db, bus, health, telemetry),
        series_cache=SeriesCache(settings.query_cache_bytes) if settings.query_cache_bytes else None,
        columns=SeriesColumns(settings.series_memory_points) if settings.series_memory_points else None,
        plugins=plugins,
    )
    services.writer = IngestWriter(services)
    services.evaluator = HealthEvaluator(services, spacing=settings.health_spacing)
    services.audits.evaluator = services.evaluator
    return services


class Housekeeper:
    """Background chores, once every ``health_flush_interval`` seconds: on SQLite, checkpoint the WAL
    (``Database.checkpoint``), so it never runs inside an ingest request."""

    def __init__(self, services: Services):
        self.services = services
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlvitals-housekeeping", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.services.settings.health_flush_interval):
            try:
                self.services.db.checkpoint()
            except Exception as exc:  # a long reader: the next tick continues where this one stopped
                log.warning("WAL checkpoint failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    services = build_services(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(lambda: services.db.migrate(isolated=True))
        services.bus.on_job(
            lambda kind: services.audits.wake() if kind == "audit" else services.webhooks.wake()
        )
        await run_in_threadpool(services.bus.start, asyncio.get_running_loop())
        services.audits.start()
        services.webhooks.start()
        services.evaluator.start()
        housekeeper = Housekeeper(services)
        log.info("rlvitals ready on %s (%s)", services.db.dialect, services.db.url.render_as_string())
        for plugin in services.plugins:
            log.info("rlvitals plugin loaded: %s", plugin)
        try:
            yield
        finally:
            await run_in_threadpool(services.writer.stop)  # what was accepted is written first
            await run_in_threadpool(services.evaluator.stop)  # then its rules run
            services.bus.stop()
            await run_in_threadpool(services.audits.stop)
            await run_in_threadpool(services.webhooks.stop)
            await run_in_threadpool(housekeeper.stop)
            services.db.dispose()

    app = App(
        title="rlvitals",
        version=__version__,
        summary="Training-health diagnostics for PPO/GRPO trainers: ingest, audit, alert.",
        default_response_class=JSONResponse,
        lifespan=lifespan,
    )
    app.state.services = services
    app.state.settings = settings
    app.access = AccessPolicy(settings, services.auth)
    app.body_timeout = settings.body_timeout
    app.state.uploads = UploadGate(
        max_uploads=settings.max_concurrent_uploads,
        max_bytes=settings.max_upload_bytes_in_flight,
        per_client=settings.max_uploads_per_client,
    )
    app.state.parsing = ParseGate(limit=settings.max_parsing_bytes)
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        limit=settings.max_request_bytes,
        run_limit=run_body_limit(settings.max_run_config_bytes),
        run_config_limit=settings.max_run_config_bytes,
    )
    modules = (
        routes_system,
        routes_runs,
        routes_metrics,
        routes_export,
        routes_audits,
        routes_alerts,
        routes_incidents,
        routes_events,
        routes_mismatch,
    )
    for module in modules:
        app.include_router(module.router)
    _mount_dashboard(app)
    return app


def _mount_dashboard(app: FastAPI) -> None:
    from rlvitals.service import dashboard

    app.include_router(dashboard.router)
    mount = getattr(dashboard, "mount", None)
    if callable(mount):
        mount(app)
