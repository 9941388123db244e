"""A short problem confirmed by its cause instead of a smoothed level: truncation that drags the reward
down, entropy that rises while the reward falls or the answers grow, a gradient spike the KL jumped with.
Miniatures of TRL GRPO logs (one point every 5 steps), each beside the same burst without its cause."""

from __future__ import annotations

from rlvitals.analyzers import HealthMonitor


def _firing(rows, rule):
    monitor = HealthMonitor()
    found = [f for step, metrics in rows for f in monitor.observe(step, metrics)]
    return [(f.step, f.severity.value) for f in found if f.rule == rule and f.state == "firing"]


def _trl(n, **series):
    """``n`` points logged every 5 steps; each series a function of the point's index."""
    return [(5 * (i + 1), {name: float(f(i)) for name, f in series.items()}) for i in range(n)]


def _burst(i, during, before):
    return during if 10 <= i < 12 else before  # two points: steps 55 and 60


def test_a_truncation_burst_that_drags_the_reward_fires_on_its_second_point():
    rows = _trl(
        30,
        **{
            "completions/clipped_ratio": lambda i: _burst(i, 0.5, 0.02),
            "reward": lambda i: _burst(i, 0.4, 0.85),
        },
    )
    assert _firing(rows, "truncation_high") == [(60, "warning")]


def test_the_same_truncation_burst_with_the_reward_holding_waits_for_the_median():
    rows = _trl(30, **{"completions/clipped_ratio": lambda i: _burst(i, 0.5, 0.02), "reward": lambda i: 0.85})
    assert _firing(rows, "truncation_high") == []  # two points of five: never the median


def test_entropy_rising_while_the_answers_grow_fires_on_its_second_point_before_its_median_does():
    grown = _trl(
        30,
        entropy=lambda i: 0.15 if i < 12 else 0.65,
        **{"completions/mean_length": lambda i: 180 if i < 12 else 340, "reward": lambda i: 0.9},
    )
    alone = _trl(30, entropy=lambda i: 0.15 if i < 12 else 0.65, reward=lambda i: 0.9)
    early, late = _firing(grown, "entropy_explosion"), _firing(alone, "entropy_explosion")
    assert early and late and early[0][0] == 70 and late[0][0] > early[0][0]


def test_a_spike_the_kl_jumped_with_fires_below_the_plain_spike_ratio():
    def rows(kl_at_spike):
        return [
            (s, {"grad_norm": 2.4 if s == 160 else 0.12, "kl": kl_at_spike if s == 160 else 0.06})
            for s in range(1, 200)
        ]

    def spike_of(ratio, kl_at_spike):
        return [
            (s, {"grad_norm": 0.12 * ratio if s == 160 else 0.12, "kl": kl_at_spike if s == 160 else 0.06})
            for s in range(1, 200)
        ]

    assert _firing(spike_of(16, 0.9), "grad_norm_spike") == [(160, "warning")]  # 16x, the KL 15x
    assert _firing(spike_of(16, 0.06), "grad_norm_spike") == []  # 16x alone: under lone_ratio


def test_a_lone_spike_fires_when_the_clipping_left_the_update_large():
    # 2.4 against a median of 0.12: 20x; clipped at 1.0 (the default) the update is still 8x the usual
    rows = [(s, {"grad_norm": 2.4 if s == 160 else 0.12, "kl": 0.06}) for s in range(1, 200)]
    assert _firing(rows, "grad_norm_spike") == [(160, "warning")]
    # the outsized clipped update is the spike's cause confirmed: no flicker, however short
    monitor = HealthMonitor()
    found = [f for step, metrics in rows for f in monitor.observe(step, metrics)]
    assert [f.evidence.get("corroborated_by") for f in found if f.rule == "grad_norm_spike"][:1] == ["update"]
    # every step clipped at 0.1 (the median is above it): the spike's step is the usual size
    monitor = HealthMonitor(run_config={"max_grad_norm": 0.1})
    found = [f for step, metrics in rows for f in monitor.observe(step, metrics)]
    assert [f for f in found if f.rule == "grad_norm_spike"] == []


def test_exact_zeros_stay_out_of_the_calm_median():
    # most logged points 0 (no gradient): the spike is measured against the non-zero level
    rows = [
        (s, {"grad_norm": 3.0 if s == 90 else (0.0 if s % 3 else 0.1), "kl": 0.05}) for s in range(1, 120)
    ]
    assert _firing(rows, "grad_norm_spike") == [(90, "warning")]


def test_a_one_point_kl_spike_fires_on_the_point_itself():
    # TRL-style: logged every 5 steps, kl ~0.38 with one point at 180 (470x) that the next point forgets
    rows = _trl(120, kl=lambda i: 180.0 if i == 100 else 0.38 + 0.02 * (i % 3), grad_norm=lambda i: 0.6)
    assert _firing(rows, "kl_spike") == [(505, "critical")]
    # kl_loss_runaway's ceiling (1.0) needs three steps above it: the next point (0.42, back at the
    # run's level) does not make the jump a level
    assert _firing(rows, "kl_loss_runaway") == []
    smaller = _trl(120, kl=lambda i: 6.0 if i == 100 else 0.38 + 0.02 * (i % 3), grad_norm=lambda i: 0.6)
    assert _firing(smaller, "kl_spike") == [(505, "warning")]  # 15x


def _kl_findings(rows):
    monitor = HealthMonitor()
    found = [f for step, metrics in rows for f in monitor.observe(step, metrics)]
    return [(f.step, f.state, f.value) for f in found if f.rule == "kl_loss_runaway"]


def test_one_kl_point_over_the_ceiling_then_points_just_under_it_is_no_runaway():
    # a run whose KL sits at 0.66-0.78 (median 0.76): one point at 1.2, the next 0.96 (above the
    # release 0.8, under the ceiling 1.0), then back to its level
    level = [0.66, 0.76, 0.7, 0.78, 0.72]
    rows = _trl(200, kl=lambda i: {150: 1.2, 151: 0.96, 152: 0.9}.get(i, level[i % 5]), reward=lambda i: 0.9)
    assert _kl_findings(rows) == []


def test_a_kl_hovering_at_the_ceiling_fires_and_an_open_alert_holds_until_the_release():
    # 1.04, 0.96, 1.1, 0.94, ...: the points under the ceiling are skipped, the ones above it add up
    hover = [1.04, 0.96, 1.1, 0.94]
    rows = _trl(40, kl=lambda i: 0.6 if i < 20 else (hover[i % 4] if i < 30 else 0.6), reward=lambda i: 0.9)
    found = _kl_findings(rows)
    # fires on the second point above the ceiling (steps 105 and 115 cover the three steps), quoting
    # the highest value since the crossing; the band points keep it open until the KL falls under 0.8
    assert found[0] == (115, "firing", 1.1)
    assert [f[:2] for f in found[1:]] == [(175, "resolved")]  # 0.6 from step 155: 20 steps of it


def test_a_kl_growing_from_zero_or_wandering_is_no_kl_spike():
    growing = [(s, {"kl": 0.0005 * s, "grad_norm": 0.2}) for s in range(1, 300)]
    assert _firing(growing, "kl_spike") == []
    # 6x a tiny median (0.004 -> 0.024): under both the ratio and the floor
    small = [(s, {"kl": 0.024 if s == 150 else 0.004, "grad_norm": 0.2}) for s in range(1, 300)]
    assert _firing(small, "kl_spike") == []


def test_a_kl_that_grows_from_zero_is_no_jump():
    rows = [(s, {"grad_norm": 2.4 if s == 40 else 0.15, "kl": 0.0005 * s}) for s in range(1, 120)]
    assert _firing(rows, "grad_norm_spike") == []


def test_tied_reward_steps_stay_out_of_the_calm_median():
    # GRPO with small groups: half the steps tie on reward and carry only the KL term's tiny gradient;
    # a 0.6 on a learning step is 5x the learning steps' level, not 30x a median dragged down by ties
    def point(s):
        tied = s % 2 == 0
        return {
            "grad_norm": 0.6 if s == 101 else (0.02 if tied else 0.12),
            "reward_std": 0.0 if tied else 0.2,
            "kl": 0.3 if s == 101 else 0.05,
        }

    assert _firing([(s, point(s)) for s in range(1, 150)], "grad_norm_spike") == []


def test_a_spike_in_a_run_whose_gradients_are_mostly_exact_zeros_is_measured_against_its_few_learning_steps():
    # TRL GRPO, one point every 5 steps: the groups tie on reward on most batches, so grad_norm is exactly
    # 0 on most points and only 3 of the first 20 carry a gradient (~0.2); then 17 and 47 (85x, 235x).
    # The warm-up is the run's 10 points, not 10 non-zero ones (which this run never logs)
    learning = {0: 0.19, 1: 0.21, 5: 0.23, 19: 17.0, 22: 47.0}
    rows = _trl(
        40, grad_norm=lambda i: learning.get(i, 0.0), reward_std=lambda i: 0.2 if i in learning else 0.0
    )
    assert _firing(rows, "grad_norm_spike") == [(100, "warning")]  # the second spike: the same episode
    # fewer learning steps than min_calm before the spike: still no level, no opinion
    sparse = {0: 0.19, 19: 17.0}
    rows = _trl(40, grad_norm=lambda i: sparse.get(i, 0.0), reward_std=lambda i: 0.2 if i in sparse else 0.0)
    assert _firing(rows, "grad_norm_spike") == []


def test_the_spike_warm_up_counts_logged_points_not_learning_steps_only_when_they_differ():
    # every point carries a gradient: judged after min_points points, as before (a spike of 80x, under
    # early_ratio, on the 10th point is still part of the warm-up, one on the 11th fires)
    for at, fired in ((10, []), (11, [(11, "warning")])):
        rows = [(s, {"grad_norm": 8.0 if s == at else 0.1}) for s in range(1, 40)]
        assert _firing(rows, "grad_norm_spike") == fired


def test_a_short_large_entropy_excursion_fires_on_its_second_point_and_a_single_point_does_not():
    # entropy ~0.15 at the start, drifting to ~0.4, then 0.92 and 1.33 (6x and 9x the early level, 0.8
    # and 1.2 nats above it) for two points before it settles: the median of five never gets there
    drift = [0.15, 0.13, 0.15, 0.16, 0.2, 0.25, 0.3, 0.35, 0.37, 0.3, 0.37, 0.4]
    tail = [0.42, 0.38, 0.3, 0.25, 0.25, 0.28, 0.25, 0.3]

    def excursion(*points):
        series = [*drift, *points, *tail]
        return _trl(len(series), entropy=lambda i: series[i], reward=lambda i: 0.85)

    assert _firing(excursion(0.92, 1.33), "entropy_explosion") == [(70, "warning")]
    assert _firing(excursion(0.92, 0.4), "entropy_explosion") == []  # one point: an outlier
    # two points well up but under excursion_ratio x the early level (4x): left to the median
    assert _firing(excursion(0.6, 0.65), "entropy_explosion") == []


def test_an_entropy_excursion_needs_min_rise_nats_as_well_as_the_ratio():
    # a tiny early level (0.02): 0.2 is 10x it, but 0.18 nats is no explosion
    rows = _trl(30, entropy=lambda i: 0.2 if i in (12, 13) else 0.02, reward=lambda i: 0.85)
    assert _firing(rows, "entropy_explosion") == []


def _pages(rows, settings=None):
    """The incident notifications (opened, escalated, reopened) ``rows`` send, as (step, event)."""
    from rlvitals.client.importers import Diagnoser

    from bench._detection import incident_pages

    diagnosis = Diagnoser(settings=settings).feed(rows)
    pages = incident_pages(diagnosis.incident_updates, last_step=rows[-1][0])
    return [(p.step, p.event) for p in pages if p.asks_attention]


def test_a_one_point_kl_spike_over_a_nat_pages_at_once_a_smaller_one_waits_out_the_hold():
    # kl ~0.23 with one point at 12.4 (53x) that the next point forgets, the gradient unchanged: TRL's
    # Countdown runs. Over confirm_kl (1 nat) the spike is no flicker: its incident pages on that step
    big = _trl(120, kl=lambda i: 12.4 if i == 60 else 0.22 + 0.02 * (i % 3), grad_norm=lambda i: 0.07)
    assert _firing(big, "kl_spike") == [(305, "warning")]
    assert _pages(big) == [(305, "opened")]
    # 12x at 0.5 nats: the same one-point warning pages when the hold (20 steps) ends, its alert still open
    small = _trl(120, kl=lambda i: 0.5 if i == 60 else 0.035 + 0.005 * (i % 3), grad_norm=lambda i: 0.07)
    assert _firing(small, "kl_spike") == [(305, "warning")]
    assert _pages(small) == [(325, "opened")]
    # confirm_kl 0: the big one is held like any other one-point warning
    assert _pages(big, {"kl_spike": {"confirm_kl": 0.0}}) == [(325, "opened")]
