"""A custom health rule: pg_loss below -10 is a warning."""

from __future__ import annotations

from types import MappingProxyType

from rlvitals.analyzers.health import Check, Rule, Severity


class PgLossFarNegative(Rule):
    signal = "pg_loss"
    severity = Severity.WARNING
    defaults = MappingProxyType({"floor": -10.0})
    fire_after = 1
    resolve_after = 2
    summary = "pg_loss far below zero"
    advice = "a test plugin's rule"

    def observe(self, step, signals, metrics):
        value = signals.get("pg_loss")
        if value is None:
            return None
        floor = self.settings["floor"]
        return Check(active=value < floor, value=value, message=f"pg_loss {value:.4g} is below {floor:g}")
