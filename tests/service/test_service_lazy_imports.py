"""What a metrics-only server on SQLite keeps out of its memory: Alembic (migrations run in a child
process, or not at all when the schema is current), numpy (downsampled reads only), psycopg
(PostgreSQL only), httpx (webhooks only) and torch (tensor batches only). Driven through the ASGI
interface itself, so no HTTP client library is imported by the test either."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, tempfile
    from rlvitals.service.app import create_app
    from rlvitals.service.settings import Settings

    async def call(app, method, path, body=b"", query=b""):
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        out = []
        async def receive():
            return pending.pop(0) if pending else {"type": "http.disconnect"}
        async def send(message):
            out.append(message)
        scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "scheme": "http", "http_version": "1.1",
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        await app(scope, receive, send)
        return out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])

    async def main(data):
        app = create_app(Settings(database_url=f"sqlite:///{data}/x.db", data_dir=data))
        async with app.router.lifespan_context(app):
            status, body = await call(app, "POST", "/api/v1/runs", json.dumps({"name": "lazy"}).encode())
            assert status == 201 or status == 200, body
            run_id = json.loads(body)["id"]
            steps = [{"step": s, "metrics": {"actor/entropy": 1.0 - s / 100, "actor/ppo_kl": 0.004}}
                     for s in range(50)]
            status, body = await call(app, "POST", f"/api/v1/runs/{run_id}/metrics",
                                      json.dumps({"steps": steps}).encode())
            assert status == 200, body
            status, body = await call(app, "GET", f"/api/v1/runs/{run_id}/metrics", query=b"max_points=0")
            assert status == 200 and len(json.loads(body)["series"]["actor/entropy"]["step"]) == 50
        return {name: name in sys.modules for name in ("alembic", "numpy", "psycopg", "httpx", "torch")}

    data = tempfile.mkdtemp()
    first = asyncio.run(main(data))   # a new database: migrated in a child process
    print(json.dumps({"new": first}))
    """
)


def _run(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_metrics_only_sqlite_server_imports_none_of_the_heavy_optional_parts():
    seen = _run(SCRIPT)["new"]
    assert seen == {"alembic": False, "numpy": False, "psycopg": False, "httpx": False, "torch": False}


def test_the_schema_is_migrated_in_a_child_and_a_current_one_is_left_alone(tmp_path):
    from rlvitals.service.storage.database import Database, head_revision

    db = Database(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        assert not db.at_head()
        db.migrate(isolated=True)  # the child did it: this process never imported Alembic for it
        assert db.at_head()
        with db.read() as conn:
            assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == head_revision()
            assert conn.exec_driver_sql("SELECT count(*) FROM runs").scalar() == 0
        db.migrate(isolated=True)  # current: one query, nothing else
        assert db.at_head()
    finally:
        db.dispose()


def test_the_rlvitals_command_loads_no_client_sender_before_serving():
    """``rlvitals serve`` builds the whole command line first (the client's ``sync``/``import``/``demo``
    included): that must not load the training-side client and httpx into the server (~5 MiB)."""
    script = textwrap.dedent(
        """
        import json, sys
        from rlvitals.cli import build_parser
        build_parser().parse_args(["serve", "--help"][:1])
        print(json.dumps({name: name in sys.modules
                          for name in ("httpx", "rlvitals.client.run", "rlvitals.client.sender")}))
        """
    )
    assert _run(script) == {"httpx": False, "rlvitals.client.run": False, "rlvitals.client.sender": False}
