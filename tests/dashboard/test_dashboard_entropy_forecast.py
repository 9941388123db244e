"""The run page draws the entropy trajectory that the audited batches' Cov(log π, A) predicts, and the
forecast alert names the predicted step. Real server, real headless Chromium."""

from __future__ import annotations

import itertools

import torch
from rlvitals.analyzers import LossConfig, grpo_advantages, recompute
from rlvitals.analyzers.verdicts.entropy_dynamics import batch_covariance

from tests.service.batchdata import make_tensors

CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")


def _batch(step: int) -> dict[str, torch.Tensor]:
    """A GRPO batch whose confident tokens are the rewarded ones: Cov(log π, A) > 0."""
    tensors = make_tensors(8, 16, seed=step, grpo=True)
    tensors["advantages"], _ = grpo_advantages(
        tensors["token_level_rewards"], tensors["response_mask"], tensors["group_index"]
    )
    tensors["old_log_prob"] = tensors["old_log_prob"] + 0.1 * tensors["advantages"]
    tensors["log_prob"] = tensors["old_log_prob"] + 1e-3
    return tensors


def test_the_entropy_panel_draws_the_trajectory_predicted_from_the_covariance(api, tab):
    run = api.create_run("entropy-forecast-page", project="dash")
    entropy = 1.0
    for step in range(10):
        api.log(run, [{"step": step, "metrics": {"actor/entropy": entropy, "critic/score/mean": 0.5}}])
        tensors = _batch(step)
        reported = recompute(LossConfig(), **{k: tensors[k] for k in CORE})
        api.wait_audit(api.upload_batch(run, tensors, step=step, config={}, reported=reported))
        latest = entropy
        entropy -= 0.5 * batch_covariance(tensors)["cov"]
    alert = api.wait_alert(run, "entropy_forecast")
    assert "predicted to reach" in alert["message"]
    tab.open(f"/runs/{run}", ready="window.RLV && RLV.timing.allCharts && RLV.state.health")
    panel = "[...document.querySelectorAll('.panel')].find(p => p.dataset.metric === 'actor/entropy')"
    tab.wait(
        f"{panel}.querySelector('.plot').layout.shapes.some(s => String(s.name).includes(':trajectory:'))"
    )
    segments = tab.js(
        f"""() => {panel}.querySelector('.plot').layout.shapes
            .filter(s => String(s.name).includes(':trajectory:')).map(s => [s.x0, s.y0, s.x1, s.y1])"""
    )
    assert len(segments) >= 2
    assert segments[0][0] == 9 and abs(segments[0][1] - latest) < 1e-9  # from the latest entropy
    assert all(b[0] == a[2] and b[1] <= a[1] for a, b in itertools.pairwise(segments))  # falling
    forecasts = tab.js("() => RLV.marks.forecasts(RLV.state.health).map(m => [m.rule, m.step])")
    assert any(rule == "entropy_forecast" and step > 9 for rule, step in forecasts), forecasts
    tab.assert_clean()
