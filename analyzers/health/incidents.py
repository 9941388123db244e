"""Incidents: findings that share a cause and a time window, as one problem with one notification.

A rule's episode (a ``"firing"`` finding, later a ``"resolved"`` one) says one signal is out of range; a
real problem usually trips several rules, and a noisy series trips the same rule again and again. The
:class:`IncidentTracker` sits behind the rules (``HealthMonitor`` feeds it every step) and folds the
findings into incidents:

- **Cause.** Each firing finding gets a cause: :data:`CAUSES` maps a rule to its cause (a rule not in it
  is its own cause), refined by what the run showed on the steps behind the finding:

  - ``grad_norm_zero`` on steps whose batch tied on reward (``reward_std`` 0 or every group zero-std, on
    that point or the previous logged one, which is the batch a repeated update reuses) is explained by
    the ``zero_advantage`` incident. It pages only when a rule that judges the share of tied groups
    (:data:`ZERO_ADVANTAGE_JUDGES`) fires too; otherwise it is ``info`` (GRPO with small groups has
    whole batches that tie, and a zero gradient on them is what the algorithm does).
  - ``policy_collapse`` on a step where most completions hit the length cap (``response_clip_ratio``
    at or above ``truncated_share``, on that point or the previous one) is a ``truncation`` incident:
    the reward dropped because the answers were cut, not because the policy degenerated.

- **One incident per cause at a time.** A finding whose cause has an open incident joins it as evidence
  (each finding kept with its value and step); the incident's severity is the worst of its members' and
  only rises. Its primary rule is the member with the highest severity (a rule native to the cause wins a
  tie, then the earliest).
- **Hold.** A warning incident is worth a page (*confirmed*) once it has been open ``hold_steps`` steps
  (at least ``hold_points`` points after the one it opened on) with a member still firing, so a flicker
  never pages: one whose alerts all ended within the hold (a one-point spike) is kept, not announced, and
  is announced if a member fires again before it resolves, or reopens it. A critical one is confirmed at
  once, and so is one whose finding its rule confirmed by the cause (evidence ``corroborated_by``: a
  truncation burst the reward fell with, a gradient spike the KL jumped with or whose clipped update was
  still outsized, a KL spike past a nat), which is no flicker however short.
- **Damping.** An incident resolves only after every member has resolved *and* ``quiet_steps`` steps
  (at least ``quiet_points`` logged points) passed without any member firing again; a finding of the same
  cause within ``reopen_steps`` after it resolved reopens the same incident (same number) instead of
  opening a new one. Each reopen doubles the quiet time the incident needs before it resolves again (up to
  64×): a series that keeps coming back is one problem that stays open, not a page and an all-clear every
  few hundred steps.

Each change is an :class:`IncidentUpdate` (``opened``, ``escalated``, ``updated``, ``reopened``,
``resolved``) carrying a snapshot of the incident. Whether an update is worth a notification is
:func:`notification`'s call (one when it opens at or above the notify level, one per escalation, one when
it resolves or reopens; :mod:`.notify`), so the service, ``rlvitals import`` and the benchmark count alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .findings import CORROBORATED_BY, FIRING, Finding, decode_floats, encode_floats

OPENED = "opened"
ESCALATED = "escalated"
UPDATED = "updated"
REOPENED = "reopened"
RESOLVED = "resolved"

# rule -> cause; a rule not listed is its own cause
CAUSES: dict[str, str] = {
    "zero_advantage_groups": "zero_advantage",
    "reward_std_collapse": "zero_advantage",
    "grad_norm_zero": "no_gradient",
    "truncation_high": "truncation",
    "entropy_collapse": "collapse",
    "response_length_collapse": "collapse",
    # the look-ahead and no-baseline rules join the problem they foresee or judge
    "entropy_forecast": "collapse",
    "reward_no_signal": "zero_advantage",
    "mismatch_trend": "rollout_mismatch",
}
# causes that are one problem when they overlap in time (an open incident of the family takes the finding)
FAMILIES: dict[str, str] = {
    # the policy rambling into the length cap: entropy up, reward down, answers cut, rollout drifting
    "truncation": "degeneration",
    "entropy_explosion": "degeneration",
    "policy_collapse": "degeneration",
    "rollout_mismatch": "degeneration",
    "response_length_explosion": "degeneration",
    # the policy collapsing onto one answer: entropy and length down, rewards tie, no gradient
    "collapse": "collapse",
    "zero_advantage": "collapse",
    "no_gradient": "collapse",
    # the update itself unstable
    "grad_norm_spike": "instability",
    "grad_norm_extreme": "instability",
    "kl_spike": "instability",
    "kl_loss_runaway": "instability",
    "ppo_kl_drift": "instability",
    "pg_clipfrac_range": "instability",
    "pg_clipfrac_lower_high": "instability",
}
# rules that judge whether the share of tied groups is a problem (an explained zero gradient pages with them)
ZERO_ADVANTAGE_JUDGES = frozenset({"zero_advantage_groups", "reward_std_collapse", "reward_no_signal"})

TITLES: dict[str, str] = {
    "zero_advantage": "no learning signal: rewards tie within groups (zero advantage)",
    "no_gradient": "no gradient reaches the weights",
    "truncation": "completions cut at the length cap",
    "collapse": "entropy / response length collapse",
    "policy_collapse": "policy degenerating (reward falls while entropy rises)",
}

_RANK = {"info": 0, "warning": 1, "critical": 2}
_MAX_FINDINGS = 50  # evidence kept per incident; the rest are counted


def register_cause(rule: str, cause: str, *, family: str | None = None, title: str | None = None) -> None:
    """Group ``rule``'s findings under ``cause`` (and ``cause`` under ``family``): a user's rule joins a
    built-in cause or family the same way."""
    if not rule or not cause:
        raise ValueError("rule and cause must be non-empty strings")
    CAUSES[rule] = cause
    if family:
        FAMILIES[cause] = family
    if title:
        TITLES[cause] = title


def family_of(cause: str) -> str:
    return FAMILIES.get(cause, cause)


def cause_title(cause: str) -> str:
    return TITLES.get(cause, cause.replace("_", " "))


@dataclass(frozen=True)
class IncidentSettings:
    """Damping and attribution knobs (defaults in one place; checked once)."""

    hold_steps: int = 20
    hold_points: int = 2
    quiet_steps: int = 50
    quiet_points: int = 3
    reopen_steps: int = 200
    tie_tol: float = 1e-12
    explained_share: float = 0.8
    truncated_share: float = 0.5

    def __post_init__(self) -> None:
        if (
            min(self.hold_steps, self.hold_points, self.quiet_steps, self.reopen_steps) < 0
            or self.quiet_points < 1
        ):
            raise ValueError("incidents: need hold_*, quiet_steps, reopen_steps >= 0 and quiet_points >= 1")
        if not (0.0 < self.explained_share <= 1.0 and 0.0 < self.truncated_share <= 1.0):
            raise ValueError("incidents: explained_share and truncated_share must be in (0, 1]")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> IncidentSettings:
        names = {f.name for f in fields(cls)}
        unknown = set(values or {}) - names
        if unknown:
            raise ValueError(f"incidents: unknown setting(s) {sorted(unknown)}; expected {sorted(names)}")
        return cls(**dict(values or {}))


@dataclass
class Incident:
    """One problem of one run: its cause, severity, members (one per rule) and the findings behind it."""

    number: int
    cause: str
    severity: str
    state: str  # open | resolved
    onset_step: int
    last_step: int
    primary: str
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    dropped_findings: int = 0
    resolved_step: int | None = None
    quiet_since: int | None = None  # step every member was resolved at (None while one fires)
    quiet_points: int = 0
    reopened: int = 0
    opened_step: int | None = None
    confirmed: bool = False  # critical, or open for hold_steps: worth a page
    held_points: int = 0

    @property
    def title(self) -> str:
        return cause_title(self.cause)

    @property
    def message(self) -> str:
        member = self.members.get(self.primary) or {}
        return str(member.get("message") or self.title)

    @property
    def advice(self) -> str:
        return str((self.members.get(self.primary) or {}).get("advice") or "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "cause": self.cause,
            "title": self.title,
            "severity": self.severity,
            "state": self.state,
            "onset_step": self.onset_step,
            "last_step": self.last_step,
            "resolved_step": self.resolved_step,
            "primary": self.primary,
            "message": self.message,
            "advice": self.advice,
            "members": {k: dict(v) for k, v in self.members.items()},
            "findings": [dict(f) for f in self.findings],
            "dropped_findings": self.dropped_findings,
            "reopened": self.reopened,
            "confirmed": self.confirmed,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.to_dict(),
            "quiet_since": self.quiet_since,
            "quiet_points": self.quiet_points,
            "opened_step": self.opened_step,
            "held_points": self.held_points,
        }

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> Incident:
        return cls(
            number=int(data["number"]),
            cause=str(data["cause"]),
            severity=str(data["severity"]),
            state=str(data["state"]),
            onset_step=int(data["onset_step"]),
            last_step=int(data["last_step"]),
            primary=str(data["primary"]),
            members={str(k): dict(v) for k, v in (data.get("members") or {}).items()},
            findings=[dict(f) for f in data.get("findings") or ()],
            dropped_findings=int(data.get("dropped_findings", 0)),
            resolved_step=data.get("resolved_step"),
            quiet_since=data.get("quiet_since"),
            quiet_points=int(data.get("quiet_points", 0)),
            reopened=int(data.get("reopened", 0)),
            opened_step=data.get("opened_step"),
            confirmed=bool(data.get("confirmed", False)),
            held_points=int(data.get("held_points", 0)),
        )


@dataclass(frozen=True)
class IncidentUpdate:
    """One change of one incident: ``kind`` (opened / escalated / updated / reopened / resolved), the step it
    happened at, the severity before it, and the incident as it is now (``incident``, plain dict)."""

    kind: str
    step: int
    previous_severity: str | None
    incident: dict[str, Any]

    @property
    def number(self) -> int:
        return int(self.incident["number"])

    @property
    def severity(self) -> str:
        return str(self.incident["severity"])


def _firing(incident: Incident) -> bool:
    """Whether a member of ``incident`` still fires (its problem goes on)."""
    return any(m.get("state") == "firing" for m in incident.members.values())


def _update(kind: str, step: int, incident: Incident) -> IncidentUpdate:
    """The update saying ``incident`` changed at ``step`` (its severity unchanged by it)."""
    return IncidentUpdate(
        kind=kind, step=step, previous_severity=incident.severity, incident=incident.to_dict()
    )


class IncidentTracker:
    """Folds one run's findings into incidents (see the module docstring). Not thread-safe."""

    def __init__(self, settings: IncidentSettings | Mapping[str, Any] | None = None) -> None:
        if not isinstance(settings, IncidentSettings):
            settings = IncidentSettings.from_mapping(settings)
        self.settings = settings
        self.incidents: dict[int, Incident] = {}  # open ones, and resolved ones still inside reopen_steps
        self.next_number = 1
        # what the last two logged points said about ties and truncation: [(step, value)], newest last
        self._ties: deque[tuple[int, bool]] = deque(maxlen=2)
        self._clips: deque[tuple[int, float]] = deque(maxlen=2)
        self._zero_grads: deque[tuple[int, bool]] = deque(maxlen=10)  # zero-gradient points: explained?

    # ------------------------------------------------------------------ feeds

    def observe(
        self, step: int, signals: Mapping[str, float], findings: Iterable[Finding]
    ) -> list[IncidentUpdate]:
        """One step: its canonical signals (may be empty, e.g. for an audit) and the findings it produced."""
        if signals:
            self._note_signals(step, signals)
        updates: list[IncidentUpdate] = []
        touched: set[int] = set()
        started: set[int] = set()  # opened or reopened on this point: their hold starts after it
        for finding in findings:
            update = self._apply(finding)
            if update is not None:
                touched.add(update.number)
                if update.kind in (OPENED, REOPENED):
                    started.add(update.number)
                updates.append(update)
        updates.extend(self._advance_quiet(step, skip=touched, started=started))
        return updates

    def confirm_open(self, step: int) -> list[IncidentUpdate]:
        """The stream ended (an import reached the end of its file, a run finished): confirm every open
        incident still inside its hold whose problem goes on (a member still firing), so it is reported
        rather than dropped; one whose members all ended is a passing flicker, as at the end of a hold."""
        updates = []
        for incident in self.incidents.values():
            if incident.state == "open" and not incident.confirmed and _firing(incident):
                incident.confirmed = True
                updates.append(_update(UPDATED, step, incident))
        return updates

    def critical_open(self) -> bool:
        """Whether an open incident is critical (cheap: no copy)."""
        return any(i.state == "open" and i.severity == "critical" for i in self.incidents.values())

    def open_incidents(self) -> list[dict[str, Any]]:
        return [i.to_dict() for i in self.incidents.values() if i.state == "open"]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return encode_floats(
            {
                "next_number": self.next_number,
                "incidents": [i.state_dict() for i in self.incidents.values()],
                "ties": [list(t) for t in self._ties],
                "clips": [list(c) for c in self._clips],
                "zero_grads": [list(z) for z in self._zero_grads],
            }
        )

    @classmethod
    def from_state(
        cls, state: Mapping[str, Any] | None, settings: IncidentSettings | Mapping[str, Any] | None = None
    ) -> IncidentTracker:
        tracker = cls(settings)
        if not state:
            return tracker
        state = decode_floats(state)
        tracker.next_number = int(state.get("next_number", 1))
        for data in state.get("incidents") or ():
            incident = Incident.from_state(data)
            tracker.incidents[incident.number] = incident
        tracker._ties.extend((int(s), bool(v)) for s, v in state.get("ties") or ())
        tracker._clips.extend((int(s), float(v)) for s, v in state.get("clips") or ())
        tracker._zero_grads.extend((int(s), bool(v)) for s, v in state.get("zero_grads") or ())
        return tracker

    # ------------------------------------------------------------------ attribution

    def _note_signals(self, step: int, signals: Mapping[str, float]) -> None:
        tol = self.settings.tie_tol
        std = signals.get("reward_std")
        zero_frac = signals.get("zero_std_frac")
        if std is not None or zero_frac is not None:
            tied = (std is not None and abs(std) <= tol) or (
                zero_frac is not None and zero_frac >= 1.0 - 1e-9
            )
            if not self._ties or self._ties[-1][0] != step:
                self._ties.append((step, tied))
            else:
                self._ties[-1] = (step, self._ties[-1][1] or tied)
        clip = signals.get("response_clip_ratio")
        if clip is not None and (not self._clips or self._clips[-1][0] != step):
            self._clips.append((step, clip))
        grad = signals.get("grad_norm")
        if grad is not None and abs(grad) <= tol:
            self._zero_grads.append((step, self._tied_at(step)))

    def _tied_at(self, step: int) -> bool:
        """The batch behind ``step`` tied: this point says so, or (when this point says nothing about
        rewards) the previous logged point did (a repeated update on the same batch)."""
        for tie_step, tied in reversed(self._ties):
            if tie_step <= step:
                return tied
        return False

    def _cause(self, finding: Finding) -> tuple[str, dict[str, Any]]:
        rule = finding.rule
        cause = CAUSES.get(rule, rule)
        if rule == "grad_norm_zero":
            recent = [explained for s, explained in self._zero_grads if s <= finding.step]
            if recent:
                share = sum(recent) / len(recent)
                if share >= self.settings.explained_share:
                    return "zero_advantage", {
                        "explained_by": "tied_batches",
                        "tied_share": round(share, 4),
                        "zero_grad_points": len(recent),
                        # the rule warns on tied zeros only when they are sustained over most steps
                        "sustained": bool(finding.evidence.get("sustained")),
                    }
        if rule == "policy_collapse":
            clipped = [value for s, value in self._clips if s <= finding.step]
            if clipped and max(clipped) >= self.settings.truncated_share:
                return "truncation", {"explained_by": "length_cap", "clip_ratio": max(clipped)}
        return cause, {}

    # ------------------------------------------------------------------ lifecycle

    def _find(self, cause: str, step: int) -> Incident | None:
        """The open incident of this cause, else an open one of its family, else one of the family that
        resolved within ``reopen_steps``."""
        family = family_of(cause)
        same = kin = recent = None
        for incident in self.incidents.values():
            causes = {m.get("cause", incident.cause) for m in incident.members.values()} | {incident.cause}
            if not any(family_of(c) == family for c in causes):
                continue
            if incident.state == "open":
                if cause in causes:
                    same = same or incident
                else:
                    kin = kin or incident
            elif (
                incident.resolved_step is not None
                and step - incident.resolved_step <= self.settings.reopen_steps
            ):
                recent = incident
        return same or kin or recent

    def _member_for(self, incident: Incident, finding: Finding) -> dict[str, Any] | None:
        member = incident.members.get(finding.rule)
        if member is not None and member.get("onset_step") == finding.onset_step:
            return member
        return None

    def _apply(self, finding: Finding) -> IncidentUpdate | None:
        severity = str(getattr(finding.severity, "value", finding.severity))
        if finding.state != FIRING:
            return self._resolve_member(finding, severity)
        cause, explanation = self._cause(finding)
        incident = self._find(cause, finding.step)
        record = {
            "rule": finding.rule,
            "state": finding.state,
            "severity": severity,
            "step": finding.step,
            "onset_step": finding.onset_step,
            "value": finding.value,
            "signal": finding.signal,
        }
        if incident is None:
            incident = Incident(
                number=self.next_number,
                cause=cause,
                severity="info",
                state="open",
                onset_step=finding.onset_step,
                last_step=finding.step,
                primary=finding.rule,
                opened_step=finding.step,
            )
            self.next_number += 1
            self.incidents[incident.number] = incident
            kind = OPENED
        elif incident.state == "resolved":
            incident.state = "open"
            incident.resolved_step = None
            incident.reopened += 1
            kind = REOPENED
        else:
            kind = UPDATED
        before = incident.severity if kind != OPENED else None
        known = self._member_for(incident, finding)
        episodes = (incident.members.get(finding.rule) or {}).get("episodes", 0)
        member = {
            "rule": finding.rule,
            "severity": severity,
            "state": "firing",
            "onset_step": finding.onset_step,
            "first_step": (known or {}).get("first_step", finding.step),
            "step": finding.step,
            "value": finding.value,
            "signal": finding.signal,
            "message": finding.message,
            "advice": finding.advice,
            "episodes": episodes if known is not None else episodes + 1,
            "cause": cause,
        }
        if explanation:
            member["explained"] = explanation
        elif known is not None and "explained" in known:
            member["explained"] = known["explained"]
        incident.members[finding.rule] = member
        self._add_finding(incident, record)
        incident.onset_step = min(incident.onset_step, finding.onset_step)
        incident.last_step = max(incident.last_step, finding.step)
        incident.quiet_since, incident.quiet_points = None, 0
        self._rescore(incident)
        if incident.severity == "critical" or (severity != "info" and finding.evidence.get(CORROBORATED_BY)):
            incident.confirmed = True
        if kind == UPDATED and before is not None and _RANK[incident.severity] > _RANK[before]:
            kind = ESCALATED
        return IncidentUpdate(
            kind=kind, step=finding.step, previous_severity=before, incident=incident.to_dict()
        )

    def _resolve_member(self, finding: Finding, severity: str) -> IncidentUpdate | None:
        for incident in self.incidents.values():
            if incident.state != "open":
                continue
            member = self._member_for(incident, finding)
            if member is None or member["state"] != "firing":
                continue
            member.update(state="resolved", resolved_step=finding.step, value=finding.value)
            self._add_finding(
                incident,
                {
                    "rule": finding.rule,
                    "state": finding.state,
                    "severity": severity,
                    "step": finding.step,
                    "onset_step": finding.onset_step,
                    "value": finding.value,
                    "signal": finding.signal,
                },
            )
            incident.last_step = max(incident.last_step, finding.step)
            if all(m["state"] != "firing" for m in incident.members.values()):
                incident.quiet_since, incident.quiet_points = finding.step, 0
            return _update(UPDATED, finding.step, incident)
        return None

    def _advance_quiet(self, step: int, *, skip: set[int], started: set[int]) -> list[IncidentUpdate]:
        """Hold and quiet time, once per point. The hold is judged on every point, findings or not, and
        counts the points after the one the incident opened (or reopened) on; the quiet time counts only
        points without a finding of it."""
        updates = []
        reopen = self.settings.reopen_steps
        for number in list(self.incidents):
            incident = self.incidents[number]
            if incident.state == "resolved":
                if incident.resolved_step is not None and step - incident.resolved_step > reopen:
                    del self.incidents[number]  # past the reopen window: the caller keeps the record
                continue
            if not incident.confirmed:
                if number not in started:
                    incident.held_points += 1
                opened = incident.opened_step if incident.opened_step is not None else step
                # past its hold, and the problem goes on: a member still fires. One whose alerts all ended
                # within the hold (a one-point spike, a flicker) is not announced; it is if one fires again
                if (
                    step - opened >= self.settings.hold_steps
                    and incident.held_points >= self.settings.hold_points
                    and _firing(incident)
                ):
                    incident.confirmed = True
                    updates.append(_update(UPDATED, step, incident))
            if incident.quiet_since is None or number in skip:
                continue
            if step > incident.quiet_since:
                incident.quiet_points += 1
            if (
                step - incident.quiet_since >= self.settings.quiet_steps * 2 ** min(incident.reopened, 6)
                and incident.quiet_points >= self.settings.quiet_points
            ):
                incident.state = "resolved"
                incident.resolved_step = step
                incident.quiet_since, incident.quiet_points = None, 0
                updates.append(_update(RESOLVED, step, incident))
        return updates

    def _add_finding(self, incident: Incident, record: dict[str, Any]) -> None:
        if len(incident.findings) >= _MAX_FINDINGS:
            incident.dropped_findings += 1
            return
        incident.findings.append(record)

    @staticmethod
    def _effective(incident: Incident, member: Mapping[str, Any]) -> str:
        """A zero gradient explained by tied batches pages only with a rule that judges the tie share (at
        any severity: tied groups that are solved prompts are ``info`` for that rule, but gradients that are
        zero on most steps still waste them), or when the zeros are sustained over most of the run's
        recent steps (``grad_norm_zero``'s ``sustained_share``)."""
        explained = member.get("explained", {})
        if (
            explained.get("explained_by") == "tied_batches"
            and not explained.get("sustained")
            and not any(rule in ZERO_ADVANTAGE_JUDGES for rule in incident.members)
        ):
            return "info"
        return str(member["severity"])

    def _rescore(self, incident: Incident) -> None:
        best: tuple[int, int, int] | None = None
        worst = _RANK[incident.severity]  # severity only rises within an incident
        for rule, member in incident.members.items():
            effective = self._effective(incident, member)
            member["effective_severity"] = effective
            rank = _RANK[effective]
            worst = max(worst, rank)
            native = 1 if CAUSES.get(rule, rule) == member.get("cause") else 0
            key = (rank, native, -int(member["first_step"]))
            if best is None or key > best:
                best, incident.primary = key, rule
        incident.cause = str(incident.members[incident.primary].get("cause", incident.cause))
        incident.severity = {0: "info", 1: "warning", 2: "critical"}[worst]
