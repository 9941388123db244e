"""HealthMonitor contract: findings shape, episodes, settings validation, registry, state round-trip."""

from __future__ import annotations

import json
import math
import random

import pytest
from rlvitals.analyzers import RULES, Finding, HealthMonitor, Severity, canonical_signals, register_rule
from rlvitals.analyzers.health import (
    Check,
    DuplicateRuleError,
    HealthError,
    Rule,
    RuleId,
    SettingsError,
    UnknownRuleError,
    unregister_rule,
)

BUILTINS = {
    "pg_clipfrac_range",
    "ppo_kl_drift",
    "pg_clipfrac_lower_high",
    "kl_loss_runaway",
    "entropy_collapse",
    "non_finite",
    "zero_advantage_groups",
    "audit_mismatch",
    "entropy_explosion",
    "response_length_collapse",
    "response_length_explosion",
    "truncation_high",
    "reward_stagnation",
    "reward_std_collapse",
    "grad_norm_spike",
    "kl_spike",
    "grad_norm_zero",
    "rollout_mismatch",
    "policy_collapse",
    "mismatch_trend",
    "reward_no_signal",
    "grad_norm_extreme",
    "entropy_forecast",
    "entropy_reward_fit",
    "reward_components_diverge",
}


def test_builtin_rule_ids_are_registered_and_enumerated():
    assert set(RULES) >= BUILTINS
    assert {member.value for member in RuleId} == BUILTINS
    assert all(isinstance(key, str) for key in RULES)


def test_unknown_rule_lookup_lists_the_registered_ids():
    with pytest.raises(UnknownRuleError) as info:
        RULES["ppo_kl_drfit"]
    message = str(info.value)
    assert "ppo_kl_drfit" in message
    for rule_id in BUILTINS:
        assert rule_id in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_duplicate_registration_raises():
    with pytest.raises(DuplicateRuleError, match="ppo_kl_drift"):

        @register_rule("ppo_kl_drift")
        class Again(Rule):
            pass

    assert RULES["ppo_kl_drift"].__name__ == "PpoKlDrift"


def test_unknown_rule_in_settings_is_a_clear_error():
    with pytest.raises(SettingsError, match=r"unknown rule 'entropy_colapse'.*entropy_collapse"):
        HealthMonitor(settings={"entropy_colapse": {"enabled": False}})


def test_unknown_setting_key_lists_valid_keys():
    with pytest.raises(SettingsError, match=r"pg_clipfrac_range.*'hi'.*high.*low"):
        HealthMonitor(settings={"pg_clipfrac_range": {"hi": 0.4}})


@pytest.mark.parametrize(
    ("settings", "pattern"),
    [
        ({"pg_clipfrac_range": {"low": "0.1"}}, r"pg_clipfrac_range\.low must be a number"),
        ({"pg_clipfrac_range": {"low": 0.4, "high": 0.3}}, r"low < high"),
        ({"entropy_collapse": {"enabled": "no"}}, r"enabled must be true or false"),
        ({"non_finite": {"severity": "fatal"}}, r"severity must be one of"),
        ({"non_finite": {"resolve_after": 0}}, r"resolve_after must be an integer >= 1"),
        ({"ppo_kl_drift": {"detector": "ewma"}}, r"detector must be one of \['cusum', 'page_hinkley'\]"),
        ({"ppo_kl_drift": {"warmup": 2.5}}, r"warmup must be an integer"),
        ({"kl_loss_runaway": {"ceiling": math.nan}}, r"ceiling must be a number"),
        ({"zero_advantage_groups": []}, r"must be a mapping"),
        ({"grad_norm_spike": {"min_calm": 11}}, r"need 2 <= min_calm <= min_points"),
        ({"grad_norm_spike": {"early_ratio": 20}}, r"need ratio <= early_ratio"),
        ({"entropy_explosion": {"excursion_ratio": 2.0}}, r"need excursion_ratio >= ratio"),
    ],
)
def test_invalid_settings_raise_settings_error(settings, pattern):
    with pytest.raises(SettingsError, match=pattern):
        HealthMonitor(settings=settings)


def test_settings_errors_are_value_errors():
    assert issubclass(SettingsError, HealthError) and issubclass(HealthError, ValueError)


def test_disabled_rule_never_runs():
    monitor = HealthMonitor(settings={"non_finite": {"enabled": False}})
    assert "non_finite" not in monitor.rules
    assert monitor.observe(0, {"actor/pg_loss": math.nan}) == []


def test_non_finite_fires_once_and_resolves_with_contract_fields():
    monitor = HealthMonitor()
    assert monitor.observe(0, {"actor/pg_loss": 0.1}) == []
    fired = monitor.observe(1, {"actor/pg_loss": math.nan, "actor/ppo_kl": math.inf, "timing/s": 1.0})
    assert len(fired) == 1
    finding = fired[0]
    assert isinstance(finding, Finding)
    assert (finding.rule, finding.state, finding.step, finding.onset_step) == ("non_finite", "firing", 1, 1)
    assert finding.severity is Severity.CRITICAL
    assert finding.evidence["non_finite"] == {"actor/pg_loss": "NaN", "actor/ppo_kl": "Infinity"}
    assert "actor/pg_loss=NaN" in finding.message and finding.advice
    assert monitor.firing() == [finding]
    # still NaN: no second firing finding for the same episode
    assert monitor.observe(2, {"actor/pg_loss": math.nan}) == []
    resolved = []
    for step in range(3, 20):
        resolved += monitor.observe(step, {"actor/pg_loss": 0.1})
    assert [(f.state, f.step, f.onset_step) for f in resolved] == [("resolved", 12, 1)]
    assert monitor.firing() == []


def test_finding_to_dict_is_plain_and_round_trips():
    monitor = HealthMonitor()
    (finding,) = monitor.observe(5, {"kl": -math.inf})
    data = finding.to_dict()
    assert data["severity"] == "critical" and data["state"] == "firing"
    assert data["signal"] == "kl_loss" and data["value"] == -math.inf
    assert set(data) == {
        "rule",
        "severity",
        "state",
        "step",
        "onset_step",
        "signal",
        "value",
        "evidence",
        "message",
        "advice",
    }
    assert Finding.from_dict(data) == finding


def test_nan_does_not_crash_detectors_and_is_skipped_by_them():
    monitor = HealthMonitor()
    for step in range(200):
        value = math.nan if step % 7 == 0 else 1e-3 * (1 + 0.1 * math.sin(step))
        monitor.observe(step, {"actor/ppo_kl": value, "actor/entropy": value * 500, "actor/kl_loss": value})
    state = monitor.state_dict()
    json.dumps(state, allow_nan=False)
    assert state["rules"]["ppo_kl_drift"]["rule"]["baseline"]["count"] == 200 - len(range(0, 200, 7))


def test_metric_values_must_be_numbers():
    monitor = HealthMonitor()
    with pytest.raises(ValueError, match="actor/ppo_kl"):
        monitor.observe(0, {"actor/ppo_kl": "high"})
    # wire spellings of non-finite numbers are accepted
    (finding,) = monitor.observe(1, {"actor/ppo_kl": "NaN"})
    assert finding.rule == "non_finite"


def test_none_values_mean_absent():
    monitor = HealthMonitor()
    assert monitor.observe(0, {"actor/ppo_kl": None}) == []
    assert canonical_signals({"actor/ppo_kl": None, "kl": 0.1}) == {"kl_loss": 0.1}


def test_state_round_trip_gives_identical_future_behaviour():
    rng = random.Random(3)
    run_config = {"actor_rollout_ref": {"actor": {"ppo_epochs": 2, "ppo_mini_batch_size": 64}}, "data": {}}
    settings = {"pg_clipfrac_range": {"high": 0.28}, "ppo_kl_drift": {"detector": "page_hinkley"}}

    def point(step: int) -> dict[str, float]:
        bad = 600 <= step < 700
        return {
            "actor/ppo_kl": (4e-3 if bad else 1e-3) * math.exp(rng.gauss(0, 0.3)),
            "actor/pg_clipfrac": (0.35 if bad else 0.18) + rng.gauss(0, 0.02),
            "actor/pg_clipfrac_lower": (0.03 if bad else 0.0) + abs(rng.gauss(0, 0.001)),
            "actor/kl_loss": 1e-3
            + 1e-5 * step * (1 + rng.gauss(0, 0.05))
            + (0.002 * (step - 600) if bad else 0.0),
            "actor/entropy": 0.6 * (0.1 if bad else 1.0) * (1 - step / 4000) * math.exp(rng.gauss(0, 0.05)),
            "actor/pg_loss": math.nan if step == 650 else rng.gauss(0, 0.1),
        }

    stream = [point(step) for step in range(900)]
    groups = [
        {"zero_std_frac": 0.8 if 600 <= s < 700 else 0.2, "all_max_frac": 0.1, "all_min_frac": 0.1}
        for s in range(900)
    ]
    audits = [
        {"ok": not (600 <= s < 700), "verdicts": {"pg_loss": {"ok": not (600 <= s < 700)}}}
        for s in range(900)
    ]

    def feed(monitor: HealthMonitor, steps: range) -> list[dict]:
        out = []
        for step in steps:
            out += monitor.observe(step, stream[step])
            out += monitor.observe_groups(step, groups[step])
            if step % 10 == 0:
                out += monitor.observe_audit(step, audits[step])
        return [f.to_dict() for f in out]

    straight = HealthMonitor(settings=settings, run_config=run_config)
    expected = feed(straight, range(900))
    assert {f["rule"] for f in expected} >= {"ppo_kl_drift", "non_finite", "audit_mismatch"}

    for cut in (300, 620, 660):
        first = HealthMonitor(settings=settings, run_config=run_config)
        before = feed(first, range(cut))
        blob = json.dumps(first.state_dict(), allow_nan=False)
        restored = HealthMonitor.from_state(json.loads(blob))
        assert restored.rules == first.rules
        assert [f.to_dict() for f in restored.firing()] == [f.to_dict() for f in first.firing()]
        after = feed(restored, range(cut, 900))
        assert json.dumps(before + after) == json.dumps(expected)
        assert restored.state_dict() == straight.state_dict()


def test_from_state_rejects_foreign_state():
    with pytest.raises(HealthError, match="unsupported health monitor state"):
        HealthMonitor.from_state({"rules": {}})


def test_from_state_with_new_settings_keeps_detector_state_but_uses_new_thresholds():
    monitor = HealthMonitor()
    for step in range(50):
        monitor.observe(step, {"actor/pg_clipfrac_lower": 0.02})
    assert [f.rule for f in monitor.firing()] == ["pg_clipfrac_lower_high"]
    restored = HealthMonitor.from_state(
        monitor.state_dict(), settings={"pg_clipfrac_lower_high": {"threshold": 0.05}}
    )
    assert [f.rule for f in restored.firing()] == ["pg_clipfrac_lower_high"]
    resolved = []
    for step in range(50, 80):
        resolved += restored.observe(step, {"actor/pg_clipfrac_lower": 0.02})
    assert [(f.rule, f.state) for f in resolved] == [("pg_clipfrac_lower_high", "resolved")]


class _GradNormHigh(Rule):
    signal = "actor/grad_norm"
    defaults = {"threshold": 10.0}  # noqa: RUF012 (written as a user would)
    fire_after = 2
    resolve_after = 3
    advice = "Lower the learning rate or tighten gradient clipping."

    def __init__(self, settings, run_config):
        super().__init__(settings, run_config)
        self.seen = 0

    def observe(self, step, signals, metrics):
        value = metrics.get("actor/grad_norm")
        if value is None or not math.isfinite(value):
            return None
        self.seen += 1
        threshold = self.settings["threshold"]
        return Check(
            active=value > threshold,
            value=value,
            evidence={"threshold": threshold, "seen": self.seen},
            message=f"grad norm {value:g} above {threshold:g}" if value > threshold else "grad norm is fine",
        )

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


@pytest.fixture
def user_rule():
    register_rule("grad_norm_high")(_GradNormHigh)
    try:
        yield _GradNormHigh
    finally:
        unregister_rule("grad_norm_high")


def test_user_registered_rule_works_like_a_builtin(user_rule):
    assert RULES["grad_norm_high"] is user_rule and user_rule.id == "grad_norm_high"
    with pytest.raises(SettingsError, match=r"grad_norm_high.*'limit'.*threshold"):
        HealthMonitor(settings={"grad_norm_high": {"limit": 3}})
    monitor = HealthMonitor(settings={"grad_norm_high": {"threshold": 5, "severity": "critical"}})
    assert "grad_norm_high" in monitor.rules
    out = []
    for step, norm in enumerate([1, 6, 1, 6, 7, 8, 1, 1, 1, 1]):
        if step == 5:
            monitor = HealthMonitor.from_state(json.loads(json.dumps(monitor.state_dict())))
        out += monitor.observe(step, {"actor/grad_norm": norm})
    assert [(f.rule, f.state, f.step, f.onset_step, f.severity) for f in out] == [
        ("grad_norm_high", "firing", 4, 3, Severity.CRITICAL),
        ("grad_norm_high", "resolved", 8, 3, Severity.CRITICAL),
    ]
    assert out[0].evidence == {"threshold": 5.0, "seen": 5}
    assert out[0].advice == "Lower the learning rate or tighten gradient clipping."
    assert out[0].signal == "actor/grad_norm"
    with pytest.raises(SettingsError):
        HealthMonitor(settings={"grad_norm_high": {"enabled": 1}})


def test_unregister_unknown_rule_raises():
    with pytest.raises(UnknownRuleError):
        unregister_rule("not_a_rule")


def test_step_must_be_an_integer():
    with pytest.raises(HealthError, match="step must be an integer"):
        HealthMonitor().observe("x", {})


def test_state_keeps_only_the_config_keys_rules_read_and_restores_single_update_mode():
    config = {
        "data": {"train_batch_size": 32, "max_prompt_length": 512, "train_files": "/data/gsm8k.parquet"},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 32, "optim": {"lr": 1e-6}},
            "model": {"path": "x"},
        },
        "trainer": {f"option_{i}": i for i in range(200)},
        "rlvitals": {"rules": {"entropy_collapse": {"enabled": False}}},
    }
    monitor = HealthMonitor(run_config=config)
    saved = monitor.state_dict()["run_config"]
    assert saved == {
        "data.train_batch_size": 32,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
        "actor_rollout_ref.actor.optim.lr": 1e-6,  # entropy_forecast shows it beside η̂
        "rlvitals.rules.entropy_collapse.enabled": False,
    }
    restored = HealthMonitor.from_state(json.loads(json.dumps(monitor.state_dict())))
    findings = [f for step in range(10) for f in restored.observe(step, {"actor/pg_clipfrac": 0.01})]
    assert [(f.rule, f.severity, f.evidence["mode"]) for f in findings] == [
        ("pg_clipfrac_range", Severity.CRITICAL, "single_update")
    ]


def test_saved_settings_of_an_unregistered_rule_are_dropped_on_restore(user_rule):
    monitor = HealthMonitor(
        settings={"grad_norm_high": {"threshold": 3.0}, "non_finite": {"resolve_after": 2}}
    )
    state = json.loads(json.dumps(monitor.state_dict()))
    assert state["settings"] == {"grad_norm_high": {"threshold": 3.0}, "non_finite": {"resolve_after": 2}}
    unregister_rule("grad_norm_high")
    try:
        restored = HealthMonitor.from_state(state)
    finally:
        register_rule("grad_norm_high")(user_rule)
    assert "grad_norm_high" not in restored.rules
    assert restored.state_dict()["settings"] == {"non_finite": {"resolve_after": 2}}


def test_settings_are_normalised_in_the_state():
    monitor = HealthMonitor(
        settings={"non_finite": {"severity": Severity.WARNING}, "ppo_kl_drift": {"h": 20}}
    )
    assert monitor.state_dict()["settings"] == {
        "non_finite": {"severity": "warning"},
        "ppo_kl_drift": {"h": 20.0},
    }
