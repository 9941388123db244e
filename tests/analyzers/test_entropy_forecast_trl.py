"""The covariance forecast on a real TRL run that collapses on purpose (bench/forecast.py's quick run: the
tiny Llama of tests/support/trl_tiny.py, GRPOTrainer at lr 0.02 on a reward that pays one word, every
micro-batch captured by the rlvitals TRL integration and replayed through the server's audit): the
forecast warns before the entropy curve's own collapse alert. The lead over several runs is measured by
``python bench/forecast.py`` (docs/health-rules.md)."""

from __future__ import annotations

import math

import pytest

from bench.forecast import QUICK, QUICK_STEPS, measure

# 16 real training steps on CPU (a few seconds each on a loaded machine) plus the side env's start
pytestmark = [pytest.mark.timeout(900), pytest.mark.heavy]


def test_the_forecast_fires_before_the_entropy_collapse_alert_on_a_real_trl_run():
    (result,) = measure(QUICK, QUICK_STEPS).values()
    assert result["entropy_first"] > 2.0 and result["entropy_last"] < 0.1  # it did collapse
    assert result["collapse_step"] is not None and result["forecast_step"] is not None
    assert result["lead"] >= 3, result  # measured: 8 steps on this run (forecast 5, collapse 13)
    # the forecast fired while the entropy was still high: before the curve bent
    at_forecast = dict(result["entropy"])[result["forecast_step"]]
    assert at_forecast > 0.5 * result["entropy_first"], at_forecast
    assert math.isfinite(result["forecast_mae"]) and "predicted to reach" in result["forecast_message"]
