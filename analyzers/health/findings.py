"""Value objects of the health monitor: severities, findings, per-point checks, and the error hierarchy.

A *rule* looks at each new point and returns a :class:`Check` (is its condition active right now, and
the numbers behind that), or ``None`` when the point says nothing to it. The monitor turns the stream
of checks into :class:`Finding` transitions: one ``"firing"`` finding when an episode starts and one
``"resolved"`` finding when it ends.

Errors::

    HealthError (ValueError)
    ├── UnknownRuleError (also KeyError)   a rule id that is not registered
    ├── DuplicateRuleError                 registering an id twice
    └── SettingsError                      bad per-rule settings (unknown key, wrong type, bad range)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..contract.batch_rules import NON_FINITE, spell

FIRING = "firing"
RESOLVED = "resolved"
# the evidence key of a check its rule confirmed by the problem's cause, not by waiting (the reward fell
# with the truncation, the KL jumped with the gradient spike): its value names the corroborating signal
CORROBORATED_BY = "corroborated_by"


class HealthError(ValueError):
    """Base class of every error raised by ``rlvitals.analyzers.health``."""


class UnknownRuleError(HealthError, KeyError):
    """A rule id that is not registered; the message lists the registered ids."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRuleError(HealthError):
    """A rule id registered twice."""


class SettingsError(HealthError):
    """Invalid per-rule settings: unknown rule or key, wrong type, value out of range."""


class Severity(str, Enum):
    """How urgent a finding is: ``info`` (worth knowing, often by design; shown, not paged), ``warning``
    (look at it) or ``critical`` (the run is likely wasting compute)."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    def __str__(self) -> str:
        return self.value

    @property
    def rank(self) -> int:
        """0 info, 1 warning, 2 critical: compare severities by this."""
        return _SEVERITY_RANK[self.value]


_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True)
class Check:
    """What a rule concluded from one point.

    ``active`` says whether the rule's condition holds at this point (after the rule's own value
    hysteresis); the monitor adds time hysteresis (``fire_after`` / ``resolve_after``) and turns the
    checks into findings. ``message`` and ``advice`` are used when this check opens (or closes) an episode;
    an empty ``advice`` falls back to the rule's class-level advice.
    """

    active: bool
    value: float | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    message: str = ""
    advice: str = ""
    severity: Severity | None = None
    signal: str | None = None


# An inactive check with nothing in it: what a rule may return while its episode is closed (``Rule.idle``),
# where the monitor reads only ``active`` (read-only by convention: the monitor never changes a check)
IDLE = Check(active=False)


_HELD = {severity: Check(active=True, severity=severity) for severity in Severity}


def held(severity: Severity) -> Check:
    """An active check with only its severity in it: what a rule may return while its episode is open at
    that severity or above (``Rule.held``), where the monitor reads only ``active`` and ``severity`` (the
    message and evidence of such a check are never used). Shared, read-only like :data:`IDLE`."""
    return _HELD[severity]


@dataclass(frozen=True)
class Finding:
    """One transition of one rule's episode: ``state`` is ``"firing"`` (episode opened) or ``"resolved"``.

    ``step`` is the step of the transition, ``onset_step`` the first step of the episode (for a firing
    finding, the first step of the streak of active checks that opened it). ``evidence`` holds the numbers
    that triggered it (baseline, threshold, statistic, ...), as plain JSON types.
    """

    rule: str
    severity: Severity
    state: str
    step: int
    onset_step: int
    signal: str
    value: float | None
    evidence: dict
    message: str
    advice: str

    def to_dict(self) -> dict[str, Any]:
        """Plain-python form; non-finite floats stay floats (the service spells them on the wire)."""
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "state": self.state,
            "step": self.step,
            "onset_step": self.onset_step,
            "signal": self.signal,
            "value": self.value,
            "evidence": _plain(self.evidence),
            "message": self.message,
            "advice": self.advice,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`. ``value`` may also use the wire spellings "NaN", "Infinity",
        "-Infinity"; values tagged by :func:`encode_floats` are decoded."""
        data = decode_floats(data)
        value = data.get("value")
        return cls(
            rule=str(data["rule"]),
            severity=Severity(data["severity"]),
            state=str(data["state"]),
            step=int(data["step"]),
            onset_step=int(data["onset_step"]),
            signal=str(data["signal"]),
            value=None if value is None else _decode_float(value),
            evidence=dict(data.get("evidence") or {}),
            message=str(data.get("message", "")),
            advice=str(data.get("advice", "")),
        )


_NONFINITE_NAMES = NON_FINITE
_TAG = "$float"


def _plain(obj: Any) -> Any:
    """Deep-copy ``obj`` into plain JSON types (dict/list/str/int/float/bool/None); enums become values."""
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return float(obj)
    try:
        return float(obj)  # torch / numpy scalars
    except (TypeError, ValueError):
        return str(obj)


def encode_floats(obj: Any) -> Any:
    """Strict-JSON form of ``obj`` for persisted state: a non-finite float becomes ``{"$float": "NaN"}``
    (or "Infinity" / "-Infinity"); :func:`decode_floats` inverts it exactly."""
    cls = obj.__class__  # the plain types a state is made of first, without the ABC checks below
    if cls is float:
        return obj if obj - obj == 0.0 else {_TAG: spell(obj)}
    if cls is str or cls is int or cls is bool or obj is None:
        return obj
    if cls is dict:
        return {k if k.__class__ is str else str(k): encode_floats(v) for k, v in obj.items()}
    if cls is list:
        return [encode_floats(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_floats(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_TAG: spell(obj)}
    return obj


def decode_floats(obj: Any) -> Any:
    """Inverse of :func:`encode_floats`."""
    if isinstance(obj, Mapping):
        if len(obj) == 1 and _TAG in obj:
            return _NONFINITE_NAMES[obj[_TAG]]
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj


def _decode_float(value: Any) -> float:
    if isinstance(value, str) and value in _NONFINITE_NAMES:
        return _NONFINITE_NAMES[value]
    return float(value)
