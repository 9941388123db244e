"""Alert lifecycle: health findings -> alert rows (one open per run and rule) -> webhook outbox (with
``webhook_events="alerts"``; by default the webhooks announce incidents instead: service/incidents.py).

A ``firing`` finding opens an alert unless one is already open for that (run, rule) (a partial
unique index enforces it, so there is never a storm of duplicates); a ``resolved`` finding closes it.
Each transition queues one delivery per configured webhook in the same transaction (an outbox the
webhook sender drains in the background). ``info`` alerts are stored and shown (dashboard, API, import
output) but not sent unless ``webhook_info`` is set; an open info alert that escalates to warning or
critical is updated in place and sent then, as a firing transition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlvitals.service.encoding import jsonable
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from rlvitals.service.webhooks import notification_budget, queue_deliveries, slack_escape
from sqlalchemy.engine import Connection as Session

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def alert_public(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "run_id": row["run_id"],
        "rule": row["rule"],
        "severity": row["severity"],
        "state": row["state"],
        "signal": row["signal"],
        "first_step": row["first_step"],
        "last_step": row["last_step"],
        "value": row["value"],
        "message": row["message"],
        "advice": row["advice"],
        "evidence": row["evidence"] or {},
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "resolved_at": row["resolved_at"],
    }


def run_status(alerts: Iterable[Mapping[str, Any]]) -> str:
    """healthy / warning / critical: the worst severity among the run's firing alerts."""
    worst = 0  # info alerts leave a run healthy
    for alert in alerts:
        if alert["state"] == "firing":
            worst = max(worst, SEVERITY_RANK.get(alert["severity"], 1))
    return {0: "healthy", 1: "warning", 2: "critical"}[worst]


def webhook_payloads(
    alert: Mapping[str, Any], run: Mapping[str, Any], *, suppressed: int = 0
) -> tuple[dict, dict]:
    """(generic JSON payload, Slack-compatible ``{"text": ...}`` payload) for one transition;
    ``suppressed``: the rule's transitions on this run skipped by the rate limit since the last one."""
    generic = {
        "event": f"alert.{alert['state']}",
        "alert": alert,
        "run": {"id": run["id"], "name": run["name"], "project": run["project"]},
        "suppressed": suppressed,
    }
    e = slack_escape
    icon = ":white_check_mark:" if alert["state"] == "resolved" else ":rotating_light:"
    verb = "resolved" if alert["state"] == "resolved" else alert["severity"].upper()
    text = (
        f"{icon} *{verb}* `{e(alert['rule'])}` on run *{e(run['project'])}/{e(run['name'])}* "
        f"(step {alert['last_step']}): {e(alert['message'])}"
    )
    if alert["state"] == "firing" and alert["advice"]:
        text += f"\n_What to do:_ {e(alert['advice'])}"
    if suppressed:
        text += f"\n_{suppressed} more transition(s) of this rule on this run were not sent (rate limit)._"
    return generic, {"text": text}


def apply_findings(
    *,
    session: Session,
    run_id: int,
    run: Callable[[], Mapping[str, Any]],
    findings: Iterable[Any],
    open_episodes: bool,
    newest_step: int | None,
    now: float,
    settings: Settings,
) -> list[dict[str, Any]]:
    """Turn findings into alert changes; return the changed alerts (public shape) for live events."""
    changed: list[dict[str, Any]] = []
    for finding in findings:
        existing = repo.open_alert_id(session=session, run_id=run_id, rule=finding.rule)
        value = jsonable(finding.value)
        if finding.state == "firing":
            if existing is not None:
                severity = str(getattr(finding.severity, "value", finding.severity))
                before = repo.get_alert(session=session, alert_id=existing)
                escalated = SEVERITY_RANK.get(severity, 1) > SEVERITY_RANK.get(before["severity"], 1)
                values = {"last_step": finding.step, "value": value, "updated_at": now}
                if escalated:  # an info episode became a warning (or worse): update it and send it now
                    values |= {
                        "severity": severity,
                        "message": finding.message,
                        "advice": finding.advice,
                        "evidence": jsonable(finding.evidence),
                    }
                repo.update_alert(session=session, alert_id=existing, values=values)
                if not escalated:  # already open: refreshed, no new alert, no new webhook
                    continue
                alert = alert_public(repo.get_alert(session=session, alert_id=existing))
                changed.append(alert)
                _queue_webhooks(session=session, alert=alert, run=run(), now=now, settings=settings)
                continue
            alert_id = repo.insert_alert(
                session=session,
                values={
                    "run_id": run_id,
                    "rule": finding.rule,
                    "severity": str(getattr(finding.severity, "value", finding.severity)),
                    "state": "firing",
                    "signal": finding.signal,
                    "first_step": finding.onset_step,
                    "last_step": finding.step,
                    "value": value,
                    "message": finding.message,
                    "advice": finding.advice,
                    "evidence": jsonable(finding.evidence),
                    "created_at": now,
                    "updated_at": now,
                },
            )
        else:
            if existing is None:
                continue
            alert_id = existing
            repo.update_alert(
                session=session,
                alert_id=alert_id,
                values={
                    "state": "resolved",
                    "last_step": finding.step,
                    "value": value,
                    "updated_at": now,
                    "resolved_at": now,
                },
            )
        alert = alert_public(repo.get_alert(session=session, alert_id=alert_id))
        changed.append(alert)
        _queue_webhooks(session=session, alert=alert, run=run(), now=now, settings=settings)
    if open_episodes and newest_step is not None:
        repo.touch_firing_alerts(session=session, run_id=run_id, step=newest_step, now=now)
    return changed


def _queue_webhooks(
    *, session: Session, alert: dict[str, Any], run: Mapping[str, Any], now: float, settings: Settings
) -> None:
    if not (settings.webhook_urls or settings.slack_webhook_urls) or settings.webhook_events != "alerts":
        return  # by default the webhooks announce incidents (service/incidents.py), not each alert
    if alert["severity"] == "info" and not settings.webhook_info:
        return  # info is for the dashboard and the import output; webhook_info routes it to webhooks too
    suppressed = notification_budget(session=session, alert=alert, now=now, settings=settings)
    if suppressed is None:  # over the rule's rate limit: counted in the next one that goes out
        return
    generic, slack = webhook_payloads(alert, run, suppressed=suppressed)
    queue_deliveries(
        session=session,
        settings=settings,
        owner={"alert_id": alert["id"]},
        generic=generic,
        slack=slack,
        now=now,
    )


def settle(ctx, run_id: int | None) -> None:
    """Let the health rules reach the writes that answered before this read (``health_wait`` at most)."""
    if ctx.evaluator is not None:
        ctx.evaluator.settle(run_id)


def list_alerts(ctx, *, run_id: int | None, state: str | None, limit: int, offset: int) -> dict[str, Any]:
    from rlvitals.service.errors import NotFound

    settle(ctx, run_id)
    with ctx.db.read() as session:
        if run_id is not None and not repo.run_exists(session=session, run_id=run_id):
            raise NotFound(f"run {run_id} does not exist")
        rows, count = repo.list_alerts(
            session=session, run_id=run_id, state=state, limit=limit, offset=offset
        )
    return {"data": [alert_public(r) for r in rows], "count": count}
