"""Fixtures shared by every test layer.

- ``pg_url``: a fresh, empty PostgreSQL database on the real server (127.0.0.1:5432), dropped after
  the test session; each pytest process gets its own, so parallel runs never collide.
- ``database_url``: parametrized over an embedded SQLite file and that PostgreSQL database, for the
  storage and API suites ("the same tests on both databases").
- ``serve``: a factory that starts a real ``rlvitals serve`` process (see tests/support/servers.py);
  a new database is given the newest schema first, from a template (tests/support/schema.py).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from tests.support.schema import at_head
from tests.support.servers import ServerProcess, start_server

# A worker per core (pytest-xdist, as `make test-fast` runs): torch's default of one thread per core in
# every worker, and in every server a worker starts, puts several threads on each core, and they wait on
# each other (a 27,000-element exp took 3 ms instead of 0.04 ms). One thread each. Set before torch is
# imported; a child process inherits it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

PG_ADMIN_URL = os.environ.get("RLVITALS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _pg_connect(dbname: str | None = None):
    import psycopg

    # psycopg wants a libpq URL, not SQLAlchemy's dialect-qualified one.
    url = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    if dbname is not None:
        url = url.rsplit("/", 1)[0] + "/" + dbname
    return psycopg.connect(url, autocommit=True)


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A fresh database for this pytest process, as a SQLAlchemy URL."""
    try:
        admin = _pg_connect()
    except Exception as exc:  # the suite must run on both databases: fail loudly, never skip
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc} (run scripts/services.sh)")
    name = f"rlvitals_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with _pg_connect() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """The session database, emptied before each test that asks for it."""
    dbname = pg_server_url.rsplit("/", 1)[1]
    with _pg_connect(dbname) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    yield pg_server_url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'rlvitals.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def serve(tmp_path) -> Iterator:
    """Factory: ``serve(database_url=None, env=None, args=())`` -> a running ServerProcess."""
    started: list[ServerProcess] = []

    def _start(database_url: str | None = None, **kwargs) -> ServerProcess:
        url = database_url or f"sqlite:///{tmp_path / f'serve-{len(started)}.db'}"
        at_head(url)  # a new database gets the schema from a template (tests/support/schema.py)
        proc = start_server(database_url=url, workdir=tmp_path, **kwargs)
        started.append(proc)
        return proc

    yield _start
    for proc in started:
        proc.stop()


# --- markers: what `make test-fast` leaves out -------------------------------------------------------
# `sideenv`: the test trains in a side environment (real verl, TRL, OpenRLHF: tests/support/sideenv.py);
# `browser`: it drives headless Chromium; `docker`: it builds and starts containers (opt-in). The marks
# are given here from what a test uses, so a new test gets them without remembering to. `slow` (the sdist
# and wheel builds) and `heavy` (seconds of real servers, trainers, tools or long replays) are given in
# the test files.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.support import sideenv

    for item in items:
        module = getattr(item, "module", None)
        if module is not None and getattr(module, "ensure", None) is sideenv.ensure:
            item.add_marker(pytest.mark.sideenv)
        if {"browser", "tab"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.browser)
