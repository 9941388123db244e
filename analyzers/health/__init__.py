"""Health rules and drift detectors over a run's scalar streams (pure python; O(1) per point; JSON state).

- :class:`HealthMonitor` runs every registered rule over one run and emits :class:`Finding` transitions.
- :data:`RULES` / :func:`register_rule` — the rule registry (built-ins register like user rules).
- :func:`canonical_signals` — trainer metric names (verl, TRL, OpenRLHF, bare) -> canonical signals.
- :mod:`.detectors` — robust baseline, CUSUM / Page–Hinkley, EWMA, hysteresis.

Layout: findings (value objects, errors) <- signals, detectors, runconfig <- registry <- rules
(update size), trend_rules (kl_loss, entropy), event_rules (NaN, groups, audits) <- monitor.
"""

from __future__ import annotations

from .detectors import DETECTORS, register_detector
from .findings import (
    Check,
    DuplicateRuleError,
    Finding,
    HealthError,
    SettingsError,
    Severity,
    UnknownRuleError,
)
from .monitor import HealthMonitor
from .registry import RULES, Rule, RuleId, register_rule, unregister_rule
from .runconfig import updates_per_batch
from .signals import ALIASES, Signal, canonical_signals

__all__ = [
    "ALIASES",
    "DETECTORS",
    "RULES",
    "Check",
    "DuplicateRuleError",
    "Finding",
    "HealthError",
    "HealthMonitor",
    "Rule",
    "RuleId",
    "SettingsError",
    "Severity",
    "Signal",
    "UnknownRuleError",
    "canonical_signals",
    "register_detector",
    "register_rule",
    "unregister_rule",
    "updates_per_batch",
]
