"""Incident lifecycle: the health monitor's incident updates -> incident rows -> webhook outbox.

The run's ``HealthMonitor`` folds findings into incidents (``rlvitals.analyzers.health.incidents``); every
update it reports is written here in the health evaluator's transaction (one row per (run, number), kept current),
and, with ``webhook_events="incidents"`` (the default), the updates worth a notification (opened,
escalated, reopened, resolved; ``notification``) are queued for every webhook URL in the same transaction,
so a storm of alert transitions becomes a handful of messages. ``info`` incidents are stored and shown but
sent only with ``webhook_info``.

Read side: ``GET /api/v1/runs/{id}/incidents``, ``GET /api/v1/incidents/{id}`` (with the alerts behind it:
the individual findings one click away), the hours (and GPU-hours, with a GPU count) the run spent after
each incident's onset, and ``open_critical`` for a trainer that asked to halt on a critical incident.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlvitals.analyzers.health.notify import notification_for, notified_after
from rlvitals.service.alerts import settle
from rlvitals.service.encoding import jsonable
from rlvitals.service.errors import NotFound
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from rlvitals.service.webhooks import queue_deliveries, slack_escape
from sqlalchemy.engine import Connection as Session


def incident_public(row: Mapping[str, Any], *, cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The API shape of one incident row; ``cost``: ``spent_after_onset`` (hours, GPU-hours)."""
    return {
        "id": row["id"],
        "run_id": row["run_id"],
        "number": row["number"],
        "cause": row["cause"],
        "title": row["title"],
        "severity": row["severity"],
        "state": row["state"],
        "primary_rule": row["primary_rule"],
        "onset_step": row["onset_step"],
        "last_step": row["last_step"],
        "resolved_step": row["resolved_step"],
        "message": row["message"],
        "advice": row["advice"],
        "members": row["members"] or {},
        "findings": row["findings"] or [],
        "dropped_findings": row["dropped_findings"],
        "reopened": row["reopened"],
        "notified_severity": row["notified_severity"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "resolved_at": row["resolved_at"],
        "spent_after_onset": dict(cost) if cost is not None else None,
        "alerts_url": f"/api/v1/incidents/{row['id']}",
    }


def apply_incident_updates(
    *,
    session: Session,
    run_id: int,
    run: Callable[[], Mapping[str, Any]],
    updates: Iterable[Any],
    wall_times: Mapping[int, float | None] | None = None,
    now: float,
    settings: Settings,
) -> list[dict[str, Any]]:
    """Write the incident updates of one ingest; queue their notifications; return the changed incidents
    (public shape, the latest state of each) for live events."""
    changed: dict[int, dict[str, Any]] = {}
    for update in updates:
        data = update.incident
        row = repo.get_incident_by_number(session=session, run_id=run_id, number=data["number"])
        values = {
            "cause": data["cause"],
            "title": data["title"][:200],
            "severity": data["severity"],
            "state": "open" if data["state"] == "open" else "resolved",
            "primary_rule": data["primary"],
            "onset_step": data["onset_step"],
            "last_step": data["last_step"],
            "resolved_step": data["resolved_step"],
            "message": data["message"],
            "advice": data["advice"],
            "members": jsonable(data["members"]),
            "findings": jsonable(data["findings"]),
            "dropped_findings": data["dropped_findings"],
            "reopened": data["reopened"],
            "confirmed": bool(data.get("confirmed")),
            "updated_at": now,
            "resolved_at": now if data["state"] != "open" else None,
        }
        notified = row["notified_severity"] if row is not None else None
        min_severity = "info" if settings.webhook_info else "warning"
        event = notification_for(update, notified=notified, min_severity=min_severity)
        values["notified_severity"] = notified_after(event, update.severity, notified)
        if row is None:
            onset = data["onset_step"]
            onset_time = (wall_times or {}).get(onset)
            if onset_time is None:
                onset_time = repo.wall_time_at(session=session, run_id=run_id, step=onset)
            incident_id = repo.insert_incident(
                session=session,
                values={
                    **values,
                    "run_id": run_id,
                    "number": data["number"],
                    "onset_time": onset_time,
                    "created_at": now,
                },
            )
        else:
            incident_id = row["id"]
            repo.update_incident(session=session, incident_id=incident_id, values=values)
        public = incident_public(repo.get_incident(session=session, incident_id=incident_id))
        changed[incident_id] = public
        if event is not None and settings.webhook_events == "incidents":
            _queue(session=session, incident=public, event=event, run=run(), now=now, settings=settings)
    return list(changed.values())


def webhook_payloads(incident: Mapping[str, Any], event: str, run: Mapping[str, Any]) -> tuple[dict, dict]:
    """(generic JSON payload, Slack-compatible ``{"text": ...}``) for one incident notification."""
    generic = {
        "event": f"incident.{event}",
        "incident": {k: v for k, v in incident.items() if k != "findings"},
        "run": {"id": run["id"], "name": run["name"], "project": run["project"]},
    }
    e = slack_escape
    icon = ":white_check_mark:" if event == "resolved" else ":rotating_light:"
    verb = "resolved" if event == "resolved" else f"{incident['severity'].upper()} ({event})"
    evidence = sorted(set(incident["members"]) - {incident["primary_rule"]})
    text = (
        f"{icon} *{verb}* incident #{incident['number']} on run *{e(run['project'])}/{e(run['name'])}*: "
        f"{e(incident['title'])} (since step {incident['onset_step']}, primary `{e(incident['primary_rule'])}`)"
        f"\n{e(incident['message'])}"
    )
    if evidence:
        text += "\n_Evidence:_ " + ", ".join(f"`{e(rule)}`" for rule in evidence)
    if event != "resolved" and incident["advice"]:
        text += f"\n_What to do:_ {e(incident['advice'])}"
    return generic, {"text": text}


def _queue(
    *,
    session: Session,
    incident: dict[str, Any],
    event: str,
    run: Mapping[str, Any],
    now: float,
    settings: Settings,
) -> None:
    if not (settings.webhook_urls or settings.slack_webhook_urls):
        return
    generic, slack = webhook_payloads(incident, event, run)
    queue_deliveries(
        session=session,
        settings=settings,
        owner={"incident_id": incident["id"]},
        generic=generic,
        slack=slack,
        now=now,
    )


# --- reads ----------------------------------------------------------------------------------------


def _gpus(run: Mapping[str, Any] | None, settings: Settings) -> float | None:
    section = ((run or {}).get("config") or {}).get("rlvitals")
    if isinstance(section, Mapping):
        gpus = section.get("gpus")
        if isinstance(gpus, (int, float)) and not isinstance(gpus, bool) and gpus > 0:
            return float(gpus)
    return settings.gpus_per_run


def _cost(row: Mapping[str, Any], last_time: float | None, gpus: float | None) -> dict[str, Any] | None:
    """Hours (and GPU-hours) between the incident's onset and the run's newest point."""
    onset = row.get("onset_time")
    if onset is None or last_time is None:
        return None
    hours = max(0.0, last_time - onset) / 3600.0
    return {
        "hours": round(hours, 4),
        "gpus": gpus,
        "gpu_hours": None if gpus is None else round(hours * gpus, 4),
    }


def list_incidents(ctx, *, run_id: int | None, state: str | None, limit: int, offset: int) -> dict[str, Any]:
    """A run's incidents (every run's with ``run_id=None``), newest first, with their cost so far."""
    settle(ctx, run_id)
    with ctx.db.read() as session:
        runs: dict[int, Any] = {}
        if run_id is not None:
            runs[run_id] = repo.get_run(session=session, run_id=run_id)
            if runs[run_id] is None:
                raise NotFound(f"run {run_id} does not exist")
        rows, count = repo.list_incidents(
            session=session, run_id=run_id, state=state, limit=limit, offset=offset
        )
        last_times: dict[int, float | None] = {}
        for row in rows:
            rid = row["run_id"]
            if rid not in runs:
                runs[rid] = repo.get_run(session=session, run_id=rid)
            if rid not in last_times:
                last_times[rid] = repo.last_wall_time(session=session, run_id=rid)
    data = [
        incident_public(r, cost=_cost(r, last_times[r["run_id"]], _gpus(runs[r["run_id"]], ctx.settings)))
        for r in rows
    ]
    return {"data": data, "count": count}


def get_incident(ctx, *, incident_id: int) -> dict[str, Any]:
    """One incident with the alerts behind it (each alert episode of its member rules in its span)."""
    from rlvitals.service.alerts import alert_public

    settle(ctx, None)
    with ctx.db.read() as session:
        row = repo.get_incident(session=session, incident_id=incident_id)
        if row is None:
            raise NotFound(f"incident {incident_id} does not exist")
        run = repo.get_run(session=session, run_id=row["run_id"])
        alerts = repo.incident_alerts(
            session=session,
            run_id=row["run_id"],
            rules=list((row["members"] or {}).keys()),
            start=min(
                [
                    row["onset_step"],
                    *[int(m.get("onset_step", row["onset_step"])) for m in (row["members"] or {}).values()],
                ]
            ),
            end=row["resolved_step"] if row["state"] == "resolved" else None,
        )
        last_time = repo.last_wall_time(session=session, run_id=row["run_id"])
    public = incident_public(row, cost=_cost(row, last_time, _gpus(run, ctx.settings)))
    public["alerts"] = [alert_public(a) for a in alerts]
    return public


def critical_of(*, session: Session, run_id: int, critical_open: bool) -> list[dict] | None:
    """The run's open critical incidents for the metrics-write answer (no query unless the monitor says
    one is open)."""
    if not critical_open:
        return None
    return open_critical(session=session, run_id=run_id) or None


def open_critical(*, session: Session, run_id: int) -> list[dict[str, Any]]:
    """The run's open critical incidents, short (id, number, cause, title, primary rule, onset step): what a
    trainer that asked to halt needs at its next step boundary."""
    return [
        {
            "id": r["id"],
            "number": r["number"],
            "cause": r["cause"],
            "title": r["title"],
            "primary_rule": r["primary_rule"],
            "onset_step": r["onset_step"],
            "message": r["message"],
        }
        for r in repo.open_incidents(session=session, run_id=run_id, severity="critical")
    ]
