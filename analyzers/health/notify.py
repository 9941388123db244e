"""Which incident updates are worth a notification (one policy for the server's webhooks, ``rlvitals
import`` and ``bench/incidents.py``): one when an incident opens at or above the notify level after its
hold, one per escalation, one when a notified incident reopens or resolves."""

from __future__ import annotations

from .incidents import _RANK, ESCALATED, OPENED, REOPENED, RESOLVED, IncidentUpdate


def notification(
    kind: str, severity: str, *, notified: str | None, confirmed: bool = True, min_severity: str = "warning"
) -> str | None:
    """The event to send for an incident update, or ``None``: ``opened`` the first time the incident is
    confirmed (critical, or open ``hold_steps``) at or above ``min_severity`` (whatever the update),
    ``escalated`` when it rises above what was last sent, ``reopened`` when a notified incident comes
    back, ``resolved`` when a notified one resolves. ``notified``: the highest severity already sent for
    this incident (``None``: nothing sent)."""
    if kind == RESOLVED:
        return RESOLVED if notified is not None else None
    if _RANK.get(severity, 1) < _RANK[min_severity] or not confirmed:
        return None
    if notified is None:
        return OPENED
    if kind == REOPENED:
        return REOPENED
    if _RANK.get(severity, 1) > _RANK.get(notified, 1):
        return ESCALATED
    return None


def notification_for(
    update: IncidentUpdate, *, notified: str | None, min_severity: str = "warning"
) -> str | None:
    """:func:`notification` for one :class:`IncidentUpdate`."""
    return notification(
        update.kind,
        update.severity,
        notified=notified,
        confirmed=bool(update.incident.get("confirmed", True)),
        min_severity=min_severity,
    )


def notified_after(event: str | None, severity: str, notified: str | None) -> str | None:
    """The highest severity sent once ``event`` (from :func:`notification`) went out."""
    if event is None or event == RESOLVED:
        return notified
    if notified is None or _RANK.get(severity, 1) > _RANK.get(notified, 1):
        return severity
    return notified
