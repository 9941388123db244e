"""Engines, transactions and migrations for SQLite (default, WAL) and PostgreSQL (scale-out).

``Database.write()`` is the one way to change data: a single transaction, on SQLite serialised by a
process lock and ``BEGIN IMMEDIATE`` (so concurrent writers queue instead of failing with
"database is locked"); ``Database.read()`` is a plain read transaction. Both yield a Core
``Connection`` (named ``session`` in the repository's signatures): the server only runs Core
statements, so the ORM session's bookkeeping would be pure overhead on the ingest path.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.pool import StaticPool

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
_MIGRATION_LOCK_ID = 0x726C7669  # "rlvi": advisory lock so replicas starting together migrate once


class Database:
    """Owns the engines; ``dialect`` is ``"sqlite"`` or ``"postgresql"``."""

    def __init__(self, url: str, *, pool_size: int = 10):
        self.url = make_url(url)
        self.dialect = self.url.get_backend_name()
        if self.dialect not in ("sqlite", "postgresql"):
            raise ValueError(
                f"unsupported database {self.dialect!r}: use sqlite:/// or postgresql+psycopg://"
            )
        if self.dialect == "postgresql" and self.url.drivername == "postgresql":
            self.url = self.url.set(drivername="postgresql+psycopg")
        self._write_lock = threading.Lock() if self.is_sqlite else None
        if self.is_sqlite:
            self.engine = self._sqlite_engine(immediate=True)
            self.read_engine = self.engine if self._memory else self._sqlite_engine(immediate=False)
        else:
            self.engine = create_engine(
                self.url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, pool_recycle=1800
            )
            self.read_engine = self.engine

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    @property
    def is_postgresql(self) -> bool:
        return self.dialect == "postgresql"

    @property
    def _memory(self) -> bool:
        return self.is_sqlite and self.url.database in (None, "", ":memory:")

    def libpq_url(self) -> str:
        """The URL for a raw psycopg connection (LISTEN)."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def _sqlite_engine(self, *, immediate: bool) -> Engine:
        kwargs: dict = {"connect_args": {"check_same_thread": False, "timeout": 30}}
        if self._memory:
            kwargs["poolclass"] = StaticPool
        else:
            Path(self.url.database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
            # LIFO: the connection used last is used next. SQLite keeps a page cache per connection and
            # drops it when another connection has written since; a FIFO pool hands each write to the
            # connection idle the longest, whose cache is stale, and the insert re-reads its B-tree
            # pages (measured: a 1,200-point insert 2x slower, 4 ms against 2).
            kwargs.update(pool_size=20, max_overflow=20, pool_use_lifo=True)
        engine = create_engine(self.url, **kwargs)
        begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            if immediate:  # writers never checkpoint inside a request: the housekeeper does (below)
                cur.execute("PRAGMA wal_autocheckpoint=0")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            # On the driver connection: the same statement without SQLAlchemy's execution machinery
            # (events, result wrapping), which cost as much as the BEGIN itself on the per-step path.
            conn.connection.driver_connection.execute(begin)

        return engine

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction: commits on success, rolls back on any exception."""
        if self._write_lock is not None:
            with self._write_lock, self.engine.begin() as conn:
                yield conn
        else:
            with self.engine.begin() as conn:
                yield conn

    def held_writer(self) -> HeldWriter:
        """A ``write()`` that keeps its connection between transactions (for one thread's use)."""
        return HeldWriter(self)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction (rolled back at the end)."""
        with self.read_engine.connect() as conn:
            yield conn

    def migrate(self, *, isolated: bool = False) -> None:
        """Bring the schema to the newest Alembic revision (runs at server start).

        ``isolated`` (the server's start): nothing to do when the database is at the newest revision
        already (one query), else the migration runs in a child process, so the server never imports
        Alembic (~10 MiB it would keep for nothing). Should the child fail, the migration runs here,
        so its error is raised as it always was."""
        if isolated:
            if self.at_head():
                return
            if not self._memory and _migrate_in_child(self.url.render_as_string(hide_password=False)):
                return
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        cfg.set_main_option("sqlalchemy.url", self.url.render_as_string(hide_password=False))
        lock = self._write_lock or threading.Lock()
        with lock, self.engine.begin() as conn:
            if self.is_postgresql:
                conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def at_head(self) -> bool:
        """Whether the schema is at the newest revision of ``migrations/versions`` (read without Alembic)."""
        head = head_revision()
        try:
            with self.read_engine.connect() as conn:
                stamped = [row[0] for row in conn.exec_driver_sql("SELECT version_num FROM alembic_version")]
        except Exception:  # no version table yet (a new database), or none readable: migrate
            return False
        return head is not None and stamped == [head]

    def checkpoint(self) -> None:
        """SQLite: copy the WAL back into the database file (PASSIVE: never waits for, nor blocks,
        readers or writers). Called by the server's housekeeping thread; a no-op on PostgreSQL."""
        if not self.is_sqlite or self._memory:
            return
        raw = self.read_engine.raw_connection()  # outside any transaction (a checkpoint needs that)
        try:
            cur = raw.cursor()
            cur.execute("PRAGMA wal_checkpoint(PASSIVE)")
            cur.fetchall()
            cur.close()
        finally:
            raw.close()

    def ping(self) -> None:
        with self.read_engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()


_REVISION = re.compile(r"^(down_revision|revision)\s*=\s*[\"']([^\"']+)[\"']", re.MULTILINE)


def head_revision() -> str | None:
    """The newest revision in ``migrations/versions`` (the one no other revision builds on), read
    from the files' ``revision`` / ``down_revision`` lines; ``None`` if that is not one revision."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        for key, value in _REVISION.findall(path.read_text()):
            (revisions if key == "revision" else parents).add(value)
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


_MIGRATE_CHILD = (
    "import sys; from rlvitals.service.storage.database import Database as D; D(sys.argv[1]).migrate()"
)


def _migrate_in_child(url: str) -> bool:
    """Run the migration in a fresh interpreter (same ``sys.path``); whether it succeeded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MIGRATE_CHILD, url],
            env=env,
            capture_output=True,
            timeout=600,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


class HeldWriter:
    """``Database.write()`` on one connection kept checked out between transactions: the ingest
    writer thread commits a group every few hundred microseconds, and a pool checkout and check-in
    per group (on PostgreSQL also the pre-ping, a round trip) cost more than its BEGIN. A connection
    that failed is dropped, so the next transaction starts on a fresh (pinged) one. Only the thread
    that owns it may use it; ``close()`` gives the connection back to the pool."""

    def __init__(self, db: Database):
        self.db = db
        self._conn: Connection | None = None

    @contextmanager
    def write(self) -> Iterator[Connection]:
        with self.db._write_lock or nullcontext():
            conn = self._conn
            if conn is None or conn.closed or conn.invalidated:
                conn = self._conn = self.db.engine.connect()
            try:
                with conn.begin():
                    yield conn
            except BaseException:
                # Whatever failed (the database, a bug, a rule), start the next group afresh.
                self.close()
                raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(Exception):  # the connection is gone already: the pool discards it
                conn.close()
