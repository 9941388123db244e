"""Fast (compiled) vs reference (verl's op sequence) over every loss mode x agg mode x dtype x shape x
mask pattern x loss_scale_factor x IS weights x global-batch info x extreme values: a bounded,
derandomized run (the same examples every run; a failure prints its case). The long run, with
printed seeds: bench/differential.py."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from tests.analyzers.differential import cases, disagreements
from tests.support.budget import examples


# `make test-fast` draws a quarter of the examples (tests/support/budget.py)
@settings(
    max_examples=examples(400), deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(cases())
def test_fast_and_reference_paths_agree_over_the_settings_space(case) -> None:
    config, tensors = case
    assert disagreements(config, tensors) == {}, (
        config,
        {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()},
    )
