"""``HealthMonitor.observe_many`` (what the server's evaluator feeds a write's steps through) and
``observe`` (which feeds its one step through it) are exactly the per-step loop ``PerStep`` below (the
monitor's own loop before the two shared one) called step by step: the same findings in the same order, the same incident updates, the same
open episodes and the same persisted state, on every synthetic failure scenario and on randomized
streams (aliases, prefixes, absent and non-finite values, strings, ints, a step sent in several parts).
The cheaper persisted-state helpers (``_State.state_dict``, ``encode_floats``) give what the
``dataclasses.asdict`` / generic versions gave."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import asdict

import numpy as np
import pytest
from rlvitals.analyzers import HealthMonitor
from rlvitals.analyzers.health import detectors
from rlvitals.analyzers.health import monitor as monitor_module
from rlvitals.analyzers.health.findings import _TAG, Finding, Severity, encode_floats, held
from rlvitals.analyzers.health.monitor import _PLANS_MAX
from rlvitals.analyzers.health.signals import ALIASES, canonical_signals, signal_plan

from bench._synthetic import ONSET, SCENARIOS, grpo_stream


def _outcome(monitor: HealthMonitor, findings: list) -> tuple:
    return (
        [f.to_dict() for f in findings],
        [u for u in monitor.take_incident_updates()],
        [f.to_dict() for f in monitor.firing()],
        monitor.last_step,
        json.dumps(monitor.state_dict(), sort_keys=True),
    )


class PerStep(HealthMonitor):
    """The oracle: ``observe`` as it was before it went through ``observe_many``'s loop, the raw names
    mapped onto signals at every step (``canonical_signals``) and each rule's inputs checked per step."""

    def observe(self, step, metrics):
        step = monitor_module._step(step)
        raw: dict[str, float] = {}
        for name, value in metrics.items():
            if value.__class__ is not float:
                value = monitor_module.to_float(name, value)
                if value is None:
                    continue
            raw[name] = value
        signals = {name: value for name, value in canonical_signals(raw).items() if math.isfinite(value)}
        if signals.get("entropy") == 0.0 and not self.entropy_measured:
            del signals["entropy"]  # a placeholder until an entropy other than 0 is logged
        self.entropy_measured = self.entropy_measured or "entropy" in signals
        present = signals.keys()
        findings: list[Finding] = []
        episodes = self._episodes
        for rule_id, rule, observe, inputs, steps, _ in self._observers:
            if inputs is not None and present.isdisjoint(inputs):
                continue
            check = observe(step, signals, raw)
            if check is None:
                continue
            episode = episodes[rule_id]
            if not check.active and episode.open is None:
                if steps:
                    prev = episode.prev_step
                    episode.prev_step = step if prev is None or step > prev else prev
                episode.active_streak = episode.active_steps = 0
                episode.streak_onset = None
                continue
            finding = self._advance(rule_id, rule, step, check)
            self._hold(rule_id, rule, episode)
            if finding is not None:
                findings.append(finding)
        self.last_step = step if self.last_step is None or step > self.last_step else self.last_step
        self._incident_updates.extend(self.incidents.observe(step, signals, findings))
        return findings


def _one_by_one(monitor: HealthMonitor, steps) -> list:
    found = []
    for step, metrics in steps:
        found += monitor.observe(step, metrics)
    return found


def _in_chunks(monitor: HealthMonitor, steps, rng: random.Random) -> list:
    found, at = [], 0
    while at < len(steps):
        size = rng.choice((1, 2, 7, 50, 100, 333))
        found += monitor.observe_many(steps[at : at + size])
        at += size
    return found


def _both(steps, *, settings=None, run_config=None, seed=0) -> tuple[tuple, tuple]:
    one = PerStep(settings=settings, run_config=run_config)
    many = HealthMonitor(settings=settings, run_config=run_config)
    expected = _outcome(one, _one_by_one(one, steps))
    got = _outcome(many, _in_chunks(many, steps, random.Random(seed)))
    return expected, got


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_observe_many_gives_what_observe_gives_on_every_scenario(name):
    scenario = SCENARIOS[name]
    seed = scenario.seeds[0]
    rng = random.Random(10_000 + seed)
    steps = []
    for point in grpo_stream(seed, single_update=scenario.single_update, steps=1400):
        if scenario.perturb is not None and ONSET <= point.step < ONSET + scenario.length:
            scenario.perturb(point, rng, point.step - ONSET)
        steps.append((point.step, dict(point.metrics)))
    expected, got = _both(
        steps, settings=scenario.settings or None, run_config=scenario.run_config or None, seed=seed
    )
    assert got == expected


_NAMES = sorted({raw for raws in ALIASES.values() for raw in raws})


def _random_stream(seed: int, steps: int = 600) -> list[tuple[int, dict]]:
    """Random subsets of every known raw name (with and without ``train/``), unknown names, ``None``,
    non-finite values, the wire spellings of them, ints and bools, values drifting and jumping so rules
    fire and resolve, and some steps sent in two parts (the same step twice, different names)."""
    rng = random.Random(seed)
    names = [*rng.sample(_NAMES, k=min(len(_NAMES), rng.randint(8, 40))), "custom/thing", "train/other"]
    names += ["train/" + n for n in rng.sample(names[:-2], k=4)]
    level = {name: rng.uniform(0.01, 2.0) for name in names}
    out: list[tuple[int, dict]] = []
    step = 0
    for _ in range(steps):
        step += rng.choice((1, 1, 1, 1, 2, 5))
        metrics: dict = {}
        for name in names:
            if rng.random() < 0.15:
                continue
            if rng.random() < 0.02:
                level[name] *= rng.choice((0.01, 0.2, 5.0, 40.0))  # a jump: rules fire, later resolve
            roll = rng.random()
            if roll < 0.01:
                value: object = rng.choice((math.nan, math.inf, -math.inf, "NaN", "Infinity", "-Infinity"))
            elif roll < 0.02:
                value = None
            elif roll < 0.03:
                value = rng.randint(-3, 3)
            elif roll < 0.035:
                value = rng.random() < 0.5
            else:
                value = level[name] * math.exp(rng.gauss(0.0, 0.2)) * (1 if rng.random() < 0.97 else -1)
            metrics[name] = value
        if metrics and rng.random() < 0.05:  # one step in two writes
            keys = list(metrics)
            cut = rng.randint(1, len(keys))
            out.append((step, {k: metrics[k] for k in keys[:cut]}))
            out.append((step, {k: metrics[k] for k in keys[cut:]}))
        else:
            out.append((step, metrics))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_observe_many_gives_what_observe_gives_on_random_streams(seed):
    steps = _random_stream(seed)
    config = {"algorithm": random.Random(seed).choice(("grpo", "ppo", None))}
    expected, got = _both(steps, run_config=config, seed=seed)
    assert got == expected


def test_the_random_streams_make_rules_fire_and_resolve():
    """The comparison above would prove little on quiet streams."""
    states = set()
    rules = set()
    for seed in range(12):
        monitor = HealthMonitor()
        for finding in _one_by_one(monitor, _random_stream(seed)):
            states.add(finding.state)
            rules.add(finding.rule)
    assert states == {"firing", "resolved"} and len(rules) >= 5


def test_observe_many_continues_a_restored_monitor_identically():
    steps = _random_stream(99)
    one, many = PerStep(), HealthMonitor()
    _one_by_one(one, steps[:300])
    many.observe_many(steps[:300])
    many = HealthMonitor.from_state(json.loads(json.dumps(many.state_dict())))
    one_found = _one_by_one(one, steps[300:])
    assert [f.to_dict() for f in many.observe_many(steps[300:])] == [f.to_dict() for f in one_found]
    assert json.dumps(many.state_dict(), sort_keys=True) == json.dumps(one.state_dict(), sort_keys=True)


@pytest.mark.parametrize("seed", range(3))
def test_observe_gives_what_the_per_step_loop_gives_past_the_memo_of_names(seed):
    """Steps whose names differ nearly every time: the monitor's memo of name sets fills, starts over,
    and the findings and state stay the per-step loop's."""
    steps = _random_stream(seed, steps=3 * _PLANS_MAX)
    one, monitor = PerStep(), HealthMonitor()
    expected = _outcome(one, _one_by_one(one, steps))
    sizes = []
    found = []
    for step, metrics in steps:
        found += monitor.observe(step, metrics)
        sizes.append(len(monitor._plans))
    assert _outcome(monitor, found) == expected
    assert max(sizes) == _PLANS_MAX and min(sizes[_PLANS_MAX:]) < _PLANS_MAX  # full, then started over


def test_a_bad_step_is_refused_as_observe_refuses_it():
    with pytest.raises(Exception) as by_one:
        HealthMonitor().observe("x", {"actor/ppo_kl": 0.1})
    with pytest.raises(type(by_one.value)):
        HealthMonitor().observe_many([(1, {"actor/ppo_kl": 0.1}), ("x", {"actor/ppo_kl": 0.1})])


@pytest.mark.parametrize("seed", range(30))
def test_a_signal_plan_gives_the_canonical_signals(seed):
    rng = random.Random(seed)
    names = rng.sample(_NAMES, k=rng.randint(0, 30)) + rng.sample(["a", "b/c", "train/x"], k=2)
    names += ["train/" + n for n in rng.sample(_NAMES, k=5)]
    rng.shuffle(names)
    metrics = {name: rng.uniform(-1, 1) for name in names}
    planned = {signal: metrics[name] for signal, name in signal_plan(tuple(metrics))}
    assert list(planned.items()) == list(canonical_signals(metrics).items())  # same order too


# --------------------------------------------------------------------------- persisted-state helpers


def _reference_encode(obj):
    """``encode_floats`` as it was: generic isinstance checks only."""
    if isinstance(obj, Mapping):
        return {str(k): _reference_encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_reference_encode(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_TAG: {math.inf: "Infinity", -math.inf: "-Infinity"}.get(obj, "NaN")}
    return obj


def _random_state(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth < 3 and roll < 0.25:
        keys = [rng.choice(("a", "b", 1, 2.5, True, None)) for _ in range(rng.randint(0, 4))]
        return {k: _random_state(rng, depth + 1) for k in keys}
    if depth < 3 and roll < 0.45:
        items = [_random_state(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        return tuple(items) if rng.random() < 0.3 else items
    return rng.choice(
        (
            rng.uniform(-1e3, 1e3),
            math.nan,
            math.inf,
            -math.inf,
            np.float64(math.nan),
            np.float64(1.5),
            rng.randint(-5, 5),
            True,
            None,
            "NaN",
            "x",
        )
    )


@pytest.mark.parametrize("seed", range(40))
def test_encode_floats_gives_what_the_generic_version_gave(seed):
    obj = _random_state(random.Random(seed))
    got, expected = encode_floats(obj), _reference_encode(obj)
    assert json.dumps(got, sort_keys=True, default=str) == json.dumps(expected, sort_keys=True, default=str)


def _reference_state(detector):
    return {k: v for k, v in asdict(detector).items() if k not in detector.PARAMS}


@pytest.mark.parametrize("seed", range(10))
def test_detector_states_are_what_asdict_gave_and_are_copies(seed):
    rng = random.Random(seed)
    made = [
        detectors.Ewma(alpha=0.1),
        detectors.RobustBaseline(warmup=rng.randint(1, 30)),
        detectors.Window(size=rng.randint(1, 9)),
        detectors.Hysteresis(on=1.0, off=0.5),
        detectors.Cusum(k=0.5, cap=10.0),
        detectors.PageHinkley(k=0.5, cap=10.0),
    ]
    for _ in range(rng.randint(0, 60)):
        x = rng.choice((rng.gauss(0, 1), rng.gauss(0, 1), math.nan, math.inf))
        made[0].update(x)
        made[1].update(x if math.isfinite(x) else 0.0)
        made[2].update(x)
        made[3].update(x)
        made[4].update(x if math.isfinite(x) else 0.0)
        made[5].update(x if math.isfinite(x) else 0.0)
    for detector in made:
        state = detector.state_dict()
        assert list(state.items()) == list(_reference_state(detector).items())
        for key, value in state.items():
            if isinstance(value, list):  # a copy: the detector going on does not change a saved state
                assert value is not getattr(detector, key)


class _NothingHeld(HealthMonitor):
    """The monitor as it was before ``Rule.held``: every active check of an open episode built in full."""

    def _hold(self, rule_id, rule, episode) -> None:
        super()._hold(rule_id, rule, episode)
        rule.held = None


@pytest.mark.parametrize("settings", [None, {"reward_stagnation": {"severity": "warning"}}])
def test_held_checks_leave_findings_and_state_as_full_checks_do(settings):
    rng = random.Random(3)
    steps = [(s, {"critic/score/mean": 0.5 + rng.gauss(0.0, 0.01)}) for s in range(1200)]
    held_monitor, full_monitor = HealthMonitor(settings=settings), _NothingHeld(settings=settings)
    assert _outcome(held_monitor, held_monitor.observe_many(steps)) == _outcome(
        full_monitor, _one_by_one(full_monitor, steps)
    )
    found = [f for f in full_monitor.firing() if f.rule == "reward_stagnation"]
    assert found and found[0].severity is Severity.WARNING  # opened as info, escalated past 800 steps
    rule = held_monitor._rules["reward_stagnation"]
    # the episode is open at warning (or at a fixed severity): an active check is only its severity now
    assert rule.held is (Severity.WARNING if settings is None else Severity.CRITICAL)
    check = rule.observe(1200, {"reward": 0.5}, {})
    assert check is held(Severity.WARNING) and check.message == "" and not check.evidence
    assert full_monitor._rules["reward_stagnation"].held is None
