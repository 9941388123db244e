"""Runs: create-or-resume by (project, name), and the public view with health status and open alerts."""

from __future__ import annotations

import json
import time
from typing import Any

from rlvitals.service.alerts import alert_public, run_status, settle
from rlvitals.service.context import Services
from rlvitals.service.encoding import jsonable, storable_problem
from rlvitals.service.errors import InvalidInput, NotFound
from rlvitals.service.schemas import RunCreate
from rlvitals.service.storage import repository as repo


def run_health(ctx: Services, run_id: int) -> dict[str, Any]:
    """``{"marks", "signals", "step"}``: every health rule's threshold lines and bands with this run's
    settings, the entropy forecast, and the latest value of each canonical signal."""
    settle(ctx, run_id)
    with ctx.db.read() as session:
        run = repo.get_run(session=session, run_id=run_id)
        if run is None:
            raise NotFound(f"run {run_id} does not exist")
        return ctx.health.snapshot(session=session, run_id=run_id, run_config=run.get("config") or {})


def run_public(row: dict[str, Any], firing: list[dict[str, Any]], *, config: bool = True) -> dict[str, Any]:
    out = {
        "id": row["id"],
        "name": row["name"],
        "project": row["project"],
        "tags": row["tags"] or [],
        "last_step": row["last_step"],
        "status": run_status(firing),
        "firing_alerts": firing,
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
    }
    if config:
        out["config"] = row["config"] or {}
    return out


def create_or_resume(ctx: Services, body: RunCreate) -> tuple[dict[str, Any], bool]:
    """The run named (project, name); ``created`` is False when it already existed (resume).

    Resuming with a non-empty config replaces the stored one (and rebuilds the run's monitor with it);
    tags are merged.
    """
    limit = ctx.settings.max_run_config_bytes
    size = len(json.dumps(body.config, separators=(",", ":"), default=str).encode())
    if size > limit:
        raise InvalidInput(
            f"config is {size} bytes of JSON; the limit is {limit} (max_run_config_bytes): keep the "
            "trainer's settings there, not its data",
            detail={"field": "config", "bytes": size, "limit": limit},
        )
    problem = storable_problem(body.config, max_depth=ctx.settings.max_json_depth)
    if problem is not None:
        raise InvalidInput(f"config{problem.removeprefix('value')}", detail={"field": "config"})
    config = jsonable(body.config)
    ctx.health.validate_run_config(config)
    now = time.time()
    with ctx.db.write() as session:
        existing = repo.find_run(session=session, project=body.project, name=body.name)
        if existing is None:
            run_id = repo.insert_run(
                session=session, project=body.project, name=body.name, config=config, tags=body.tags, now=now
            )
            if run_id is not None:
                repo.ensure_health_row(session=session, run_id=run_id, now=now)
                return run_public(repo.get_run(session=session, run_id=run_id), []), True
            existing = repo.find_run(session=session, project=body.project, name=body.name)
        run_id = existing["id"]
        tags = list(dict.fromkeys([*(existing["tags"] or []), *body.tags]))
        new_config = config if config and config != existing["config"] else None
        repo.update_run(session=session, run_id=run_id, now=now, config=new_config, tags=tags)
        if new_config is not None:  # rebuild the monitor from its stored state with the new config
            ctx.health.forget(run_id)
            version = repo.health_version(session=session, run_id=run_id, lock=True) or 0
            repo.save_health_state(
                session=session, run_id=run_id, version=version + 1, state=None, signals=None, now=now
            )
        row = repo.get_run(session=session, run_id=run_id)
        firing, _ = repo.list_alerts(session=session, run_id=run_id, state="firing")
    return run_public(row, [alert_public(a) for a in firing]), False


def list_runs(
    ctx: Services, *, project: str | None, limit: int, offset: int, config: bool = False
) -> dict[str, Any]:
    """A page of runs; their configs (up to ``max_run_config_bytes`` each) only when asked."""
    settle(ctx, None)
    with ctx.db.read() as session:
        rows, count = repo.list_runs(
            session=session, project=project, limit=limit, offset=offset, config=config
        )
        alerts, _ = repo.list_alerts(
            session=session, run_ids=[r["id"] for r in rows], state="firing", limit=None
        )
    by_run: dict[int, list[dict[str, Any]]] = {}
    for alert in alerts:
        by_run.setdefault(alert["run_id"], []).append(alert_public(alert))
    return {"data": [run_public(r, by_run.get(r["id"], []), config=config) for r in rows], "count": count}


def get_run(ctx: Services, run_id: int) -> dict[str, Any]:
    settle(ctx, run_id)
    with ctx.db.read() as session:
        row = repo.get_run(session=session, run_id=run_id)
        if row is None:
            raise NotFound(f"run {run_id} does not exist")
        firing, _ = repo.list_alerts(session=session, run_id=run_id, state="firing", limit=None)
    return run_public(row, [alert_public(a) for a in firing])


def require_run(ctx: Services, run_id: int) -> None:
    with ctx.db.read() as session:
        if not repo.run_exists(session=session, run_id=run_id):
            raise NotFound(f"run {run_id} does not exist")
