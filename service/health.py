"""Health rules on ingest: one ``HealthMonitor`` per run, its state persisted with every update.

The monitor's ``state_dict()`` is stored in ``health_states`` together with a version number in the
same transaction as the points it saw, so a restart (or another replica) continues from the same
baselines. In-process the live monitor is cached and reused while the stored version still matches;
on PostgreSQL the state row is locked (``FOR UPDATE``) for the transaction, so replicas update a run
in turn and never fork its detector state.

Rule settings, later wins: the rules file, the server's ``rules`` setting, then the run's own
``config["rlvitals"]["rules"]``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvitals.service.errors import InvalidInput
from rlvitals.service.settings import Settings
from rlvitals.service.storage import repository as repo
from sqlalchemy.orm import Session


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


@dataclass
class _Cached:
    version: int
    monitor: Any
    last_step: int | None


@dataclass
class Observation:
    """What one update did: the transitions, the episodes still open, the latest step seen."""

    findings: list
    firing: list
    last_step: int | None


class HealthEngine:
    """Runs the analyzers' HealthMonitor for every run, persisting its state each update."""

    def __init__(self, settings: Settings):
        file_rules = load_rules_file(settings.rules_file) if settings.rules_file else {}
        self.server_rules = merge_rules(file_rules, settings.rules)
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

    def forget(self, run_id: int) -> None:
        with self._lock:
            self._cache.pop(run_id, None)

    def update(
        self,
        *,
        session: Session,
        run_id: int,
        run_config: Callable[[], Mapping[str, Any]],
        observe: Callable[[Any, int | None], tuple[list, int | None]],
        now: float,
        signals: Mapping[str, float] | None = None,
    ) -> Observation | None:
        """Apply ``observe(monitor, last_step) -> (findings, new_last_step)`` to the run's monitor.

        ``last_step`` is the newest step the monitor has seen (``None`` at first); ``observe`` feeds
        only newer steps, so resent or late points never count twice.

        Returns ``None`` when the run does not exist. ``run_config`` is only called when the
        monitor must be rebuilt from the stored state.
        """
        from rlvitals.analyzers import HealthMonitor

        version = repo.health_version(session=session, run_id=run_id, lock=True)
        if version is None:
            return None
        with self._lock:
            cached = self._cache.pop(run_id, None)
        if cached is None or cached.version != version:
            row = repo.load_health_state(session=session, run_id=run_id)
            stored = json.loads(row["state"] or "{}") if row else {}
            config = run_config()
            rules = self.rules_for(config)
            if stored.get("monitor"):
                monitor = HealthMonitor.from_state(stored["monitor"], settings=rules, run_config=config)
            else:
                monitor = HealthMonitor(settings=rules, run_config=config)
            cached = _Cached(version=version, monitor=monitor, last_step=stored.get("last_step"))
        findings, cached.last_step = observe(cached.monitor, cached.last_step)
        state = json.dumps({"monitor": cached.monitor.state_dict(), "last_step": cached.last_step})
        cached.version = version + 1
        repo.save_health_state(
            session=session, run_id=run_id, version=cached.version, state=state, signals=signals, now=now
        )
        with self._lock:
            # A rollback leaves the stored version behind this one, so the next update reloads.
            self._cache[run_id] = cached
        return Observation(
            findings=findings, firing=list(cached.monitor.firing()), last_step=cached.last_step
        )
