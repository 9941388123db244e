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
    # kl_loss_runaway's ceiling (0.5) needs three steps above it: the next point (0.42, under the
    # ceiling but above its release) does not make the jump a level
    assert _firing(rows, "kl_loss_runaway") == []
    smaller = _trl(120, kl=lambda i: 6.0 if i == 100 else 0.38 + 0.02 * (i % 3), grad_norm=lambda i: 0.6)
    assert _firing(smaller, "kl_spike") == [(505, "warning")]  # 15x


def _kl_findings(rows):
    monitor = HealthMonitor()
    found = [f for step, metrics in rows for f in monitor.observe(step, metrics)]
    return [(f.step, f.state, f.value) for f in found if f.rule == "kl_loss_runaway"]


def test_one_kl_point_over_the_ceiling_then_points_just_under_it_is_no_runaway():
    # a run whose KL sits at 0.3-0.4 (median 0.38): one point at 0.6, the next 0.48 (above the
    # release 0.4, under the ceiling 0.5), then back to its level
    level = [0.33, 0.38, 0.35, 0.4, 0.36]
    rows = _trl(200, kl=lambda i: {150: 0.6, 151: 0.48, 152: 0.45}.get(i, level[i % 5]), reward=lambda i: 0.9)
    assert _kl_findings(rows) == []


def test_a_kl_hovering_at_the_ceiling_fires_and_an_open_alert_holds_until_the_release():
    # 0.52, 0.48, 0.55, 0.47, ...: the points under the ceiling are skipped, the ones above it add up
    hover = [0.52, 0.48, 0.55, 0.47]
    rows = _trl(40, kl=lambda i: 0.3 if i < 20 else (hover[i % 4] if i < 30 else 0.3), reward=lambda i: 0.9)
    found = _kl_findings(rows)
    # fires on the second point above the ceiling (steps 105 and 115 cover the three steps), quoting
    # the highest value since the crossing; the band points keep it open until the KL falls under 0.4
    assert found[0] == (115, "firing", 0.55)
    assert [f[:2] for f in found[1:]] == [(175, "resolved")]  # 0.3 from step 155: 20 steps of it


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
