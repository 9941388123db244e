"""Health rules: one ``HealthMonitor`` per run, its state persisted with every update.

The monitor's ``state_dict()`` and its cursor (the newest step it saw) are stored in
``health_states`` with a version number, in the same transaction as the alerts and incidents the
update raised (``service/evaluator.py`` runs it after the metric writes committed), so a restart
(or another replica) continues from the same baselines and never sees a point twice. In-process
the live monitor is cached and reused while the stored version still matches; on PostgreSQL the
state row is locked for the transaction, so replicas update a run in turn and never fork its
detector state.

Rule settings, later wins: the rules file, the server's ``rules`` setting, then the run's own
``config["rlvitals"]["rules"]``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvitals.service.errors import InvalidInput
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from sqlalchemy.engine import Connection as Session


class RulesFileError(ValueError):
    """The rules file cannot be read or has the wrong shape."""


def load_rules_file(path: Path) -> dict[str, dict[str, Any]]:
    """``{rule_id: {setting: value}}`` from a JSON or YAML file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RulesFileError(f"cannot read rules file {path}: {exc}") from exc
    try:
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError as exc:
        raise RulesFileError(f"{path}: reading YAML needs PyYAML (pip install pyyaml)") from exc
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError are ValueErrors / have messages
        raise RulesFileError(f"{path} is not valid: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError is not a ValueError
        raise RulesFileError(f"{path} is not valid: {exc}") from exc
    if data is None:
        return {}
    if isinstance(data, Mapping) and isinstance(data.get("rules"), Mapping):
        data = data["rules"]
    if not isinstance(data, Mapping) or not all(isinstance(v, Mapping) for v in data.values()):
        raise RulesFileError(f"{path}: expected a mapping of rule id -> settings mapping")
    return {str(k): dict(v) for k, v in data.items()}


def merge_rules(*layers: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for rule, values in (layer or {}).items():
            merged.setdefault(rule, {}).update(values)
    return merged


def run_rule_overrides(config: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The per-run overrides in ``config["rlvitals"]["rules"]`` (validated shape)."""
    section = (config or {}).get("rlvitals")
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise InvalidInput('config["rlvitals"] must be an object')
    rules = section.get("rules", {})
    if not isinstance(rules, Mapping) or not all(isinstance(v, Mapping) for v in rules.values()):
        raise InvalidInput('config["rlvitals"]["rules"] must map rule ids to settings objects')
    return {str(k): dict(v) for k, v in rules.items()}


class _Unread:
    """``HealthEngine.update(locked_version=...)`` not given: read the version there."""


@dataclass
class _Cached:
    version: int
    monitor: Any
    cursor: dict[str, Any]  # {"step": newest step observed, "names": metric names observed at it}
    signals: dict[str, Any] | None = None


@dataclass
class Observation:
    """What one update did: the transitions, the episodes still open, the latest step seen, and the
    incident changes (``rlvitals.analyzers.health.incidents.IncidentUpdate``)."""

    findings: list
    firing: list
    last_step: int | None
    incident_updates: list = field(default_factory=list)
    critical_open: bool = False  # an incident of the run is open and critical now


@dataclass
class Ahead:
    """The rules run on a live monitor before the transaction that stores them
    (``HealthEngine.observe_ahead``): valid while the stored version is still ``base``."""

    cached: _Cached
    base: int
    findings: list


class HealthEngine:
    """Runs the analyzers' HealthMonitor for every run and persists its state in every update's
    transaction (under a row lock on PostgreSQL); the in-process copy is reused only while the
    stored version matches."""

    def __init__(self, settings: Settings):
        file_rules = load_rules_file(settings.rules_file) if settings.rules_file else {}
        self.server_rules = merge_rules(file_rules, settings.rules)
        from rlvitals.analyzers.health.incidents import IncidentSettings

        self.incident_settings = IncidentSettings.from_mapping(settings.incidents)  # fails at start if bad
        self._cache: dict[int, _Cached] = {}
        self._lock = threading.Lock()
        self.validate(self.server_rules, {})  # fail at start on a bad rules file or setting

    def rules_for(self, run_config: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
        return merge_rules(self.server_rules, run_rule_overrides(run_config))

    def validate(self, rules: Mapping[str, Mapping[str, Any]], run_config: Mapping[str, Any]) -> None:
        """Raise the analyzers' settings error (a ValueError naming the rule/key) if rules are bad."""
        from rlvitals.analyzers import HealthMonitor

        HealthMonitor(settings=rules, run_config=run_config)

    def validate_run_config(self, config: Mapping[str, Any]) -> None:
        try:
            self.validate(self.rules_for(config), config)
        except InvalidInput:
            raise
        except ValueError as exc:
            raise InvalidInput(f"bad health rule settings in config: {exc}") from exc

    # --- cache management ------------------------------------------------------------------------
    def forget(self, run_id: int) -> None:
        """Drop the live monitor, so the next update rebuilds it from the stored state (e.g. with a
        new run config)."""
        with self._lock:
            self._cache.pop(run_id, None)

    def live_signals(self) -> dict[int, dict[str, Any]]:
        """The latest canonical signals held in memory."""
        with self._lock:
            return {run_id: dict(c.signals) for run_id, c in self._cache.items() if c.signals}

    def discard(self, run_id: int) -> None:
        """The transaction that fed this monitor failed: rebuild it from the stored state next time."""
        self.forget(run_id)

    def _save(self, session: Session, run_id: int, cached: _Cached, now: float) -> None:
        state = json.dumps({"monitor": cached.monitor.state_dict(), "cursor": cached.cursor})
        cached.version += 1
        repo.save_health_state(
            session=session,
            run_id=run_id,
            version=cached.version,
            state=state,
            signals=cached.signals,
            now=now,
        )

    def _load(self, session: Session, run_id: int, version: int, run_config) -> _Cached:
        from rlvitals.analyzers import HealthMonitor

        row = repo.load_health_state(session=session, run_id=run_id)
        stored = json.loads(row["state"] or "{}") if row else {}
        config = run_config()
        rules = self.rules_for(config)
        incidents = self.incident_settings
        if stored.get("monitor"):
            monitor = HealthMonitor.from_state(
                stored["monitor"], settings=rules, run_config=config, incidents=incidents
            )
        else:
            monitor = HealthMonitor(settings=rules, run_config=config, incidents=incidents)
        signals = dict(row["signals"] or {}) if row else None
        cursor = stored.get("cursor") or {"step": stored.get("last_step"), "names": []}
        return _Cached(version=version, monitor=monitor, cursor=cursor, signals=signals)

    # --- the update --------------------------------------------------------------------------------
    def update(
        self,
        *,
        session: Session,
        run_id: int,
        run_config: Callable[[], Mapping[str, Any]],
        observe: Callable[[Any, dict[str, Any]], tuple[list, dict[str, Any]]],
        now: float,
        signals: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None = None,
        locked_version: int | type[_Unread] | None = _Unread,
    ) -> Observation | None:
        """Apply ``observe(monitor, cursor) -> (findings, new_cursor)`` to the run's monitor.

        ``cursor`` is ``{"step": newest step the monitor has seen (None at first), "names": the
        metric names it saw at that step}``; ``observe`` feeds only newer steps and names not yet
        seen at the newest step, so resent or late points never count twice. ``signals`` (or a
        function called after ``observe`` that returns them) are merged into the stored latest
        canonical signals. Returns ``None`` when the run
        does not exist. ``run_config`` is only called when the monitor must be rebuilt. Callers whose
        transaction fails afterwards call ``discard(run_id)``. ``locked_version``: the stored
        version the caller already read under the row lock (``repo.advance_run_locked``), ``None``
        when that read found no state row; by default it is read here.
        """
        with self._lock:
            cached = self._cache.pop(run_id, None)
        if locked_version is _Unread:
            version = repo.health_version(session=session, run_id=run_id, lock=True)
        else:
            version = locked_version  # type: ignore[assignment]
        if version is None:
            return None
        if cached is None or cached.version != version:
            cached = self._load(session, run_id, version, run_config)
        findings, cached.cursor = observe(cached.monitor, cached.cursor)
        if callable(signals):
            signals = signals()
        return self._store(session, run_id, cached, findings, signals, now)

    def _store(
        self,
        session: Session,
        run_id: int,
        cached: _Cached,
        findings: list,
        signals: Mapping[str, Any] | None,
        now: float,
    ) -> Observation:
        """Merge ``signals`` into the latest canonical signals, store the advanced monitor in the
        caller's transaction, cache it again, and say what it found."""
        if signals:
            cached.signals = {**(cached.signals or {}), **signals}
        self._save(session, run_id, cached, now)
        with self._lock:
            self._cache[run_id] = cached
        return Observation(
            findings=findings,
            firing=list(cached.monitor.firing()),
            last_step=cached.cursor["step"],
            incident_updates=cached.monitor.take_incident_updates(),
            critical_open=cached.monitor.incidents.critical_open(),
        )

    # --- the rules ahead of the transaction ------------------------------------------------------
    def observe_ahead(
        self, run_id: int, observe: Callable[[Any, dict[str, Any]], tuple[list, dict[str, Any]]]
    ) -> Ahead | None:
        """``observe`` on this process's live monitor of the run, outside any transaction (so no
        database lock is held while the rules run): ``None`` when the process holds no live monitor
        of the run. The monitor leaves the cache until ``commit_ahead`` stores what it did; a caller
        that does not commit just drops the ``Ahead``, and the next update rebuilds the monitor from
        the stored state."""
        with self._lock:
            cached = self._cache.pop(run_id, None)
        if cached is None:
            return None
        base = cached.version
        findings, cached.cursor = observe(cached.monitor, cached.cursor)
        return Ahead(cached=cached, base=base, findings=findings)

    def commit_ahead(
        self, *, session: Session, run_id: int, ahead: Ahead, signals: Mapping[str, Any] | None, now: float
    ) -> Observation:
        """Store what ``observe_ahead`` did, in the caller's transaction, which found the stored
        version still at ``ahead.base`` (under the claim: nobody else evaluated the run meanwhile)."""
        return self._store(session, run_id, ahead.cached, ahead.findings, signals, now)

    # --- what the dashboard draws --------------------------------------------------------------------
    def snapshot(self, *, session: Session, run_id: int, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """The rules' chart marks (threshold lines, bands, the entropy forecast) and the latest canonical
        signals of one run, from the live monitor when this process holds it, else from the stored state."""
        from rlvitals.analyzers import HealthMonitor

        with self._lock:
            cached = self._cache.get(run_id)
            if cached is not None:
                return {
                    "marks": cached.monitor.chart_marks(),
                    "signals": dict(cached.signals or {}),
                    "step": cached.cursor.get("step"),
                }
        row = repo.load_health_state(session=session, run_id=run_id)
        stored = json.loads(row["state"] or "{}") if row else {}
        rules = self.rules_for(run_config)
        try:
            if stored.get("monitor"):
                monitor = HealthMonitor.from_state(stored["monitor"], settings=rules, run_config=run_config)
            else:
                monitor = HealthMonitor(settings=rules, run_config=run_config)
        except ValueError:  # a config that no longer validates: draw the defaults rather than fail
            monitor = HealthMonitor()
        cursor = stored.get("cursor") or {}
        return {
            "marks": monitor.chart_marks(),
            "signals": dict((row or {}).get("signals") or {}),
            "step": cursor.get("step"),
        }
