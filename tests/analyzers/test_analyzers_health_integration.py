"""HealthMonitor fed by the real analyzers: audit() reports and group_diagnostics() of GRPO batches."""

from __future__ import annotations

import json

import torch
from rlvitals.analyzers import HealthMonitor, LossConfig, audit, group_diagnostics, recompute


def _batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, length = 8, 16
    log_prob = torch.randn(batch, length, generator=generator) * 0.1 - 1.0
    return {
        "log_prob": log_prob,
        "old_log_prob": log_prob + torch.randn(batch, length, generator=generator) * 0.05,
        "advantages": torch.randn(batch, 1, generator=generator).expand(batch, length).clone(),
        "response_mask": (
            torch.arange(length)[None, :] < torch.randint(4, length, (batch, 1), generator=generator)
        ).int(),
    }


def _report(seed: int, trainer_mode: str):
    tensors = _batch(seed)
    reported = recompute(LossConfig(loss_agg_mode=trainer_mode), **tensors)
    # policy_loss is left out: audit() currently raises when a mismatching policy_loss comes without
    # ref_log_prob (its alternative search tries use_kl_loss=True) -- reported to the analyzers owner
    shown = ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
    return audit(LossConfig(), tensors, {f"actor/{k}": reported[k] for k in shown})


def test_real_audit_mismatch_fires_with_its_explanation_and_resolves_on_agreement():
    monitor = HealthMonitor()
    wrong = _report(0, "seq-mean-token-mean")
    assert not wrong.ok
    (fired,) = monitor.observe_audit(10, wrong)
    assert fired.rule == "audit_mismatch" and fired.state == "firing" and fired.signal == "pg_loss"
    assert "seq-mean-token-mean" in fired.message and "token-mean" in fired.message
    assert fired.evidence["verdicts"]["pg_loss"]["recomputed"] == wrong.recomputed["pg_loss"]
    # the dict form the service stores behaves the same, and state with it round-trips as JSON
    monitor = HealthMonitor.from_state(json.loads(json.dumps(monitor.state_dict(), allow_nan=False)))
    assert monitor.observe_audit(20, wrong.to_dict()) == []
    transitions = []
    for step in (30, 40, 50):
        report = _report(step, "token-mean")
        assert report.ok
        transitions += monitor.observe_audit(step, report)
    assert [(f.state, f.step, f.onset_step) for f in transitions] == [("resolved", 50, 10)]


def _rewards(scores: list[float], length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.zeros(len(scores), length)
    rewards[:, -1] = torch.tensor(scores)
    return rewards, torch.ones(len(scores), length, dtype=torch.int64)


def test_real_group_diagnostics_split_the_cause():
    index = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    solved = group_diagnostics(*_rewards([1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1]), index)
    failed = group_diagnostics(*_rewards([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1]), index)
    healthy = group_diagnostics(*_rewards([0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]), index)
    for diagnostics, cause in ((solved, "all_solved"), (failed, "all_failed")):
        monitor = HealthMonitor()
        findings = [f for step in range(20) for f in monitor.observe_groups(step, diagnostics)]
        findings += [f for step in range(20, 140) for f in monitor.observe_groups(step, healthy)]
        assert [(f.rule, f.state) for f in findings] == [
            ("zero_advantage_groups", "firing"),
            ("zero_advantage_groups", "resolved"),
        ]
        assert findings[0].evidence["cause"] == cause
        assert findings[0].evidence["n_groups"] == 3


def test_trl_scalar_is_ignored_for_a_step_covered_by_group_diagnostics():
    index = [0, 0, 1, 1]
    healthy = group_diagnostics(*_rewards([0, 1, 1, 0]), index)
    monitor = HealthMonitor()
    findings = []
    for step in range(20):
        findings += monitor.observe_groups(step, healthy)
        findings += monitor.observe(step, {"frac_reward_zero_std": 1.0})
    assert findings == []
