"""Scenario tests for the built-in health rules on realistic synthetic GRPO streams, scored like real runs.

The streams and their labels are the synthetic corpus, bench/_synthetic.py (``bench/detection.py
--synthetic`` prints its table): a healthy GRPO stream, and one scenario per incident that perturbs one
signal from ``ONSET`` on. Each is a ``RunLabels`` (its incident's kind = the rule, onset, end; or healthy)
and our ``HealthMonitor``'s alerts are scored by ``score_run``/``tally`` exactly as bench/_detection.py
scores the real-log corpus: every incident caught by its rule alone within a bounded delay, no
warning-or-worse alert anywhere else. What the scorer cannot say is asserted beside it, on the findings:
the episode fires once, back-dates its onset no earlier than the incident's, reaches its severity, says
why, and resolves within a bound after recovery.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
from rlvitals.analyzers import Finding, HealthMonitor, Severity
from rlvitals.analyzers.health.scoring import tally

from bench._synthetic import (
    HEALTHY,
    INCIDENTS,
    LENGTH,
    ONSET,
    SCENARIOS,
    STEPS,
    Point,
    SyntheticRun,
    audit_mismatch,
    groups,
    grpo_stream,
    run,
    scale,
)


@pytest.fixture(scope="module")
def corpus(synthetic_corpus) -> dict[str, SyntheticRun]:
    """Every scenario on each of its seeds (run once per process: tests/analyzers/conftest.py)."""
    return {r.id: r for r in synthetic_corpus}


def _cases(scenarios):
    return [pytest.param(s.name, seed, id=f"{s.name}-{seed}") for s in scenarios.values() for seed in s.seeds]


# ----------------------------------------------------------------------------- the corpus, scored


def test_synthetic_corpus_scores_every_incident_caught_and_no_false_alert(corpus):
    scores = [r.score() for r in corpus.values()]
    overall, per_rule = tally(scores)
    due = sum(len(r.labels.incidents) for r in corpus.values())
    assert due == sum(len(s.seeds) for s in INCIDENTS.values() if not s.healthy)
    # 27 warning-or-worse scenarios (21 of them on 3 seeds) and 4 info-by-design ones
    assert (len(INCIDENTS), due) == (31, 69)
    assert (overall.caught, overall.missed) == (due, 0)
    assert (overall.false_alerts, overall.false_on_healthy) == (0, 0)
    # every rule a scenario targets catches it, and no other rule raises a warning anywhere
    targeted = {s.rule for s in INCIDENTS.values() if not s.healthy}
    assert {rule for rule, t in per_rule.items() if t.true_alerts} == targeted
    assert all(per_rule[rule].caught for rule in targeted)


# ----------------------------------------------------------------------------- healthy runs


@pytest.mark.parametrize(("name", "seed"), _cases(HEALTHY))
def test_healthy_stream_raises_nothing(corpus, name, seed):
    synthetic = corpus[f"{name}/seed{seed}"]
    score = synthetic.score()
    assert synthetic.labels.healthy
    assert (score.false_alerts, score.info_alerts, score.ignored_alerts) == ([], [], [])
    assert synthetic.findings == []  # not even an info finding


# ----------------------------------------------------------------------------- incidents


def _describe(findings: list[Finding]) -> list[tuple]:
    return [(f.rule, f.state, f.severity.value, f.step, f.onset_step) for f in findings]


@pytest.mark.parametrize(("name", "seed"), _cases(INCIDENTS))
def test_incident_is_caught_by_its_rule_alone_and_resolves(corpus, name, seed):
    scenario = INCIDENTS[name]
    synthetic = corpus[f"{name}/seed{seed}"]
    score = synthetic.score()
    described = _describe(synthetic.findings)
    every_alert = score.true_alerts + score.false_alerts + score.ignored_alerts + score.info_alerts
    assert {a.rule for a in every_alert} == {scenario.rule}, described
    assert score.false_alerts == [] and score.ignored_alerts == [], described
    if scenario.healthy:  # info by design: labelled healthy, the info alert is the whole answer
        assert score.true_alerts == [] and len(score.info_alerts) == 1, described
        delay = score.info_alerts[0].step - ONSET
    else:
        (result,) = score.incidents
        assert result.caught and result.rules == (scenario.rule,), described
        assert score.info_alerts == [], described
        delay = result.delay
    assert 0 <= delay <= scenario.detect_within, described

    # beside the scorer: one episode (an escalation is announced again, same onset), back-dated no
    # earlier than the incident, reaching the scenario's severity, explained, resolved after recovery
    findings = synthetic.findings
    firing = [f for f in findings if f.state == "firing" and "escalated_from" not in f.evidence]
    resolved = [f for f in findings if f.state == "resolved"]
    assert len(firing) == 1 and len(resolved) == int(scenario.resolves), described
    fired = firing[0]
    assert ONSET <= fired.onset_step <= fired.step == ONSET + delay, described
    assert scenario.severity in {f.severity for f in findings if f.state == "firing"}, described
    assert fired.message and fired.advice and fired.evidence
    if not scenario.resolves:
        assert [f.rule for f in synthetic.firing] == [scenario.rule], described
        return
    closed = resolved[0]
    recovered = scenario.end + 1
    assert recovered <= closed.step <= recovered + scenario.resolve_within, described
    assert closed.onset_step == fired.onset_step
    assert closed.severity.rank >= fired.severity.rank  # severity may only escalate


def test_every_scenario_is_labelled_as_data():
    for scenario in SCENARIOS.values():
        for seed in scenario.seeds:
            labels = scenario.labels(seed)
            assert labels.run_id == f"{scenario.name}/seed{seed}" and labels.tolerance == 0
            if scenario.healthy:
                assert labels.healthy and labels.incidents == ()
            else:
                (incident,) = labels.incidents
                assert (incident.kind, incident.onset, incident.end) == (scenario.rule, ONSET, scenario.end)
                assert ONSET < scenario.end < STEPS


# ----------------------------------------------------------------------------- beside the scorer: what they say


def test_single_update_clipfrac_nonzero_means_rollout_actor_mismatch(corpus):
    findings = corpus["single_update_clipfrac_nonzero/seed7"].findings  # caught: scored above
    assert [(f.rule, f.state) for f in findings] == [
        ("pg_clipfrac_range", "firing"),
        ("pg_clipfrac_range", "resolved"),
    ]
    fired = findings[0]
    assert fired.severity is Severity.CRITICAL
    assert "mismatch" in fired.message and "old_log_prob" in fired.advice
    assert fired.evidence["mode"] == "single_update" and fired.evidence["updates_per_batch"] == 1


def test_first_nonzero_clipfrac_ends_the_single_update_inference(corpus):
    # no config and clipfrac exactly 0 so far (healthy_single_update_no_config: nothing, not even info)
    fired = corpus["single_update_inferred_clipfrac_high/seed7"].findings[0]
    assert (fired.rule, fired.state, fired.severity) == ("pg_clipfrac_range", "firing", Severity.WARNING)
    assert fired.evidence["side"] == "high"


def test_zero_advantage_advice_follows_the_cause():
    solved = run(grpo_stream(1), perturb=groups(solved=True))[0]
    failed = run(grpo_stream(1), perturb=groups(solved=False))[0]
    assert solved.evidence["cause"] == "all_solved" and "harder prompts" in solved.advice
    assert failed.evidence["cause"] == "all_failed" and "reward function" in failed.advice
    assert "all-solved" in solved.message and "all-failed" in failed.message


def test_audit_mismatch_message_carries_the_explanation():
    fired = run(grpo_stream(2), perturb=audit_mismatch)[0]
    assert "seq-mean-token-mean; config says token-mean" in fired.message
    assert fired.evidence["metrics"] == ["pg_loss"]
    assert fired.evidence["verdicts"]["pg_loss"] == {
        "reported": 2.0,
        "recomputed": 1.6,
        "abs_err": 0.4,
        "rel_err": 0.25,
    }
    assert fired.signal == "pg_loss" and fired.value == 0.25


def test_ppo_kl_drift_evidence_names_baseline_and_statistic():
    fired = run(grpo_stream(3), perturb=scale("actor/ppo_kl", 4.0))[0]
    evidence = fired.evidence
    assert evidence["conditions"] == ["drift_up"]
    assert 5e-4 < evidence["baseline"] < 2e-3
    assert evidence["statistic"] > evidence["h"] and evidence["detector"] == "cusum"
    assert "learning rate" in fired.advice and "ppo_epochs" in fired.advice


def test_page_hinkley_detector_also_catches_drift(corpus):
    findings = corpus["ppo_kl_drift_page_hinkley/seed4"].findings  # caught within 25 steps: scored above
    firing = [f for f in findings if f.state == "firing"]
    assert [f.rule for f in firing] == ["ppo_kl_drift"]
    assert firing[0].evidence["detector"] == "page_hinkley"


# ----------------------------------------------------------------------------- no flapping


def _hover(name: str, center: float, sd: float, steps: int = 1500, seed: int = 0) -> list[Finding]:
    rng = random.Random(seed)
    monitor = HealthMonitor()
    findings: list[Finding] = []
    for step in range(steps):
        findings += monitor.observe(step, {name: max(0.0, rng.gauss(center, sd))})
    return findings


@pytest.mark.parametrize(
    ("name", "center", "sd", "rule"),
    [
        ("actor/pg_clipfrac", 0.3, 0.03, "pg_clipfrac_range"),
        ("actor/pg_clipfrac", 0.1, 0.02, "pg_clipfrac_range"),
        ("actor/pg_clipfrac_lower", 0.01, 0.003, "pg_clipfrac_lower_high"),
        ("actor/ppo_kl", 0.05, 0.005, "ppo_kl_drift"),
        ("actor/kl_loss", 0.5, 0.05, "kl_loss_runaway"),
        ("frac_reward_zero_std", 0.5, 0.08, "zero_advantage_groups"),
    ],
)
@pytest.mark.parametrize("seed", (0, 1))
def test_noise_around_a_threshold_does_not_flap(name, center, sd, rule, seed):
    findings = _hover(name, center, sd, seed=seed)
    assert {f.rule for f in findings} <= {rule}
    assert len([f for f in findings if f.state == "firing"]) <= 1
    assert len([f for f in findings if f.state == "resolved"]) == 0


def test_alternating_audits_do_not_flap():
    monitor = HealthMonitor()
    findings: list[Finding] = []
    for step in range(0, 400, 10):
        ok = (step // 10) % 2 == 0
        findings += monitor.observe_audit(
            step, {"ok": ok, "verdicts": {"pg_loss": {"ok": ok}}, "explanation": "x"}
        )
    assert [(f.state, f.step) for f in findings] == [("firing", 10)]


def test_empty_batch_audit_is_ignored():
    monitor = HealthMonitor()
    assert (
        monitor.observe_audit(0, {"ok": False, "empty": True, "verdicts": {}, "explanation": "empty batch"})
        == []
    )
    assert monitor.firing() == []


# ----------------------------------------------------------------------------- severities and new levels


def test_persistent_new_ppo_kl_level_is_accepted_after_rebaseline_after_points():
    findings = run(grpo_stream(5), perturb=scale("actor/ppo_kl", 4.0), length=STEPS)
    assert [(f.rule, f.state) for f in findings] == [("ppo_kl_drift", "firing"), ("ppo_kl_drift", "resolved")]
    fired, closed = findings
    assert closed.step - fired.step >= 300  # held while the drift lasts, not quietly absorbed
    assert closed.step <= fired.step + 300 + 20 + 10
    assert "accepted as its new baseline" in closed.message


def test_kl_loss_above_ceiling_is_critical(corpus):
    findings = corpus["kl_loss_above_ceiling/seed6"].findings  # caught, critical: scored above
    assert (findings[0].rule, findings[0].state, findings[0].severity) == (
        "kl_loss_runaway",
        "firing",
        Severity.CRITICAL,
    )
    assert "ceiling" in findings[0].message


def test_entropy_below_absolute_floor_is_critical():
    def collapse(point: Point, rng: random.Random, since: int) -> None:
        point.metrics["actor/entropy"] = 0.005

    monitor = HealthMonitor()
    transitions, escalated = [], None
    for point in grpo_stream(7):
        if ONSET <= point.step < ONSET + LENGTH:
            collapse(point, random.Random(0), point.step - ONSET)
        transitions += monitor.observe(point.step, point.metrics)
        if point.step == ONSET + LENGTH - 1:
            (escalated,) = monitor.firing()
    # a drop straight below the absolute floor is critical from the first finding; one episode
    fired, closed = transitions
    assert (fired.rule, fired.state, fired.severity) == ("entropy_collapse", "firing", Severity.CRITICAL)
    assert escalated.severity is Severity.CRITICAL and escalated.step == fired.step
    assert "below the floor" in escalated.message
    assert (closed.state, closed.severity) == ("resolved", Severity.CRITICAL)
    assert fired.evidence["early_level"] > 0.4


def test_severity_setting_overrides_the_rule(corpus):
    findings = corpus["non_finite_as_warning/seed8"].findings  # caught as a warning: scored above
    assert [(f.state, f.severity, f.step) for f in findings] == [
        ("firing", Severity.WARNING, ONSET),
        ("resolved", Severity.WARNING, ONSET + 4),
    ]


def test_audit_report_object_with_multiple_failures_is_accepted():
    report = SimpleNamespace(  # the AuditReport attribute shape
        ok=False,
        empty=False,
        verdicts={
            "pg_loss": {"ok": False, "abs_err": 0.1, "rel_err": 0.05},
            "ppo_kl": {"ok": False, "abs_err": math.nan, "rel_err": math.nan},
            "pg_clipfrac": {"ok": True, "abs_err": 0.0, "rel_err": 0.0},
        },
        reported={"pg_loss": 2.1, "ppo_kl": math.nan},
        recomputed={"pg_loss": 2.0, "ppo_kl": 0.001},
        explanation="reported ppo_kl is NaN",
        on_policy_gap=0.0,
    )

    monitor = HealthMonitor()
    (fired,) = monitor.observe_audit(3, report)
    assert fired.message == (
        "reported pg_loss, ppo_kl disagree with recomputation (largest relative error 0.05, on pg_loss): "
        "reported ppo_kl is NaN"
    )
    assert fired.value == 0.05 and fired.evidence["on_policy_gap"] == 0.0
    restored = HealthMonitor.from_state(json.loads(json.dumps(monitor.state_dict(), allow_nan=False)))
    assert math.isnan(restored.firing()[0].evidence["verdicts"]["ppo_kl"]["reported"])


def test_failed_audit_without_failing_verdicts_still_fires():
    monitor = HealthMonitor()
    (fired,) = monitor.observe_audit(0, {"ok": False, "verdicts": {}, "explanation": "on-policy gap 0.3"})
    assert fired.message == "the audit failed: on-policy gap 0.3" and fired.signal == "audit"


def test_audit_alert_carries_the_report_summary_not_the_whole_explanation():
    long = "Reported pg_loss 2.1 vs recomputed 2.0. " + "The per-token terms were compared one by one. " * 15
    report = {
        "ok": False,
        "verdicts": {"pg_loss": {"ok": False, "abs_err": 0.1, "rel_err": 0.05}},
        "explanation": long,
        "summary": "1 of 3 reported metrics disagree (pg_loss): loss_agg_mode='seq-mean-token-sum' reproduces it.",
    }
    (fired,) = HealthMonitor().observe_audit(3, report)
    assert fired.message == (
        "reported pg_loss disagrees with recomputation (relative error 0.05): 1 of 3 reported metrics "
        "disagree (pg_loss): "
        "loss_agg_mode='seq-mean-token-sum' reproduces it."
    )
    assert fired.evidence["explanation"] == long and len(fired.message) < 200
    # without a summary, the explanation's first sentence
    (fired,) = HealthMonitor().observe_audit(3, {**report, "summary": ""})
    assert (
        fired.message
        == "reported pg_loss disagrees with recomputation (relative error 0.05): Reported pg_loss 2.1 vs "
        "recomputed 2.0."
    )


def test_kl_loss_ceiling_message_says_which_value_it_reads():
    monitor = HealthMonitor()
    rows = [(s, {"actor/kl_loss": 1.2 if s < 3 else 0.97}) for s in range(6)]
    findings = [f for s, m in rows for f in monitor.observe(s, m) if f.rule == "kl_loss_runaway"]
    assert findings[0].message == "kl_loss reached 1.2, above the ceiling 1"
    assert findings[0].value == 1.2  # the value the message quotes
    (still,) = [f for f in monitor.firing() if f.rule == "kl_loss_runaway"]
    assert still.message == "kl_loss reached 1.2, above the ceiling 1"  # severity unchanged
    rule = monitor._rules["kl_loss_runaway"]
    # the latest point is back under the ceiling but above its release: it says nothing either way, and
    # the open finding still quotes the value that crossed
    assert rule.observe(6, {"kl_loss": 0.97}, {}) is None
    check = rule.observe(7, {"kl_loss": 0.6}, {})  # under the release: the latch lets go
    assert not check.active and check.message == "kl_loss is creeping slowly again"
