"""Properties of HealthMonitor on arbitrary streams: never crashes, episodes alternate, state is strict JSON."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from rlvitals.analyzers import HealthMonitor
from rlvitals.analyzers.health.findings import Severity

NAMES = [
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/kl_loss",
    "actor/entropy",
    "kl",
    "frac_reward_zero_std",
    "other/metric",
]
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(min_value=-1e-2, max_value=1.0),
    st.none(),
)
points = st.lists(st.dictionaries(st.sampled_from(NAMES), values, max_size=len(NAMES)), max_size=80)
groups = st.dictionaries(
    st.sampled_from(["zero_std_frac", "all_max_frac", "all_min_frac", "n_groups"]),
    st.floats(min_value=0.0, max_value=1.0),
)


@settings(max_examples=60, deadline=None)
@given(stream=points, group=groups, cut=st.integers(min_value=0, max_value=80))
def test_any_stream_alternates_episodes_and_round_trips(stream, group, cut):
    def feed(monitor, steps):
        out = []
        for step in steps:
            out += monitor.observe(step, stream[step])
            if step % 3 == 0:
                out += monitor.observe_groups(step, group)
            if step % 5 == 0:
                out += monitor.observe_audit(step, {"ok": step % 10 == 0, "verdicts": {}, "explanation": ""})
        return out

    cut = min(cut, len(stream))
    straight = feed(HealthMonitor(), range(len(stream)))
    first = HealthMonitor()
    head = feed(first, range(cut))
    blob = json.dumps(first.state_dict(), allow_nan=False)
    tail = feed(HealthMonitor.from_state(json.loads(blob)), range(cut, len(stream)))
    assert [f.to_dict() for f in head + tail] == [f.to_dict() for f in straight] or _nan_equal(
        head + tail, straight
    )

    # firing and resolved alternate per rule; the one repeat allowed is an escalation: the open episode
    # announced again (same onset) at a strictly worse severity, naming the one it escalated from
    open_episodes: dict[str, tuple[int, Severity]] = {}
    for finding in straight:
        if finding.state == "firing":
            if finding.rule in open_episodes:
                onset, severity = open_episodes[finding.rule]
                assert finding.onset_step == onset and finding.severity.rank > severity.rank
                assert finding.evidence["escalated_from"] == severity.value
            open_episodes[finding.rule] = (finding.onset_step, finding.severity)
        else:
            assert open_episodes.pop(finding.rule)[0] == finding.onset_step
        assert finding.onset_step <= finding.step


def _nan_equal(left, right) -> bool:
    """Findings equal up to NaN != NaN."""
    dump = lambda fs: json.dumps([f.to_dict() for f in fs])  # noqa: E731  (json spells NaN the same)
    return dump(left) == dump(right)


def test_extreme_values_do_not_overflow_detectors():
    monitor = HealthMonitor()
    for step in range(100):
        big = 1e308 if step % 2 else -1e308
        monitor.observe(step, {"actor/ppo_kl": big, "actor/kl_loss": big, "actor/entropy": big})
    json.dumps(monitor.state_dict(), allow_nan=False)
    assert math.isfinite(monitor.state_dict()["rules"]["ppo_kl_drift"]["rule"]["baseline"]["center"])
