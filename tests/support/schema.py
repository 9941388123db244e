"""New test databases at the newest schema, without migrating each one.

A server (or an in-process app) that starts on a new database migrates it, in a child process that
imports Alembic and runs every revision: one to three seconds, paid by each of the few hundred tests
that start an app on a fresh database. ``at_head(url)`` gives such a database, while it is still
empty, the schema the migrations give, copied from a template this pytest process migrated once
through the same code path (``Database.migrate(isolated=True)``):

- SQLite: the template file is copied to the path the URL names, when nothing is there yet;
- PostgreSQL: the template database's ``pg_dump`` is replayed, when the database has no tables.

A database that already holds anything (a test that seeds an older schema, a restart) is left
alone, and so is every database when the template cannot be made (no ``pg_dump``, say): the server
then migrates it as before. The migrations themselves, and the child process that runs them, keep
their own tests (tests/service/test_service_migrations.py, test_service_lazy_imports.py), which use
their databases directly.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

from sqlalchemy.engine import make_url

_lock = threading.Lock()
_sqlite_template: Path | None = None
_pg_dumps: dict[str, str | None] = {}  # server (URL without the database) -> the template's dump


def at_head(url: str) -> None:
    """Give the new, empty database at ``url`` the newest schema (see the module's docstring)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        _sqlite_at_head(parsed.database)
    elif backend == "postgresql":
        _pg_at_head(parsed)


# --- SQLite ----------------------------------------------------------------------------------------
def _sqlite_at_head(database: str | None) -> None:
    if database in (None, "", ":memory:"):
        return
    path = Path(database).expanduser()
    if path.exists() or Path(f"{path}-wal").exists():
        return
    template = _sqlite_template_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, path)


def _sqlite_template_path() -> Path:
    global _sqlite_template
    with _lock:
        if _sqlite_template is None:
            from rlvitals.service.storage.database import Database

            path = Path(tempfile.mkdtemp(prefix="rlvitals-schema-")) / "template.db"
            db = Database(f"sqlite:///{path}")
            try:
                db.migrate(isolated=True)
            finally:
                db.dispose()
            # the writers never checkpoint (the server's housekeeper does): fold the WAL into the file,
            # so the one file is the whole database
            conn = sqlite3.connect(path)
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            finally:
                conn.close()
            _sqlite_template = path
        return _sqlite_template


# --- PostgreSQL ------------------------------------------------------------------------------------
def _libpq(parsed, database: str) -> str:
    return parsed.set(drivername="postgresql", database=database).render_as_string(hide_password=False)


def _pg_at_head(parsed) -> None:
    import psycopg

    with psycopg.connect(_libpq(parsed, parsed.database), autocommit=True) as conn:
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0]
        if tables:
            return
        dump = _pg_dump(parsed)
        if dump is None:
            return
        conn.execute(dump)


def _pg_dump(parsed) -> str | None:
    server = _libpq(parsed, "")
    with _lock:
        if server not in _pg_dumps:
            _pg_dumps[server] = _make_pg_dump(parsed)
        return _pg_dumps[server]


def _make_pg_dump(parsed) -> str | None:
    import psycopg
    from rlvitals.service.storage.database import Database

    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        return None
    name = f"rlvitals_schema_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(parsed, parsed.database), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        db = Database(parsed.set(database=name).render_as_string(hide_password=False))
        try:
            db.migrate(isolated=True)
        finally:
            db.dispose()
        done = subprocess.run(
            [pg_dump, "--no-owner", "--no-privileges", "--inserts", f"--dbname={_libpq(parsed, name)}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        with psycopg.connect(_libpq(parsed, parsed.database), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if done.returncode != 0:
        return None
    # psql's meta-commands (recent pg_dump writes \restrict ... \unrestrict) are not SQL
    return "\n".join(line for line in done.stdout.splitlines() if not line.startswith("\\"))
