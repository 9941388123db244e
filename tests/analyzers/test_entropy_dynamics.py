"""Cov(log π, A) from audited batches (Cui et al. 2025), the η estimator, the entropy_forecast rule that
warns before the entropy curve bends, the reward-ceiling fit, and the audit hook that carries the covariance."""

from __future__ import annotations

import itertools
import json
import math
import random

import torch
from rlvitals.analyzers import HealthMonitor, LossConfig, recompute
from rlvitals.analyzers.contract.batch import AuditBatch
from rlvitals.analyzers.contract.series import COV_SERIES, ETA_SERIES, FORECAST_SERIES
from rlvitals.analyzers.health.entropy_forecast import EntropyForecaster, reward_ceiling_fit
from rlvitals.analyzers.verdicts.batch_audit import audit_batch
from rlvitals.analyzers.verdicts.entropy_dynamics import audit_points, batch_covariance


def _tensors(batch=6, length=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).to(torch.float32)
    mask[:, 0] = 1
    return {
        "old_log_prob": -torch.rand(batch, length, generator=gen) * 3,
        "log_prob": -torch.rand(batch, length, generator=gen) * 3,
        "advantages": torch.randn(batch, length, generator=gen),
        "response_mask": mask,
        "entropy": torch.rand(batch, length, generator=gen),
    }


def test_batch_covariance_is_the_centred_covariance_over_valid_tokens():
    t = _tensors()
    got = batch_covariance(t)
    valid = t["response_mask"].bool()
    lp, adv = t["old_log_prob"][valid].double(), t["advantages"][valid].double()
    expected = float(((lp - lp.mean()) * (adv - adv.mean())).mean())
    assert math.isclose(got["cov"], expected, rel_tol=1e-12)
    assert got["tokens"] == int(valid.sum()) and got["log_prob_source"] == "old_log_prob"
    assert math.isclose(got["entropy"], float(t["entropy"][valid].double().mean()), rel_tol=1e-12)
    # garbage under the mask changes nothing; a per-sequence advantage broadcasts; no old_log_prob: log_prob
    t2 = dict(t, old_log_prob=t["old_log_prob"].masked_fill(~valid, float("nan")))
    assert batch_covariance(t2)["cov"] == got["cov"]
    seq = {k: v for k, v in t.items() if k != "old_log_prob"}
    seq["advantages"] = torch.randn(6)
    alone = batch_covariance(seq)
    lp = seq["log_prob"][valid].double()
    adv = seq["advantages"][:, None].expand_as(seq["log_prob"])[valid].double()
    assert alone["log_prob_source"] == "log_prob"
    assert math.isclose(alone["cov"], float(((lp - lp.mean()) * (adv - adv.mean())).mean()), rel_tol=1e-12)
    # confident tokens rewarded: positive covariance (entropy will fall)
    lp = torch.tensor([[-0.1, -0.2, -3.0, -4.0]])
    assert batch_covariance({"log_prob": lp, "advantages": torch.tensor([[1.0, 1.0, -1.0, -1.0]]),
                             "response_mask": torch.ones(1, 4)})["cov"] > 0  # fmt: skip
    assert batch_covariance({"log_prob": lp, "advantages": lp, "response_mask": torch.zeros(1, 4)}) is None
    assert batch_covariance({"log_prob": lp, "response_mask": torch.ones(1, 4)}) is None


def test_the_audit_record_carries_the_covariance():
    t = _tensors(seed=3)
    core = {k: t[k] for k in ("log_prob", "old_log_prob", "advantages", "response_mask")}
    batch = AuditBatch.validate(t, reported=recompute(LossConfig(), **core))
    result = audit_batch(batch).result
    assert result["ok"] is True
    assert result["entropy_dynamics"] == batch_covariance(t)


def test_eta_is_recovered_from_entropy_changes_that_follow_the_covariance():
    f = EntropyForecaster()
    rng = random.Random(0)
    h = 1.5
    for step in range(30):
        cov = 0.02 + rng.uniform(-0.01, 0.01)
        f.observe_cov(step, cov, entropy=h)
        h -= 0.5 * cov  # ΔH = −η·Cov with η = 0.5
        f.observe_entropy(step + 1, h)
    assert math.isclose(f.eta, 0.5, rel_tol=1e-9)
    assert f.rate() < 0 and f.steps_to(0.1) is not None
    restored = EntropyForecaster()
    restored.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert restored.state_dict() == f.state_dict() and restored.eta == f.eta
    # entropy moving against the covariance: no η, no forecast
    g = EntropyForecaster()
    for step in range(10):
        g.observe_cov(step, 0.02, entropy=1.0 + 0.01 * step)
        g.observe_entropy(step + 1, 1.0 + 0.01 * (step + 1))
    assert g.eta is None and g.steps_to(0.1) is None and g.trajectory(0.1, 50) == []


def _stream(cov_level, steps=140, eta=0.5, seed=0, sparse=1):
    """(step, metrics, audit) rows of a run whose entropy follows ΔH = −η·Cov (+ noise)."""
    rng = random.Random(seed)
    h, rows = 1.0, []
    for step in range(steps):
        cov = cov_level + rng.gauss(0, 0.002)
        audit = {"ok": True, "entropy_dynamics": {"cov": cov, "entropy": h, "tokens": 512}}
        rows.append((step, {"entropy": max(h, 1e-4), "reward": 0.5}, audit if step % sparse == 0 else None))
        h = max(1e-4, h - eta * cov + rng.gauss(0, 0.002))
    return rows


def _run(rows):
    monitor, found, series = HealthMonitor(), [], []
    for step, metrics, audit in rows:
        if audit is not None:
            found += monitor.observe_audit(step, audit)
            series += monitor.audit_series(step)
        found += monitor.observe(step, metrics)
    return monitor, found, series


def test_the_forecast_warns_well_before_the_entropy_curves_own_collapse_alert():
    _, found, series = _run(_stream(0.02))
    first = {f.rule: f for f in reversed(found) if f.state == "firing" and f.severity.value != "info"}
    forecast, collapse = first["entropy_forecast"], first["entropy_collapse"]
    assert forecast.step + 30 <= collapse.step, (forecast.step, collapse.step)
    assert forecast.severity.value == "warning" and forecast.signal == "entropy"
    ev = forecast.evidence
    assert abs(ev["eta"] - 0.5) < 0.1 and ev["steps_to_target"] <= 50 and ev["forecast_step"] > forecast.step
    assert "predicted to reach" in forecast.message and "Cov(log π, A)" in forecast.message
    names = {name for name, _, _ in series}
    assert names == {COV_SERIES, ETA_SERIES, FORECAST_SERIES}
    cov_steps = {at for name, at, _ in series if name == COV_SERIES}
    assert all(at - 1 in cov_steps for name, at, _ in series if name == FORECAST_SERIES)
    # one-step predictions track the entropy observed next
    entropy = {step: m["entropy"] for step, m, _ in _stream(0.02)}
    errors = [abs(v - entropy[at]) for name, at, v in series if name == FORECAST_SERIES and at in entropy]
    assert sum(errors) / len(errors) < 0.01


def test_the_trajectory_is_a_chart_mark_on_the_entropy_panel_while_it_falls():
    monitor, _, _ = _run(_stream(0.02, steps=45))
    marks = [m for m in monitor.chart_marks() if m["rule"] == "entropy_forecast"]
    kinds = {m["kind"]: m for m in marks}
    assert set(kinds) == {"trajectory", "forecast"} and all(m["signal"] == "entropy" for m in marks)
    points = kinds["trajectory"]["points"]
    assert points[0][0] == 44 and all(b[1] <= a[1] for a, b in itertools.pairwise(points))
    assert kinds["forecast"]["step"] > 44 and math.isclose(points[-1][1], kinds["forecast"]["y"])


def test_no_forecast_when_the_covariance_is_near_zero_or_negative_or_audits_are_sparse_but_steady():
    for level in (0.0, -0.01):
        _, found, _ = _run(_stream(level))
        assert [f for f in found if f.rule == "entropy_forecast"] == [], level
    # audits on one step in 5: η still estimated from the entropy metric between them; warns early
    _, found, _ = _run(_stream(0.02, sparse=5))
    fired = [f.step for f in found if f.rule == "entropy_forecast" and f.state == "firing"]
    collapse = [f.step for f in found if f.rule == "entropy_collapse" and f.severity.value != "info"]
    assert fired and collapse and fired[0] + 30 <= collapse[0]


def test_the_forecast_state_restores_and_continues_identically():
    rows = _stream(0.02)
    _, expected, _ = _run(rows)
    monitor, got = HealthMonitor(), []
    for step, metrics, audit in rows[:30]:
        if audit is not None:
            got += monitor.observe_audit(step, audit)
        got += monitor.observe(step, metrics)
    monitor = HealthMonitor.from_state(json.loads(json.dumps(monitor.state_dict())))
    for step, metrics, audit in rows[30:]:
        if audit is not None:
            got += monitor.observe_audit(step, audit)
        got += monitor.observe(step, metrics)
    assert [f.to_dict() for f in got] == [f.to_dict() for f in expected]


def test_reward_ceiling_fit_and_audit_points():
    points = [[h, -0.5 * math.exp(h) + 1.2] for h in (0.1, 0.3, 0.5, 0.8, 1.0)]
    fit = reward_ceiling_fit(points)
    assert math.isclose(fit["a"], 0.5) and math.isclose(fit["b"], 1.2) and math.isclose(fit["ceiling"], 0.7)
    assert math.isclose(fit["r2"], 1.0)
    assert reward_ceiling_fit(points[:2]) is None and reward_ceiling_fit([[0.5, 1.0]] * 4) is None
    rows = audit_points(7, [(COV_SERIES, 3, 0.1), (FORECAST_SERIES, 4, float("nan"))], now=1.0)
    assert rows == [(7, COV_SERIES, 3, 0.1, 0, 1.0)]
