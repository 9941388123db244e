"""The health-rule registry: a plain dict of rule classes, filled by the :func:`register_rule` decorator.

Built-in rules register themselves exactly as a user's rule would::

    from rlvitals.analyzers.health import Check, Rule, register_rule

    @register_rule("grad_norm_high")
    class GradNormHigh(Rule):
        signal = "actor/grad_norm"          # name shown on findings
        defaults = {"threshold": 10.0}      # settings keys and their defaults (types are checked)
        fire_after = 3                      # consecutive active points before firing
        resolve_after = 10                  # consecutive inactive points before resolving
        advice = "Lower the learning rate or tighten gradient clipping."

        def observe(self, step, signals, metrics):
            value = metrics.get("actor/grad_norm")
            if value is None or value != value:
                return None                 # nothing to say about this point
            return Check(active=value > self.settings["threshold"], value=value,
                         evidence={"threshold": self.settings["threshold"]},
                         message=f"grad norm {value:.3g} above {self.settings['threshold']:.3g}")

Every rule also accepts the common settings ``enabled`` (bool), ``severity`` ("info"/"warning"/"critical",
overrides the rule's own choice), ``fire_after`` and ``resolve_after`` (ints >= 1, in training steps for
rules with ``persistence = "steps"``, the default; in checks for ``"points"``).
Looking up an unknown id raises :class:`UnknownRuleError` listing the registered ids; registering an id
twice raises :class:`DuplicateRuleError`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from .findings import Check, DuplicateRuleError, SettingsError, Severity, UnknownRuleError


class RuleId(str, Enum):
    """Ids of the built-in rules (the server, the docs and the alerts use them)."""

    PG_CLIPFRAC_RANGE = "pg_clipfrac_range"
    PPO_KL_DRIFT = "ppo_kl_drift"
    PG_CLIPFRAC_LOWER_HIGH = "pg_clipfrac_lower_high"
    KL_LOSS_RUNAWAY = "kl_loss_runaway"
    ENTROPY_COLLAPSE = "entropy_collapse"
    NON_FINITE = "non_finite"
    ZERO_ADVANTAGE_GROUPS = "zero_advantage_groups"
    AUDIT_MISMATCH = "audit_mismatch"
    ENTROPY_EXPLOSION = "entropy_explosion"
    RESPONSE_LENGTH_COLLAPSE = "response_length_collapse"
    RESPONSE_LENGTH_EXPLOSION = "response_length_explosion"
    TRUNCATION_HIGH = "truncation_high"
    REWARD_STAGNATION = "reward_stagnation"
    REWARD_STD_COLLAPSE = "reward_std_collapse"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    KL_SPIKE = "kl_spike"
    GRAD_NORM_ZERO = "grad_norm_zero"
    ROLLOUT_MISMATCH = "rollout_mismatch"
    POLICY_COLLAPSE = "policy_collapse"
    MISMATCH_TREND = "mismatch_trend"
    REWARD_NO_SIGNAL = "reward_no_signal"
    GRAD_NORM_EXTREME = "grad_norm_extreme"
    ENTROPY_FORECAST = "entropy_forecast"
    ENTROPY_REWARD_FIT = "entropy_reward_fit"
    REWARD_COMPONENTS_DIVERGE = "reward_components_diverge"

    def __str__(self) -> str:
        return self.value


COMMON_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"enabled": True, "severity": None, "fire_after": None, "resolve_after": None}
)


class Rule:
    """Base class of health rules. Subclass, set the class attributes, override the ``observe*`` hooks.

    A rule instance belongs to one monitor (one run). Hooks return a :class:`Check` or ``None``
    (the point says nothing to this rule). ``signals`` holds only *finite* canonical values;
    ``metrics`` is the raw mapping as floats (may hold NaN/Inf). Rules with state name its attributes in
    ``state_components`` (or override ``state_dict``/``load_state_dict``), with plain JSON types, so a
    restored rule behaves identically.
    """

    id: ClassVar[str] = ""  # set by register_rule
    signal: ClassVar[str] = ""
    severity: ClassVar[Severity] = Severity.WARNING
    defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    fire_after: ClassVar[int] = 1  # steps (or checks, with persistence "points") of activity before firing
    resolve_after: ClassVar[int] = 10
    # "steps": fire_after/resolve_after count training steps (sparse logging covers the gaps);
    # "points": they count checks (event rules: audits, NaN)
    persistence: ClassVar[str] = "steps"
    # with persistence "steps", the fewest checks a firing needs however many steps they cover (when
    # fire_after is more than one step): one outlier point never decides alone
    min_checks: ClassVar[int] = 2
    evidence_note: ClassVar[str] = ""  # the real run that motivated the rule (docs)
    summary: ClassVar[str] = ""
    advice: ClassVar[str] = ""
    # run-config keys (flattened, dotted; a trailing "." means the whole section) the rule reads; the
    # monitor persists those with its state so a restored rule sees the same config
    config_keys: ClassVar[tuple[str, ...]] = ()
    # the instance attributes that make up the rule's state, persisted in this order by the default
    # state_dict/load_state_dict (detectors, lists of plain values or pairs, plain JSON values)
    state_components: ClassVar[tuple[str, ...]] = ()
    # canonical signals ``observe`` needs at least one of: on a step that carries none of them the monitor
    # does not call it (it would return None). None (the default): called on every step
    inputs: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        self.settings = settings
        self.run_config = run_config
        # set and kept by the monitor: True while this rule has no open episode there, when the evidence and
        # message of an inactive check are never used (a rule may then return the shared IDLE check
        # instead of building them; the findings are the same). False outside a monitor: full checks
        self.idle = False
        # set and kept by the monitor: while an episode of this rule is open there, the highest severity
        # of an active check that changes nothing (the episode stays at its severity, so the check's
        # message and evidence are never used; a rule may then return ``held(severity)`` instead of
        # building them; the findings are the same). None: every active check may be used (no episode
        # open, or outside a monitor)
        self.held: Severity | None = None

    @classmethod
    def validate(cls, settings: Mapping[str, Any]) -> None:
        """Cross-field checks on the merged settings; raise :class:`SettingsError`. Default: none."""

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        return None

    def observe_groups(self, step: int, diagnostics: Mapping[str, float]) -> Check | None:
        return None

    def observe_audit(self, step: int, report: Mapping[str, Any]) -> Check | None:
        return None

    def audit_series(self, step: int) -> list[list[Any]]:
        """Series values this rule derived from the audit of ``step`` it just observed, as
        ``[name, step, value]`` (the server stores them as the run's points). Default: none."""
        return []

    def chart_marks(self) -> list[dict[str, Any]]:
        """Threshold lines and bands to draw on this rule's signal panel, with the current settings:
        ``{"kind": "line", "y": 0.05, "label": "ceiling"}``, ``{"kind": "band", "low": .., "high": ..}``,
        ``{"kind": "forecast", "step": N, "y": floor, "label": ..}``. The monitor adds rule, signal and a
        default severity. Default: none."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The attributes named in ``state_components``, in that order: a detector (anything with
        ``state_dict``) as its own state, a list copied (its list items too), anything else as it is."""
        out: dict[str, Any] = {}
        for name in self.state_components:
            value = getattr(self, name)
            if hasattr(value, "state_dict"):
                out[name] = value.state_dict()
            elif isinstance(value, list):
                out[name] = [list(v) if isinstance(v, list) else v for v in value]
            else:
                out[name] = value
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_components`` from :meth:`state_dict`'s output. A missing or empty detector state
        leaves the detector as constructed; a missing bool or int keeps its constructed value; a missing
        list restores as empty; any other missing value as None."""
        for name in self.state_components:
            current = getattr(self, name)
            saved = state.get(name)
            if hasattr(current, "load_state_dict"):
                if saved:
                    current.load_state_dict(saved)
            elif isinstance(current, list):
                setattr(self, name, [list(v) if isinstance(v, list) else v for v in saved or []])
            elif isinstance(current, bool):
                setattr(self, name, bool(saved) if name in state else current)
            elif isinstance(current, int):
                setattr(self, name, int(saved) if name in state else current)
            else:
                setattr(self, name, saved)


class _Registry(dict):
    """``dict[str, type[Rule]]`` whose missing keys raise :class:`UnknownRuleError` listing valid ids."""

    def __missing__(self, key: str) -> type[Rule]:
        raise UnknownRuleError(f"unknown health rule {key!r}; registered rules: {', '.join(sorted(self))}")


RULES: dict[str, type[Rule]] = _Registry()

R = TypeVar("R", bound=type[Rule])


def register_rule(rule_id: str) -> Callable[[R], R]:
    """Class decorator registering a :class:`Rule` subclass under ``rule_id`` (a str or :class:`RuleId`)."""
    if not isinstance(rule_id, str) or not rule_id:
        raise SettingsError(f"rule id must be a non-empty string, got {rule_id!r}")
    key = str(rule_id.value if isinstance(rule_id, Enum) else rule_id)

    def decorate(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, Rule)):
            raise TypeError(f"register_rule({key!r}) expects a Rule subclass, got {cls!r}")
        if key in RULES:
            raise DuplicateRuleError(
                f"health rule {key!r} is already registered (by {RULES[key].__qualname__})"
            )
        overlap = set(cls.defaults) & set(COMMON_DEFAULTS)
        if overlap:
            raise SettingsError(f"rule {key!r}: defaults may not redefine common settings {sorted(overlap)}")
        cls.id = key
        RULES[key] = cls
        return cls

    return decorate


def unregister_rule(rule_id: str) -> type[Rule]:
    """Remove a registered rule (tests, notebooks); unknown ids raise :class:`UnknownRuleError`."""
    cls = RULES[str(rule_id)]
    del RULES[str(rule_id)]
    return cls


# --------------------------------------------------------------------------- settings


def resolve_settings(overrides: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Validate per-rule overrides and merge them over each registered rule's defaults.

    ``overrides`` maps rule id -> {key: value}. Unknown rule ids or keys, wrong types and out-of-range
    values raise :class:`SettingsError` with the rule, the key and what is allowed.
    Returns {rule id: merged settings} for every registered rule (``fire_after``/``resolve_after``/
    ``severity`` are filled from the rule class when not overridden).
    """
    overrides = overrides or {}
    if not isinstance(overrides, Mapping):
        raise SettingsError(
            f"health settings must be a mapping of rule id -> settings, got {type(overrides).__name__}"
        )
    for rule_id, values in overrides.items():
        if rule_id not in RULES:
            raise SettingsError(
                f"health settings: unknown rule {rule_id!r}; registered rules: {', '.join(sorted(RULES))}"
            )
        if not isinstance(values, Mapping):
            raise SettingsError(
                f"health settings for {rule_id!r} must be a mapping, got {type(values).__name__}"
            )
    merged: dict[str, dict[str, Any]] = {}
    for rule_id, cls in RULES.items():
        values = dict(COMMON_DEFAULTS) | dict(cls.defaults)
        for key, value in (overrides.get(rule_id) or {}).items():
            if key not in values:
                raise SettingsError(
                    f"health settings: rule {rule_id!r} has no setting {key!r}; valid: {', '.join(sorted(values))}"
                )
            values[key] = _check_type(rule_id, key, value, COMMON_DEFAULTS.get(key, cls.defaults.get(key)))
        values["fire_after"] = values["fire_after"] or cls.fire_after
        values["resolve_after"] = values["resolve_after"] or cls.resolve_after
        cls.validate(values)
        merged[rule_id] = values
    return merged


def _check_type(rule_id: str, key: str, value: Any, default: Any) -> Any:
    where = f"health settings: {rule_id}.{key}"
    if key == "enabled" or isinstance(default, bool):
        if not isinstance(value, bool):
            raise SettingsError(f"{where} must be true or false, got {value!r}")
        return value
    if key == "severity":
        if value is None:
            return None
        try:
            return Severity(value)
        except ValueError:
            raise SettingsError(
                f"{where} must be one of {[s.value for s in Severity]}, got {value!r}"
            ) from None
    if key in ("fire_after", "resolve_after"):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise SettingsError(f"{where} must be an integer >= 1, got {value!r}")
        return int(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise SettingsError(f"{where} must be an integer, got {value!r}")
        return int(value)
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            raise SettingsError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise SettingsError(f"{where} must be a string, got {value!r}")
        return value
    return value


def require(condition: bool, rule_id: str, message: str) -> None:
    """Raise :class:`SettingsError` for rule ``rule_id`` unless ``condition`` holds (for ``Rule.validate``)."""
    if not condition:
        raise SettingsError(f"health settings: {rule_id}: {message}")
