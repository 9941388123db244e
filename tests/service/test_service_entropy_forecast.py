"""The entropy forecast end to end: each audited batch's Cov(log π, A) is stored as the run's series
(rlvitals/entropy_cov, _eta, _forecast, zero_adv_share), the entropy_forecast alert fires through the
alerts API before the entropy curve bends, and the predicted trajectory is served with the chart marks;
on SQLite and PostgreSQL."""

from __future__ import annotations

import torch
from rlvitals.analyzers import LossConfig, grpo_advantages, recompute
from rlvitals.analyzers.verdicts.entropy_dynamics import batch_covariance

from tests.service.batchdata import OCTET, make_batch, make_tensors, wait_done

CORE = ("log_prob", "old_log_prob", "advantages", "response_mask")
ETA = 0.5


def _batch(step: int) -> dict[str, torch.Tensor]:
    """A GRPO batch whose confident tokens are the rewarded ones: Cov(log π, A) > 0."""
    tensors = make_tensors(8, 16, seed=step, grpo=True)
    tensors["advantages"], _ = grpo_advantages(
        tensors["token_level_rewards"], tensors["response_mask"], tensors["group_index"]
    )
    tensors["old_log_prob"] = tensors["old_log_prob"] + 0.1 * tensors["advantages"]
    tensors["log_prob"] = tensors["old_log_prob"] + 1e-3
    return tensors


def test_audits_store_the_covariance_series_and_the_forecast_alert_fires_before_the_curve_bends(api):
    run_id = api.create_run("entropy-forecast")
    entropy = 1.0
    covs = {}
    for step in range(10):
        assert api.log(run_id, [{"step": step, "metrics": {"actor/entropy": entropy}}]).status_code == 200
        tensors = _batch(step)
        reported = recompute(LossConfig(), **{k: tensors[k] for k in CORE})
        response = api.post(
            f"/api/v1/runs/{run_id}/batches", content=make_batch(step, tensors=tensors, reported=reported),
            headers=OCTET,
        )  # fmt: skip
        assert response.status_code == 202, response.text
        assert wait_done(api, response.json()["id"])["status"] == "done"
        covs[step] = batch_covariance(tensors)["cov"]
        entropy -= ETA * covs[step]  # the entropy the next step observes: ΔH = −η·Cov

    names = "rlvitals/entropy_cov,rlvitals/entropy_eta,rlvitals/entropy_forecast,rlvitals/zero_adv_share"
    series = api.get(f"/api/v1/runs/{run_id}/metrics", params={"names": names, "max_points": 0}).json()[
        "series"
    ]
    assert series["rlvitals/entropy_cov"]["step"] == list(range(10))
    assert all(
        abs(v - covs[s]) < 1e-12
        for s, v in zip(
            series["rlvitals/entropy_cov"]["step"], series["rlvitals/entropy_cov"]["value"], strict=True
        )
    )
    assert abs(series["rlvitals/entropy_eta"]["value"][-1] - ETA) < 1e-6
    assert series["rlvitals/entropy_forecast"]["step"][-1] == 10  # the entropy predicted for the next step
    assert series["rlvitals/zero_adv_share"]["value"] == [0.0] * 10

    alerts = api.get(f"/api/v1/runs/{run_id}/alerts", params={"state": "firing"}).json()["data"]
    (forecast,) = [a for a in alerts if a["rule"] == "entropy_forecast"]
    assert forecast["severity"] == "warning" and "predicted to reach" in forecast["message"]
    assert forecast["evidence"]["forecast_step"] > forecast["first_step"]
    assert not [a for a in alerts if a["rule"] == "entropy_collapse"]  # the curve has not bent yet
    marks = api.get(f"/api/v1/runs/{run_id}/health").json()["marks"]
    trajectory = [m for m in marks if m["rule"] == "entropy_forecast" and m["kind"] == "trajectory"]
    assert trajectory and trajectory[0]["signal"] == "entropy" and len(trajectory[0]["points"]) > 2
