"""HealthMonitor: runs every registered, enabled rule over one run's streams and emits findings.

Feed it points in step order::

    monitor = HealthMonitor(settings={"pg_clipfrac_range": {"high": 0.35}}, run_config=verl_config)
    for step, metrics in stream:
        for finding in monitor.observe(step, metrics):      # raw names; aliases resolved inside
            print(finding.state, finding.rule, finding.message, finding.advice)
    monitor.observe_groups(step, group_diagnostics)           # -> zero_advantage_groups
    monitor.observe_audit(step, audit_report)                 # -> audit_mismatch
    blob = json.dumps(monitor.state_dict())                   # persist; later:
    monitor = HealthMonitor.from_state(json.loads(blob))      # identical future behaviour

Episodes: a rule's check is *active* or not at each point it has an opinion on. An unbroken run of
active checks covering ``fire_after`` *steps* opens an episode (one ``"firing"`` finding,
``onset_step`` = first of them); inactive checks covering ``resolve_after`` steps close it (one
``"resolved"`` finding). A check covers the steps since the rule's previous check, so a run logged every
10 steps is judged on the same clock as one logged every step; a streak also needs two checks (when the
setting is above 1) so one outlier point never opens or closes an episode. Rules whose
``persistence`` is ``"points"`` (audits, NaN) count checks instead. Points a rule has
no opinion on (signal absent or non-finite) change nothing. Severity only rises within an episode: an
escalation (info -> warning -> critical) updates the open finding returned by ``firing()``, is inherited
by the resolved finding, and is returned again as a ``"firing"`` finding of the same episode (same onset,
``evidence["escalated_from"]`` = the previous severity), so whoever prints or pages sees it get worse. Each call is O(number of metrics + rules).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import dynamics_rules as _dynamics_rules  # noqa: F401  (registers the built-in rules)
from . import event_rules as _event_rules  # noqa: F401
from . import mismatch_rules as _mismatch_rules  # noqa: F401
from . import outcome_rules as _outcome_rules  # noqa: F401
from . import rules as _update_rules  # noqa: F401
from . import stability_rules as _stability_rules  # noqa: F401
from . import start_rules as _start_rules  # noqa: F401
from . import trend_rules as _trend_rules  # noqa: F401
from .findings import (
    CORROBORATED_BY,
    FIRING,
    IDLE,
    RESOLVED,
    Check,
    Finding,
    HealthError,
    Severity,
    decode_floats,
    encode_floats,
)
from .incidents import IncidentSettings, IncidentTracker, IncidentUpdate
from .registry import RULES, Rule, resolve_settings
from .runconfig import flatten_config
from .signals import Signal, signal_plan, to_float

# a policy's mean token entropy is never exactly 0: a run that logs 0.0 from its first point has no
# entropy measurement (a loop that hard-codes the value when it does not compute it)
_ENTROPY = Signal.ENTROPY.value

STATE_VERSION = 1
_PLANS_MAX = 64  # sets of raw names a monitor remembers the signal plan of (a trainer sends one or a few)


@dataclass
class _Episode:
    """Time hysteresis of one rule: streak counters and the open finding, if any."""

    active_streak: int = 0  # checks in the current active streak
    clear_streak: int = 0  # checks in the current inactive streak of an open episode
    streak_onset: int | None = None
    active_steps: int = 0  # steps the active streak covers
    clear_steps: int = 0  # steps the inactive streak covers
    prev_step: int | None = None  # step of the rule's previous check
    open: Finding | None = None

    def covered(self, step: int) -> int:
        """Steps this check covers: since the previous check (1 for the first; 0 for a repeat step)."""
        covered = 1 if self.prev_step is None else max(0, step - self.prev_step)
        self.prev_step = step if self.prev_step is None else max(self.prev_step, step)
        return covered

    def state_dict(self) -> dict[str, Any]:
        return {
            "active_streak": self.active_streak,
            "clear_streak": self.clear_streak,
            "streak_onset": self.streak_onset,
            "active_steps": self.active_steps,
            "clear_steps": self.clear_steps,
            "prev_step": self.prev_step,
            "open": None if self.open is None else encode_floats(self.open.to_dict()),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _Episode:
        opened = state.get("open")
        return cls(
            active_streak=int(state.get("active_streak", 0)),
            clear_streak=int(state.get("clear_streak", 0)),
            streak_onset=state.get("streak_onset"),
            active_steps=int(state.get("active_steps", state.get("active_streak", 0))),
            clear_steps=int(state.get("clear_steps", state.get("clear_streak", 0))),
            prev_step=state.get("prev_step"),
            open=None if opened is None else Finding.from_dict(opened),
        )


class HealthMonitor:
    """Streaming health checks for one run (see the module docstring). Not thread-safe."""

    def __init__(
        self,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        run_config: Mapping[str, Any] | None = None,
        incidents: IncidentSettings | Mapping[str, Any] | None = None,
    ) -> None:
        merged = resolve_settings(settings)
        # what state_dict() persists: the overrides, normalised to plain JSON types
        self._overrides = {
            str(rule_id): {str(key): _plain_setting(merged[str(rule_id)][str(key)]) for key in values}
            for rule_id, values in (settings or {}).items()
        }
        self._config = flatten_config(run_config)
        self._settings = merged
        self._rules: dict[str, Rule] = {}
        self._episodes: dict[str, _Episode] = {}
        for rule_id, values in merged.items():
            if not values["enabled"]:
                continue
            self._rules[rule_id] = rule = RULES[rule_id](settings=values, run_config=self._config)
            self._episodes[rule_id] = _Episode()
            rule.idle = True  # no episode open yet
        self._bind()
        self.last_step: int | None = None
        # whether an entropy other than exactly 0 has been logged (until then 0.0 is a placeholder, absent)
        self.entropy_measured = False
        self.incidents = IncidentTracker(incidents)
        self._incident_updates: list[IncidentUpdate] = []

    @property
    def rules(self) -> tuple[str, ...]:
        """Ids of the enabled rules, in registration order."""
        return tuple(self._rules)

    # ------------------------------------------------------------------ feeds

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> list[Finding]:
        """One training step's scalar metrics (raw trainer names; ``None`` = absent)."""
        return self.observe_many(((step, metrics),))

    def observe_many(self, steps: Iterable[tuple[int, Mapping[str, float | None]]]) -> list[Finding]:
        """``observe`` of each ``(step, metrics)`` in turn, the findings of all of them in order: exactly
        what the calls one by one return and do (the same checks at the same steps, the same state
        after). The raw names' canonical signals are looked up once per set of names (a trainer sends
        the same names step after step), not once per step."""
        findings: list[Finding] = []
        # names -> (plan, the observers with an input among the plan's signals): when every signal of
        # the plan is finite at a step, exactly the observers the per-step isdisjoint check lets through
        plans = self._plans
        observers = self._observers
        advance = self._advance
        hold = self._hold
        idle = IDLE
        incidents = self.incidents
        updates = self._incident_updates
        for step, metrics in steps:
            step = _step(step)
            raw: dict[str, float] = {}
            for name, value in metrics.items():
                if value.__class__ is not float:  # floats (nearly every value) pass as they are
                    value = to_float(name, value)
                    if value is None:
                        continue
                raw[name] = value
            names = tuple(raw)
            planned = plans.get(names)
            if planned is None:
                if len(plans) >= _PLANS_MAX:  # names come from trainers: a full memo starts over
                    plans.clear()
                plan = signal_plan(names)
                every = {signal for signal, _ in plan}
                planned = plans[names] = (
                    plan,
                    [o for o in observers if o[3] is None or not every.isdisjoint(o[3])],
                )
            plan, called = planned
            signals: dict[str, float] = {}
            for signal, name in plan:
                value = raw[name]
                if value - value == 0.0:  # finite (inf - inf and nan - nan are nan)
                    if value == 0.0 and signal == _ENTROPY and not self.entropy_measured:
                        continue  # no entropy measured yet: a logged 0.0 is a placeholder
                    signals[signal] = value
            if not self.entropy_measured and _ENTROPY in signals:
                self.entropy_measured = True
            present = signals.keys()
            if len(signals) < len(plan):  # a non-finite value: the observers with a finite input
                called = [o for o in observers if o[3] is None or not present.isdisjoint(o[3])]
            found: list[Finding] = []
            for rule_id, rule, observe, _, counts_steps, episode in called:
                check = observe(step, signals, raw)
                if check is None:
                    continue
                # the common case, healthy and quiet (IDLE: inactive, and only returned while no episode
                # is open): what _advance does for it, without the call
                if check is idle or (not check.active and episode.open is None):
                    if counts_steps:
                        prev = episode.prev_step
                        episode.prev_step = step if prev is None or step > prev else prev
                    episode.active_streak = episode.active_steps = 0
                    episode.streak_onset = None
                    continue
                finding = advance(rule_id, rule, step, check)
                hold(rule_id, rule, episode)
                if finding is not None:
                    found.append(finding)
            last = self.last_step
            self.last_step = step if last is None or step > last else last
            updates.extend(incidents.observe(step, signals, found))
            findings.extend(found)
        return findings

    def observe_groups(self, step: int, diagnostics: Mapping[str, Any]) -> list[Finding]:
        """GRPO group diagnostics of one batch (``zero_std_frac``, ``all_max_frac``, ``all_min_frac``,
        ``n_groups``, ...; an object with ``to_dict()`` works too)."""
        step = _step(step)
        if hasattr(diagnostics, "to_dict"):
            diagnostics = diagnostics.to_dict()
        if not isinstance(diagnostics, Mapping):
            raise HealthError(
                f"observe_groups expects a mapping of diagnostics, got {type(diagnostics).__name__}"
            )
        return self._dispatch(step, lambda rule: rule.observe_groups(step, diagnostics))

    def observe_audit(self, step: int, report: Any) -> list[Finding]:
        """An audit of one micro-batch: an ``AuditReport`` or its ``to_dict()`` (``ok``, ``verdicts``,
        ``explanation``, optionally ``summary`` (the one sentence the alert carries), ``empty``, ``reported``,
        ``recomputed``, ``on_policy_gap``)."""
        step = _step(step)
        as_dict = _report_dict(report)
        return self._dispatch(step, lambda rule: rule.observe_audit(step, as_dict))

    def audit_series(self, step: int) -> list[tuple[str, int, float]]:
        """The series the rules derived from the audit of ``step`` just observed (``Rule.audit_series``:
        ``rlvitals/entropy_cov``, ``rlvitals/entropy_forecast``, ...), as ``(name, step, value)``: the
        server stores them beside the trainer's metrics."""
        rows: list[tuple[str, int, float]] = []
        for rule in self._rules.values():
            if type(rule).audit_series is not Rule.audit_series:
                rows.extend((str(name), int(at), float(value)) for name, at, value in rule.audit_series(step))
        return rows

    def chart_marks(self) -> list[dict[str, Any]]:
        """Every enabled rule's threshold lines, bands and forecasts (``Rule.chart_marks``), each with
        ``rule``, ``signal`` (the canonical signal whose panel it belongs on) and ``severity``."""
        marks: list[dict[str, Any]] = []
        for rule_id, rule in self._rules.items():
            severity = self._settings[rule_id]["severity"] or rule.severity
            for mark in rule.chart_marks():
                marks.append(
                    {"rule": rule_id, "signal": rule.signal, "severity": Severity(severity).value, **mark}
                )
        return marks

    def end_of_stream(self) -> None:
        """No more points will come (an import's end, a finished run): open incidents still held back
        (:class:`~.incidents.IncidentSettings` ``hold_steps``) are confirmed, so they are reported."""
        if self.last_step is not None:
            self._incident_updates.extend(self.incidents.confirm_open(self.last_step))

    def take_incident_updates(self) -> list[IncidentUpdate]:
        """The incident changes (:mod:`.incidents`) since the last call, oldest first."""
        updates, self._incident_updates = self._incident_updates, []
        return updates

    def firing(self) -> list[Finding]:
        """The firing findings of the episodes open now."""
        return [episode.open for episode in self._episodes.values() if episode.open is not None]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: settings, config facts, detector and episode state.
        Strict JSON (non-finite floats tagged as ``{"$float": "NaN"}``)."""
        return encode_floats(
            {
                "version": STATE_VERSION,
                "settings": self._overrides,
                "run_config": self._persisted_config(),
                "last_step": self.last_step,
                "entropy_measured": self.entropy_measured,
                "rules": {
                    rule_id: {"rule": rule.state_dict(), "episode": self._episodes[rule_id].state_dict()}
                    for rule_id, rule in self._rules.items()
                },
                "incidents": self.incidents.state_dict(),
            }
        )

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        run_config: Mapping[str, Any] | None = None,
        incidents: IncidentSettings | Mapping[str, Any] | None = None,
    ) -> HealthMonitor:
        """Rebuild a monitor from :meth:`state_dict`. ``settings``/``run_config`` default to the saved ones;
        rules no longer registered or now disabled are dropped, newly enabled ones start fresh."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise HealthError(f"unsupported health monitor state (expected version {STATE_VERSION})")
        state = decode_floats(state)
        if settings is None:  # saved settings of rules no longer registered are dropped, not an error
            settings = {k: v for k, v in (state.get("settings") or {}).items() if k in RULES}
        monitor = cls(
            settings=settings,
            run_config=state.get("run_config") if run_config is None else run_config,
            incidents=incidents,
        )
        monitor.last_step = state.get("last_step")
        monitor.entropy_measured = bool(state.get("entropy_measured", False))
        monitor.incidents = IncidentTracker.from_state(state.get("incidents"), monitor.incidents.settings)
        for rule_id, saved in (state.get("rules") or {}).items():
            rule = monitor._rules.get(rule_id)
            if rule is None:
                continue
            rule.load_state_dict(saved.get("rule") or {})
            monitor._episodes[rule_id] = _Episode.from_state(saved.get("episode") or {})
            monitor._hold(rule_id, rule, monitor._episodes[rule_id])
        monitor._bind()
        return monitor

    # ------------------------------------------------------------------ internals

    def _bind(self) -> None:
        """The hot path's table (observe_many, once per step): only the rules that override the hook,
        each with the signals it declares it needs (``Rule.inputs``) as a frozenset, whether it counts
        steps, and its episode (bound here, in __init__ and from_state, not per call); and an empty
        memo of the names seen (the plans of observe_many hold these tuples)."""
        self._observers = [
            (
                rule_id,
                rule,
                rule.observe,
                None if rule.inputs is None else frozenset(rule.inputs),
                rule.persistence == "steps",
                self._episodes[rule_id],
            )
            for rule_id, rule in self._rules.items()
            if type(rule).observe is not Rule.observe
        ]
        self._plans: dict[tuple[str, ...], tuple[tuple[tuple[str, str], ...], list]] = {}

    def _persisted_config(self) -> dict[str, Any]:
        """The run-config keys the enabled rules read (``Rule.config_keys``, prefixes ending in '.')."""
        keys = {key for rule in self._rules.values() for key in rule.config_keys}
        prefixes = tuple(key for key in keys if key.endswith("."))
        return {k: v for k, v in self._config.items() if k in keys or k.startswith(prefixes)}

    def _dispatch(self, step: int, call: Any) -> list[Finding]:
        findings: list[Finding] = []
        for rule_id, rule in self._rules.items():
            check = call(rule)
            if check is None:
                continue
            finding = self._advance(rule_id, rule, step, check)
            self._hold(rule_id, rule, self._episodes[rule_id])
            if finding is not None:
                findings.append(finding)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        if findings:
            self._incident_updates.extend(self.incidents.observe(step, {}, findings))
        return findings

    def _hold(self, rule_id: str, rule: Rule, episode: _Episode) -> None:
        """Tell ``rule`` what of its next check the monitor will read (``Rule.idle``, ``Rule.held``)."""
        opened = episode.open
        rule.idle = opened is None
        if opened is None:
            rule.held = None
        elif self._settings[rule_id]["severity"] is not None:  # a fixed severity: never escalated
            rule.held = Severity.CRITICAL
        else:  # an active check at this severity or lower leaves the episode as it is (_escalate)
            rule.held = opened.severity

    def _advance(self, rule_id: str, rule: Rule, step: int, check: Check) -> Finding | None:
        settings = self._settings[rule_id]
        episode = self._episodes[rule_id]
        covered = episode.covered(step) if rule.persistence == "steps" else 1
        if check.active:
            episode.clear_streak = episode.clear_steps = 0
            if episode.open is not None:
                was = episode.open.severity
                self._escalate(episode, settings, rule, step, check)
                now = episode.open
                if now.severity.rank > was.rank:  # announced again: it got worse
                    episode.open = replace(
                        now, step=step, evidence={**now.evidence, "escalated_from": was.value}
                    )
                    return episode.open
                return None
            if episode.active_streak == 0:
                episode.streak_onset = step
                covered = 1  # the streak starts at this step: it covers it, not the gap before it
            episode.active_streak += 1
            episode.active_steps += covered
            # a check its rule confirmed by the cause (a truncation burst the reward fell with) needs two
            least = 2 if check.evidence.get(CORROBORATED_BY) else rule.min_checks
            if not _lasted(episode.active_streak, episode.active_steps, settings["fire_after"], least):
                return None
            onset = step if episode.streak_onset is None else episode.streak_onset
            severity = settings["severity"] or check.severity or rule.severity
            episode.open = Finding(
                rule=rule_id,
                severity=Severity(severity),
                state=FIRING,
                step=step,
                onset_step=onset,
                signal=check.signal or rule.signal,
                value=check.value,
                evidence=dict(check.evidence),
                message=check.message or f"{rule_id} is firing",
                advice=check.advice or rule.advice,
            )
            episode.active_streak = episode.active_steps = 0
            return episode.open
        episode.active_streak = episode.active_steps = 0
        episode.streak_onset = None
        if episode.open is None:
            return None
        episode.clear_streak += 1
        episode.clear_steps += covered if episode.clear_streak > 1 else 1
        if not _lasted(episode.clear_streak, episode.clear_steps, settings["resolve_after"]):
            return None
        opened = episode.open
        episode.open = None
        episode.clear_streak = episode.clear_steps = 0
        evidence = dict(check.evidence)
        evidence["fired_at_step"] = opened.step
        return Finding(
            rule=rule_id,
            severity=opened.severity,
            state=RESOLVED,
            step=step,
            onset_step=opened.onset_step,
            signal=check.signal or opened.signal,
            value=check.value,
            evidence=evidence,
            message=check.message or f"{rule_id} resolved",
            advice=opened.advice,
        )

    @staticmethod
    def _escalate(
        episode: _Episode, settings: Mapping[str, Any], rule: Rule, step: int, check: Check
    ) -> None:
        """Severity only rises within an episode: the open finding (what ``firing()`` shows, and what the
        resolved finding inherits) takes the new severity, message and evidence. No new transition."""
        opened = episode.open
        if opened is None or settings["severity"] is not None:
            return
        severity = Severity(check.severity or rule.severity)
        if severity.rank <= opened.severity.rank:
            return
        evidence = dict(check.evidence)
        evidence["escalated_at_step"] = step
        episode.open = replace(
            opened,
            severity=severity,
            value=check.value,
            evidence=evidence,
            message=check.message or opened.message,
            advice=check.advice or opened.advice,
        )


def _lasted(checks: int, steps: int, needed: int, least: int = 2) -> bool:
    """A streak of ``checks`` checks covering ``steps`` steps has lasted ``needed`` steps (and, when more
    than one step is needed, at least ``least`` checks — the rule's ``min_checks``, two unless it says
    otherwise: one outlier point never decides alone)."""
    return steps >= needed and checks >= min(needed, least)


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        try:
            if float(step) != int(step):
                raise ValueError
            step = int(step)
        except (TypeError, ValueError):
            raise HealthError(f"step must be an integer, got {step!r}") from None
    return step


def _plain_setting(value: Any) -> Any:
    return value.value if isinstance(value, Severity) else value


def _report_dict(report: Any) -> dict[str, Any]:
    if isinstance(report, Mapping):
        data = dict(report)
    elif hasattr(report, "ok"):
        data = {
            name: getattr(report, name)
            for name in (
                "ok",
                "empty",
                "verdicts",
                "explanation",
                "summary",
                "reported",
                "recomputed",
                "on_policy_gap",
            )
            if hasattr(report, name)
        }
    else:
        raise HealthError(f"observe_audit expects an AuditReport or its dict, got {type(report).__name__}")
    if "ok" not in data:
        raise HealthError("observe_audit: the report has no 'ok' field")
    return data
