"""Incidents: findings grouped on cause and time, damped, with one notification per open / escalation /
resolve (rlvitals.analyzers.health.incidents), fed by the HealthMonitor."""

from __future__ import annotations

import json
import random

import pytest
from rlvitals.analyzers import HealthMonitor
from rlvitals.analyzers.health.findings import Finding, Severity
from rlvitals.analyzers.health.incidents import IncidentSettings, IncidentTracker
from rlvitals.analyzers.health.notify import notification_for, notified_after


def _notifications(updates) -> list[tuple[int, str, str]]:
    sent, notified = [], {}
    for update in updates:
        event = notification_for(update, notified=notified.get(update.number))
        notified[update.number] = notified_after(event, update.severity, notified.get(update.number))
        if event is not None:
            sent.append((update.number, event, update.severity))
    return sent


def _replay(points, monitor: HealthMonitor | None = None):
    monitor = monitor or HealthMonitor()
    findings, updates = [], []
    for step, metrics in points:
        findings += monitor.observe(step, metrics)
        updates += monitor.take_incident_updates()
    monitor.end_of_stream()
    updates += monitor.take_incident_updates()
    return monitor, findings, updates


def _storm_points(n: int = 600, seed: int = 0):
    """One prompt per step, 8 completions: a noisy reward around 0.7, and every ~25 steps a step where every
    completion hits the length cap (reward 0, entropy doubled) that recovers the next step."""
    rng = random.Random(seed)
    points = []
    for step in range(1, n + 1):
        capped = step > 30 and step % 25 == 0
        reward = 0.0 if capped else min(1.0, max(0.25, rng.gauss(0.7, 0.08)))
        points.append(
            (
                step,
                {
                    "reward": reward,
                    "reward_std": 0.0 if capped else 0.3,
                    "entropy": (1.6 if capped else 0.5 + rng.gauss(0, 0.02)),
                    "completions/clipped_ratio": 1.0 if capped else 0.0,
                    "completions/mean_length": 512.0 if capped else 180.0 + rng.gauss(0, 10),
                    "grad_norm": 0.3 + abs(rng.gauss(0, 0.05)),
                },
            )
        )
    return points


def test_a_noisy_length_cap_storm_is_one_truncation_incident():
    _, findings, updates = _replay(_storm_points())
    collapses = [f for f in findings if f.rule == "policy_collapse" and f.state == "firing"]
    assert len(collapses) >= 10  # the alert layer's storm
    incidents = {u.number: u.incident for u in updates}
    paging = [i for i in incidents.values() if i["severity"] != "info"]
    assert [i["cause"] for i in paging] == ["truncation"]
    (incident,) = paging
    assert incident["members"]["policy_collapse"]["episodes"] == len(collapses)
    assert incident["members"]["policy_collapse"]["explained"]["explained_by"] == "length_cap"
    sent = _notifications(updates)
    assert len(sent) <= 2, sent  # opened (maybe escalated), never one per episode


def test_zero_gradient_on_tied_batches_is_an_info_zero_advantage_incident():
    # GRPO with small groups: a few consecutive batches tie on reward (std 0) and the gradient is exactly 0
    # on them and on the repeated update that follows each (no reward logged there)
    points = []
    for step in range(1, 301):
        tied = 101 <= step < 113 or 201 <= step < 211  # a batch (odd step) and its repeat
        metrics = {"grad_norm": 0.0 if tied else 0.1, "loss": 0.0, "entropy": 0.4}
        if step % 2:
            # a healthy reward moves a little from batch to batch (a constant one is reward_no_signal's)
            metrics |= {
                "reward": 0.0 if tied else 0.5 + 0.01 * (step % 7),
                "reward_std": 0.0 if tied else 0.3,
            }
        points.append((step, metrics))
    _, findings, updates = _replay(points)
    zero = [f for f in findings if f.rule == "grad_norm_zero"]
    assert zero and all(f.severity.value == "info" for f in zero)  # the rule itself reads the tie
    assert "rewards tied" in zero[0].message and zero[0].evidence["tied_share"] == 1.0
    incidents = {u.number: u.incident for u in updates}
    assert incidents and all(i["cause"] == "zero_advantage" for i in incidents.values())
    assert all(i["severity"] == "info" for i in incidents.values())
    member = next(iter(incidents.values()))["members"]["grad_norm_zero"]
    assert member["effective_severity"] == "info"
    assert member["explained"]["tied_share"] == 1.0
    assert _notifications(updates) == []


def test_zero_gradient_pages_when_the_tie_share_is_judged_too_high():
    tracker = IncidentTracker()
    for step in range(1, 20):
        tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    judge = _finding("zero_advantage_groups", "warning", 20)
    zero = _finding("grad_norm_zero", "warning", 21)
    updates = tracker.observe(20, {"grad_norm": 0.0, "reward_std": 0.0}, [judge])
    updates += tracker.observe(21, {"grad_norm": 0.0, "reward_std": 0.0}, [zero])
    for step in range(22, 60):
        updates += tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    (number,) = {u.number for u in updates}
    assert updates[-1].incident["members"]["grad_norm_zero"]["effective_severity"] == "warning"
    assert _notifications(updates) == [(number, "opened", "warning")]


def test_zero_gradient_pages_when_the_tie_share_rule_says_the_groups_are_solved():
    # tied groups on solved prompts are info for the tie-share rule; the zero gradients they cause on most
    # steps still page (the rule's judgement is there, at any severity)
    tracker = IncidentTracker()
    for step in range(1, 20):
        tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    updates = tracker.observe(
        20, {"grad_norm": 0.0, "reward_std": 0.0}, [_finding("zero_advantage_groups", "info", 20)]
    )
    updates += tracker.observe(
        21, {"grad_norm": 0.0, "reward_std": 0.0}, [_finding("grad_norm_zero", "warning", 21)]
    )
    for step in range(22, 60):
        updates += tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    assert updates[-1].incident["members"]["grad_norm_zero"]["effective_severity"] == "warning"
    assert [event for _, event, _ in _notifications(updates)] == ["opened"]


def test_sustained_zero_gradient_on_tied_batches_pages_without_a_tie_share_rule():
    # no rule judges the tie share (none logged), but the rule warns because the zeros are sustained
    tracker = IncidentTracker()
    for step in range(1, 20):
        tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    zero = _finding("grad_norm_zero", "warning", 20, evidence={"sustained": True})
    updates = tracker.observe(20, {"grad_norm": 0.0, "reward_std": 0.0}, [zero])
    for step in range(21, 60):
        updates += tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    member = updates[-1].incident["members"]["grad_norm_zero"]
    assert member["explained"]["sustained"] is True and member["effective_severity"] == "warning"
    # the same finding without the flag is what GRPO does with tied batches: info
    tracker = IncidentTracker()
    for step in range(1, 20):
        tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.0}, [])
    updates = tracker.observe(
        20, {"grad_norm": 0.0, "reward_std": 0.0}, [_finding("grad_norm_zero", "warning", 20)]
    )
    assert updates[-1].incident["members"]["grad_norm_zero"]["effective_severity"] == "info"


def test_unexplained_zero_gradient_keeps_its_own_cause():
    tracker = IncidentTracker()
    for step in range(1, 10):
        tracker.observe(step, {"grad_norm": 0.0, "reward_std": 0.4}, [])
    (update,) = tracker.observe(10, {"grad_norm": 0.0}, [_finding("grad_norm_zero", "critical", 10)])
    assert update.incident["cause"] == "no_gradient" and update.incident["severity"] == "critical"
    assert notification_for(update, notified=None) == "opened"  # critical pages at once


def test_findings_of_one_family_at_once_are_one_incident_and_severity_only_rises():
    tracker = IncidentTracker()
    updates = tracker.observe(10, {}, [_finding("truncation_high", "warning", 10)])
    updates += tracker.observe(12, {}, [_finding("entropy_explosion", "critical", 12)])
    updates += tracker.observe(13, {}, [_finding("rollout_mismatch", "warning", 13)])
    assert {u.number for u in updates} == {1}
    incident = updates[-1].incident
    assert incident["severity"] == "critical" and incident["primary"] == "entropy_explosion"
    assert set(incident["members"]) == {"truncation_high", "entropy_explosion", "rollout_mismatch"}
    assert [(f["rule"], f["step"], f["value"]) for f in incident["findings"]] == [
        ("truncation_high", 10, 1.0),
        ("entropy_explosion", 12, 1.0),
        ("rollout_mismatch", 13, 1.0),
    ]
    # a warning held back, then critical: one page, at critical
    assert _notifications(updates) == [(1, "opened", "critical")]


def test_quiet_time_before_resolve_and_reopen_within_the_window_is_the_same_incident():
    settings = IncidentSettings(hold_steps=0, hold_points=0, quiet_steps=30, quiet_points=3, reopen_steps=100)
    tracker = IncidentTracker(settings)
    updates = tracker.observe(10, {}, [_finding("grad_norm_spike", "warning", 10)])
    updates += tracker.observe(
        15, {}, [_finding("grad_norm_spike", "warning", 15, state="resolved", onset=10)]
    )
    for step in range(16, 44):  # quiet, but not for 30 steps yet
        updates += tracker.observe(step, {}, [])
    assert tracker.open_incidents()
    updates += tracker.observe(50, {}, [])
    assert not tracker.open_incidents() and updates[-1].kind == "resolved"
    updates += tracker.observe(90, {}, [_finding("grad_norm_spike", "warning", 90)])
    assert updates[-1].kind == "reopened" and updates[-1].number == 1
    assert [e for _, e, _ in _notifications(updates)] == ["opened", "resolved", "reopened"]
    updates += tracker.observe(
        300, {}, [_finding("grad_norm_spike", "warning", 300, state="resolved", onset=90)]
    )
    for step in range(301, 400):
        tracker.observe(step, {}, [])
    assert tracker.observe(500, {}, [_finding("grad_norm_spike", "warning", 500)])[0].number == 2


def test_each_reopen_doubles_the_quiet_time_so_a_flapping_series_stays_one_open_incident():
    settings = IncidentSettings(hold_steps=0, hold_points=0, quiet_steps=30, quiet_points=1, reopen_steps=500)
    tracker = IncidentTracker(settings)
    updates, resolved_after = [], []
    fire = 0
    for _ in range(4):  # fires for 5 steps, then quiet until the incident resolves, then again
        updates += tracker.observe(fire, {}, [_finding("grad_norm_spike", "warning", fire)])
        updates += tracker.observe(
            fire + 5, {}, [_finding("grad_norm_spike", "warning", fire + 5, state="resolved", onset=fire)]
        )
        step = fire + 5
        while tracker.open_incidents():
            step += 1
            updates += tracker.observe(step, {}, [])
        resolved_after.append(step - (fire + 5))
        fire = step + 10
    assert resolved_after == [30, 60, 120, 240]
    assert {u.number for u in updates} == {1}


def test_a_finding_its_rule_corroborated_by_the_cause_pages_without_the_hold():
    tracker = IncidentTracker(IncidentSettings(hold_steps=20, hold_points=2))
    plain = tracker.observe(10, {}, [_finding("grad_norm_spike", "warning", 10)])
    assert _notifications(plain) == []  # held: a flicker must last before it pages
    tracker = IncidentTracker(IncidentSettings(hold_steps=20, hold_points=2))
    moved = _finding("grad_norm_spike", "warning", 10, evidence={"corroborated_by": "kl"})
    assert _notifications(tracker.observe(10, {}, [moved])) == [(1, "opened", "warning")]


def _spike(tracker, rule: str, at: int, *, lasts: int = 20):
    """A one-point spike at ``at`` whose alert stays open ``lasts`` steps (as the spike rules keep it), on a
    run that logs every step."""
    updates = tracker.observe(at, {}, [_finding(rule, "warning", at)])
    for step in range(at + 1, at + lasts):
        updates += tracker.observe(step, {}, [])
    updates += tracker.observe(
        at + lasts, {}, [_finding(rule, "warning", at + lasts, state="resolved", onset=at)]
    )
    return updates


def test_a_spike_whose_alert_ended_within_the_hold_pages_nobody():
    tracker = IncidentTracker(IncidentSettings(hold_steps=20, hold_points=2, quiet_steps=50))
    updates = _spike(tracker, "kl_spike", 50)
    for step in range(71, 101):  # still open (quiet time), past the hold: the spike is over
        updates += tracker.observe(step, {}, [])
    updates += tracker.confirm_open(100)  # the stream ends with the incident still open
    assert tracker.open_incidents() and not tracker.open_incidents()[0]["confirmed"]
    for step in range(101, 131):
        updates += tracker.observe(step, {}, [])
    assert updates[-1].kind == "resolved"
    assert _notifications(updates) == []  # neither a late "opened" nor its all-clear


def test_a_flicker_that_comes_back_pages_once_when_it_does():
    tracker = IncidentTracker(IncidentSettings(hold_steps=20, hold_points=2, quiet_steps=50))
    updates = _spike(tracker, "kl_spike", 50)
    updates += tracker.observe(80, {}, [])
    assert _notifications(updates) == []
    updates += tracker.observe(90, {}, [_finding("grad_norm_spike", "warning", 90)])  # back, still open
    assert _notifications(updates) == [(1, "opened", "warning")] and updates[-1].step == 90
    # one that resolved quietly and comes back within reopen_steps pages too, as the same incident
    tracker = IncidentTracker(IncidentSettings(hold_steps=20, hold_points=2, quiet_steps=50))
    updates = _spike(tracker, "kl_spike", 50)
    for step in range(71, 131):
        updates += tracker.observe(step, {}, [])
    updates += tracker.observe(200, {}, [_finding("kl_spike", "warning", 200)])
    assert updates[-2].kind == "reopened" and _notifications(updates) == [(1, "opened", "warning")]


def test_a_gradient_spike_whose_clipped_update_was_outsized_pages_at_once_and_an_absorbed_one_never():
    def spike(height, run_config=None):
        rows = [(s, {"grad_norm": height if s == 160 else 0.12, "kl": 0.06}) for s in range(1, 240)]
        _, findings, updates = _replay(rows, HealthMonitor(run_config=run_config))
        assert [(f.step, f.state) for f in findings if f.rule == "grad_norm_spike"] == [
            (160, "firing"),
            (180, "resolved"),
        ]
        return [(u.step, *n) for u, n in zip(updates, _sent_per_update(updates), strict=True) if n]

    # 20x; clipped at 1.0 (the default) the step was still 8x the usual one: the weights moved
    assert spike(2.4) == [(160, 1, "opened", "warning"), (230, 1, "resolved", "warning")]
    # 60x before clipping, but every step is clipped at 0.1: a step of the usual size, over within the hold
    assert spike(7.2, {"max_grad_norm": 0.1}) == []


def _sent_per_update(updates):
    sent, notified = [], {}
    for update in updates:
        event = notification_for(update, notified=notified.get(update.number))
        notified[update.number] = notified_after(event, update.severity, notified.get(update.number))
        sent.append((update.number, event, update.severity) if event else ())
    return sent


def test_the_hold_ends_on_a_point_that_brings_a_finding_too():
    tracker = IncidentTracker(IncidentSettings(hold_steps=20, hold_points=2))
    updates = []
    for step in range(15, 35, 5):
        found = [_finding("zero_advantage_groups", "warning", 15)] if step == 15 else []
        updates += tracker.observe(step, {}, found)
    assert _notifications(updates) == []
    # the hold (20 steps) ends on the point a second rule of the family joins: announced on it
    updates += tracker.observe(35, {}, [_finding("response_length_collapse", "warning", 35)])
    assert _notifications(updates) == [(1, "opened", "warning")] and updates[-1].step == 35


def test_monitor_state_round_trip_keeps_incidents():
    points = _storm_points(300)
    _, _, expected = _replay(points)
    first = HealthMonitor()
    updates = []
    for step, metrics in points[:150]:
        first.observe(step, metrics)
        updates += first.take_incident_updates()
    restored = HealthMonitor.from_state(json.loads(json.dumps(first.state_dict())))
    _, _, rest = _replay(points[150:], restored)
    assert [(u.kind, u.step, u.incident) for u in updates + rest] == [
        (u.kind, u.step, u.incident) for u in expected
    ]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown setting"):
        IncidentSettings.from_mapping({"quiet": 3})
    with pytest.raises(ValueError):
        IncidentSettings(quiet_points=0)


def _finding(
    rule: str,
    severity: str,
    step: int,
    *,
    state: str = "firing",
    onset: int | None = None,
    evidence: dict | None = None,
) -> Finding:
    return Finding(
        rule=rule,
        severity=Severity(severity),
        state=state,
        step=step,
        onset_step=step if onset is None else onset,
        signal="x",
        value=1.0,
        evidence=evidence or {},
        message=f"{rule} {state}",
        advice="",
    )
