"""Alembic migrations: they build exactly the tables the models describe, on both databases, and
upgrade a database that already holds data."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from rlvitals.service.storage.database import MIGRATIONS_DIR, Database
from rlvitals.service.storage.models import metadata


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def test_migrations_match_the_models(database_url):
    db = Database(database_url)
    try:
        db.migrate()
        db.migrate()  # idempotent: a second start changes nothing
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
        assert diff == []
    finally:
        db.dispose()


def test_upgrade_keeps_existing_runs(database_url):
    db = Database(database_url)
    cfg = _config()
    try:
        with db.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0001")
            conn.exec_driver_sql(
                "INSERT INTO runs (project, name, config, tags, created_at, updated_at) "
                "VALUES ('p', 'old', '{}', '[]', 1.0, 1.0)"
            )
        db.migrate()
        with db.read() as conn:
            rows = conn.exec_driver_sql("SELECT name, data_version FROM runs").all()
        assert [tuple(r) for r in rows] == [("old", 0)]
    finally:
        db.dispose()


def test_upgrade_moves_pending_batches_into_audit_blobs(database_url):
    """0004: an audit queued before the upgrade keeps its tensors (moved to audit_blobs)."""
    from rlvitals.service.storage import repository as repo

    db = Database(database_url)
    cfg = _config()
    try:
        with db.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0003")
            conn.exec_driver_sql(
                "INSERT INTO runs (project, name, config, tags, created_at, updated_at) "
                "VALUES ('p', 'old', '{}', '[]', 1.0, 1.0)"
            )
            run_id = conn.exec_driver_sql("SELECT id FROM runs").scalar()
            conn.execute(
                repo.AUDITS.insert().values(
                    run_id=run_id, step=0, status="pending", config={}, reported={},
                    blob=b"tensors" * 1000, nbytes=7000, created_at=1.0,
                )
            )  # fmt: skip
        db.migrate()
        with db.write() as conn:
            job = repo.claim_audit(session=conn, worker="w", now=2.0, stale_before=0.0)
            legacy = conn.execute(repo.AUDITS.select().with_only_columns(repo.AUDITS.c.blob)).scalar()
        assert bytes(job["blob"]) == b"tensors" * 1000 and legacy is None
    finally:
        db.dispose()
