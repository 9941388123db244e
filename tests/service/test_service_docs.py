"""The server page of the docs site (docs/server.md) covers every setting (with its environment variable),
every API path and every Prometheus metric."""

from __future__ import annotations

from pathlib import Path

from rlvitals.service.app import create_app
from rlvitals.service.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"


def test_every_setting_is_documented_with_its_environment_variable():
    text = DOC.read_text()
    for name in Settings.model_fields:
        row = f"| `{name}` | `RLVITALS_{name.upper()}` |"
        assert row in text, f"settings table lacks {name}"


def test_every_api_path_is_documented(tmp_path):
    text = DOC.read_text()
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db"))
    paths = [p for p in app.openapi()["paths"] if p.startswith("/api/") or p in ("/healthz", "/metrics")]
    assert len(paths) >= 10
    for path in paths:
        documented = path.replace("{run_id}", "{id}")
        assert documented in text or path in text, f"{path} is not documented"


def test_every_prometheus_metric_is_documented(tmp_path):
    from rlvitals.service.storage.database import Database
    from rlvitals.service.telemetry import Telemetry

    db = Database(f"sqlite:///{tmp_path}/m.db")
    db.migrate()
    try:
        rendered = Telemetry().render(db, sse_clients=0)
    finally:
        db.dispose()
    names = {line.split()[2] for line in rendered.splitlines() if line.startswith("# TYPE")}
    text = DOC.read_text()
    for name in names:
        assert f"`{name}" in text, f"{name} is not documented"


def test_every_limit_is_in_the_security_doc_with_its_default():
    text = (DOC.parent / "security.md").read_text()
    limits = [
        name
        for name in Settings.model_fields
        if name.startswith(("max_", "upload_", "webhook_"))
        or name.endswith("_timeout")
        or name in ("audit_queue_size", "series_memory_points", "query_cache_bytes", "sse_queue_size")
    ]
    limits = [n for n in limits if n not in ("webhook_urls", "webhook_info", "audit_claim_timeout")]
    assert len(limits) >= 25
    for name in limits:
        assert f"`{name}`" in text, f"docs/security.md lacks {name}"
