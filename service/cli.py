"""``rlvitals serve`` and ``rlvitals keys create|list|revoke|open``.

The web stack (fastapi, uvicorn) is imported inside the command functions, so ``rlvitals --help``
and the client's commands never pay for it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

# What a client-only install (`pip install rlvitals`) lacks; the server commands need all of them.
SERVER_MODULES = ("pydantic", "pydantic_settings", "fastapi", "uvicorn", "sqlalchemy", "alembic")


def missing_server_stack(command: str) -> str | None:
    """Why ``command`` cannot run here (``None``: it can): the server extra is not installed."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"rlvitals {command}: this install has only the client (missing: {', '.join(missing)}). "
        "Install the server with: pip install 'rlvitals[server]'"
    )


def _needs_server(func):
    """Run ``func(args)`` only where the server stack is installed; else one line and exit status 2."""

    def wrapper(args: argparse.Namespace) -> int:
        why = missing_server_stack(args.command if args.command != "keys" else f"keys {args.action}")
        if why:
            print(why, file=sys.stderr)
            return 2
        return func(args)

    return wrapper


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the rlvitals server",
        description="Run the server. Flags override RLVITALS_* environment variables.",
    )
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8000)")
    serve.add_argument(
        "--database-url",
        help="sqlite:///path.db (default: .rlvitals/rlvitals.db) or postgresql://... (psycopg 3)",
    )
    serve.add_argument("--workers", type=int, help="worker processes sharing the port (default 1)")
    serve.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback address while no API key exists (anyone may write)",
    )
    serve.add_argument("--rules-file", help="JSON or YAML file with health-rule settings")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=_needs_server(_serve))

    keys = subparsers.add_parser("keys", help="manage API keys", description="Manage API keys.")
    keys.add_argument("--database-url", help="the server's database (default: as for serve)")
    actions = keys.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    create = actions.add_parser("create", help="create a key and print it (shown only once)")
    create.add_argument("--name", default="default", help="a label for the key")
    create.set_defaults(func=_needs_server(_keys_create))
    listing = actions.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_needs_server(_keys_list))
    revoke = actions.add_parser("revoke", help="revoke a key by id or prefix")
    revoke.add_argument("key", help="the key's id or its printed prefix (rlv_...)")
    revoke.set_defaults(func=_needs_server(_keys_revoke))
    reopen = actions.add_parser(
        "open", help="open writes to everyone again: forget revoked keys (refused while active keys exist)"
    )
    reopen.set_defaults(func=_needs_server(_keys_open))


def _settings(args: argparse.Namespace):
    from rlvitals.service.settings import Settings

    flags = {
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", None),
        "database_url": getattr(args, "database_url", None),
        "workers": getattr(args, "workers", None),
        "insecure": getattr(args, "insecure", None),
        "rules_file": getattr(args, "rules_file", None),
        "log_level": getattr(args, "log_level", None),
    }
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def _database(settings, *, isolated: bool = False):
    from rlvitals.service.storage.database import Database

    db = Database(settings.resolved_database_url, pool_size=2)
    db.migrate(isolated=isolated)
    return db


def bind_refusal(settings, *, has_keys: bool) -> str | None:
    """Why ``serve`` must not bind (``None``: go ahead): a non-loopback address with open writes."""
    if settings.host_is_loopback or has_keys or settings.insecure:
        return None
    return (
        f"refusing to bind {settings.host}: no API key exists, so anyone who can reach this address "
        "could write. Create one with `rlvitals keys create` (clients then send "
        "Authorization: Bearer <key>), bind 127.0.0.1, or pass --insecure."
    )


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = _settings(args)
    except ValidationError as exc:
        print(f"rlvitals serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    from rlvitals.service.workers import tune_malloc

    tune_malloc()  # large bodies' buffers go back to the system when freed
    import uvicorn
    from rlvitals.analyzers.plugins import PluginError, load_plugins
    from rlvitals.service.auth import keys_exist
    from rlvitals.service.health import HealthEngine
    from rlvitals.service.serving import (
        PROTOCOL,
        SETTINGS_ENV,
        NoDelayHTTPProtocol,
        ServeLocked,
        sqlite_serve_lock,
        tune_gc,
        uvicorn_limit_concurrency,
    )
    from sqlalchemy.exc import SQLAlchemyError

    try:
        plugins = load_plugins() if settings.plugins else []
    except PluginError as exc:
        print(f"rlvitals serve: {exc}", file=sys.stderr)
        return 2
    try:
        HealthEngine(settings)  # a bad rules file or rule setting stops here, not in a worker
    except ValueError as exc:
        print(f"rlvitals serve: invalid health rule settings: {exc}", file=sys.stderr)
        return 2
    try:
        db = _database(settings, isolated=True)  # the server itself never imports Alembic
    except SQLAlchemyError as exc:
        url = settings.resolved_database_url.split("@")[-1]
        print(f"rlvitals serve: cannot open the database (...@{url}): {exc.__class__.__name__}: "
              f"{str(getattr(exc, 'orig', exc)).strip().splitlines()[0]}", file=sys.stderr)  # fmt: skip
        return 2
    try:
        has_keys = keys_exist(db)
    finally:
        db.dispose()
    refusal = bind_refusal(settings, has_keys=has_keys)
    if refusal:
        print(f"rlvitals serve: {refusal}", file=sys.stderr)
        return 2
    try:
        lock = sqlite_serve_lock(settings.resolved_database_url)  # noqa: F841 (held until exit)
    except ServeLocked as exc:
        print(f"rlvitals serve: {exc}", file=sys.stderr)
        return 2
    common = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "log_config": log_config(settings.log_level),
        "http": PROTOCOL,
        "proxy_headers": False,
        "access_log": settings.access_log,
        "timeout_graceful_shutdown": 5,
        "limit_concurrency": uvicorn_limit_concurrency(settings.max_connections),
    }
    NoDelayHTTPProtocol.header_timeout = settings.header_timeout
    print(_banner(settings, plugins), file=sys.stderr, flush=True)
    if settings.workers == 1:
        from rlvitals.service.app import create_app

        app = create_app(settings)
        tune_gc()
        uvicorn.run(app, **common)
    else:
        os.environ[SETTINGS_ENV] = settings.model_dump_json()
        uvicorn.run("rlvitals.service.serving:app_from_env", factory=True, workers=settings.workers, **common)
    return 0


def log_config(level: str) -> dict:
    """uvicorn's logging configuration with the server's own loggers (``rlvitals.*``: an aborted
    upload, reclaimed audit jobs) on uvicorn's handler at ``level``; without it Python drops their
    info lines and prints warnings without a level."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["rlvitals"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def _banner(settings, plugins=()) -> str:
    """The two things a person starting a server wants to know: where to look, where the data goes."""
    from sqlalchemy.engine import make_url

    host = settings.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    database = make_url(settings.resolved_database_url).render_as_string(hide_password=True)
    lines = [
        f"rlvitals: dashboard http://{shown}:{settings.port}/  (API /api/v1, OpenAPI /docs)",
        f"rlvitals: database {database}",
    ]
    if not settings.plugins:
        lines.append("rlvitals: plugins off (RLVITALS_PLUGINS=0)")
    elif plugins:
        lines.append(f"rlvitals: plugins {', '.join(str(p) for p in plugins)}")
    return "\n".join(lines)


def _keys_create(args: argparse.Namespace) -> int:
    from rlvitals.service.auth import create_key

    db = _database(_settings(args))
    try:
        key_id, key = create_key(db, name=args.name)
    finally:
        db.dispose()
    print(key)
    print(
        f"key {key_id} ({args.name!r}) created. It is shown only this once; writes now need "
        "'Authorization: Bearer <key>'.",
        file=sys.stderr,
    )
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    from rlvitals.service.auth import list_keys

    db = _database(_settings(args))
    try:
        keys = list_keys(db)
    finally:
        db.dispose()
    if args.json:
        print(json.dumps(keys))
        return 0
    for key in keys:
        state = "revoked" if key["revoked_at"] else "active"
        print(f"{key['id']}\t{key['prefix']}...\t{state}\t{key['name']}")
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    from rlvitals.service.auth import revoke_key

    db = _database(_settings(args))
    try:
        count = revoke_key(db, ident=args.key)
    finally:
        db.dispose()
    if count == 0:
        print(f"rlvitals keys revoke: no active key matches {args.key!r}", file=sys.stderr)
        return 1
    print(f"revoked {count} key(s)")
    return 0


def _keys_open(args: argparse.Namespace) -> int:
    from rlvitals.service.auth import open_writes

    db = _database(_settings(args))
    try:
        count = open_writes(db)
    except ValueError as exc:
        print(f"rlvitals keys open: {exc}", file=sys.stderr)
        return 1
    finally:
        db.dispose()
    print(f"writes are open to anyone who can reach the server ({count} revoked key(s) forgotten)")
    return 0
