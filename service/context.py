"""The server's long-lived parts, built once per app by ``create_app`` and reached by routes
through ``api.deps``: settings, database, event bus, health engine and evaluator, auth, telemetry,
the webhook sender and the audit pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlvitals.service.audits import AuditPool
    from rlvitals.service.auth import Authenticator
    from rlvitals.service.cache import SeriesCache
    from rlvitals.service.columns import SeriesColumns
    from rlvitals.service.evaluator import HealthEvaluator
    from rlvitals.service.events import EventBus
    from rlvitals.service.health import HealthEngine
    from rlvitals.service.settings import Settings
    from rlvitals.service.storage.database import Database
    from rlvitals.service.telemetry import Telemetry
    from rlvitals.service.webhooks import WebhookSender
    from rlvitals.service.writer import IngestWriter


@dataclass
class Services:
    settings: Settings
    db: Database
    bus: EventBus
    health: HealthEngine
    auth: Authenticator
    telemetry: Telemetry
    webhooks: WebhookSender
    audits: AuditPool
    series_cache: SeriesCache | None = None
    columns: SeriesColumns | None = None
    plugins: list = field(default_factory=list)  # the analyzers.plugins.LoadedPlugin entries registered
    writer: IngestWriter = None  # type: ignore[assignment]  # set by build_services (it needs them)
    evaluator: HealthEvaluator | None = None  # the health rules after each write (set by build_services)
    # metric names each run holds, as this process knows them (max_metric_names_per_run)
    run_names: dict[int, set[str]] = field(default_factory=dict)
