"""Built-in health rules that look ahead: the entropy collapse the audited tensors predict before the curve
bends, the reward ceiling the entropy–reward law implies, and reward components pulling apart. Registered
through :func:`register_rule` like any user rule; the covariance math is :mod:`rlvitals.analyzers.health.entropy_forecast`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from ..contract.series import COV_SERIES, ETA_SERIES, FORECAST_SERIES
from .detectors import Window
from .entropy_forecast import EntropyForecaster, reward_ceiling_fit
from .findings import IDLE, Check, Severity
from .registry import Rule, RuleId, register_rule, require
from .runconfig import LEARNING_RATE_KEYS, learning_rate
from .signals import PREFIXES, Signal


@register_rule(RuleId.ENTROPY_FORECAST)
class EntropyForecast(Rule):
    """Entropy collapse predicted from the audited tensors, before the entropy curve bends (Cui et al. 2025,
    arXiv 2505.22617: the entropy change per step ≈ −η·Cov(log π(a|s), A(s, a))).

    Each audited batch carries the covariance between its tokens' log-probabilities (``old_log_prob``, the
    sampling policy's; else ``log_prob``) and their advantages, centred over the batch's valid tokens
    (``entropy_dynamics`` in the audit record; of several audited micro-batches of one step, the first
    counts). η is estimated from the run itself: each audited step's
    covariance is paired with the entropy change observed next (nats per step, from the entropy metric or
    the next audited batch's own entropy), and η̂ is their least-squares slope through the origin with
    weights decaying by ``decay`` per pair (the learning rate is not used: the paper's η is a step on the
    logits, which an LLM's learning rate does not translate into). The predicted rate is −η̂ × the smoothed
    covariance (EWMA ``cov_alpha``); the predicted trajectory runs linearly from the latest entropy. The
    run config's learning rate is shown beside η̂ in the evidence, for comparing runs.

    Target: where ``entropy_collapse`` warns, max(``floor``, ``ratio`` × the early entropy, the median of
    the first ``seed_points`` points). With η̂ from at least ``min_pairs`` pairs, a trajectory reaching the
    target within ``horizon`` steps while the entropy is still above it is a warning (after ``fire_after``
    audited batches in a row). Each audit adds ``rlvitals/entropy_cov``, ``rlvitals/entropy_eta`` and
    ``rlvitals/entropy_forecast`` (the entropy predicted for the next step, stored at that step beside the
    entropy observed there) to the run's series; the trajectory is drawn on the entropy panel."""

    signal = Signal.ENTROPY.value
    inputs = (signal,)
    persistence = "points"
    state_components = ("forecaster", "seed", "latest")
    config_keys = tuple(key for key, _ in LEARNING_RATE_KEYS)
    summary = "entropy collapse predicted from Cov(log π, A) of the audited batches, before the curve bends"
    defaults: ClassVar[Mapping[str, Any]] = {
        "horizon": 50,
        "min_pairs": 3,
        "decay": 0.9,
        "cov_alpha": 0.3,
        "seed_points": 3,
        "ratio": 0.1,
        "floor": 0.02,
    }
    fire_after = 2
    resolve_after = 3
    evidence_note = (
        "TRL side-environment GRPO runs that collapse on purpose (bench/forecast.py): the forecast fires "
        "before entropy_collapse's own warning"
    )
    advice = (
        "The updates reward confident tokens and punish unlikely ones (a large positive Cov(log π, A)), which "
        "drains entropy at the predicted rate: clip or down-weight the high-covariance tokens (Clip-Cov / "
        "KL-Cov, Cui et al. 2025), raise clip_ratio_high (Clip-Higher), add a small entropy bonus, or lower the "
        "learning rate before the entropy curve bends."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(s["horizon"] >= 1 and s["min_pairs"] >= 1, rid, "need horizon >= 1, min_pairs >= 1")
        require(0.0 < s["decay"] <= 1.0 and 0.0 < s["cov_alpha"] <= 1.0, rid, "decay, cov_alpha in (0, 1]")
        require(s["seed_points"] >= 1, rid, "seed_points must be >= 1")
        require(0.0 < s["ratio"] < 1.0 and s["floor"] > 0.0, rid, "need 0 < ratio < 1, floor > 0")

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        self.forecaster = EntropyForecaster(decay=settings["decay"], cov_alpha=settings["cov_alpha"])
        self.seed = Window(size=settings["seed_points"])
        self.latest: list[Any] = []  # [[name, step, value], ...] from the newest audit
        self.lr, _ = learning_rate(run_config)  # shown beside η̂ (not used to estimate it)

    def target(self) -> float:
        s = self.settings
        early = self.seed.median if self.seed.full else None
        return max(s["floor"], s["ratio"] * early) if early is not None else s["floor"]

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        x = signals.get(self.signal)
        if x is None:
            return None
        if not self.seed.full:
            self.seed.update(x)
        self.forecaster.observe_entropy(step, x)
        return None

    def observe_audit(self, step: int, report: Mapping[str, Any]) -> Check | None:
        dynamics = report.get("entropy_dynamics")
        if not isinstance(dynamics, Mapping):
            return None
        cov = _number(dynamics.get("cov"))
        if cov is None:
            return None
        batch_entropy = _number(dynamics.get("entropy"))
        f = self.forecaster
        if batch_entropy is not None:
            if not self.seed.full and (f.last_entropy is None or f.last_entropy[0] < step):
                self.seed.update(batch_entropy)
            f.observe_entropy(step, batch_entropy)  # closes the previous audited step's pair
        if step == f.last_cov_step:
            return None  # another micro-batch of a step already counted
        f.observe_cov(step, cov, batch_entropy)
        s = self.settings
        eta, rate = f.eta, f.rate()
        predicted = f.predict_next(cov)
        self.latest = [[COV_SERIES, step, cov]]
        if eta is not None:
            self.latest.append([ETA_SERIES, step, eta])
        if predicted is not None:
            self.latest.append([FORECAST_SERIES, step + 1, predicted])
        target = self.target()
        steps = f.steps_to(target)
        ready = f.pairs >= s["min_pairs"]
        active = ready and steps is not None and steps <= s["horizon"]
        if not active and self.idle:
            return IDLE
        now = f.last_entropy[1] if f.last_entropy else None
        when = None if steps is None or f.last_entropy is None else math.ceil(f.last_entropy[0] + steps)
        evidence = {
            "cov": cov,
            "cov_smoothed": f.cov,
            "eta": eta,
            "pairs": f.pairs,
            "rate_per_step": rate,
            "entropy": now,
            "target": target,
            "steps_to_target": steps,
            "forecast_step": when,
            "horizon": s["horizon"],
            "tokens": dynamics.get("tokens"),
            "learning_rate": self.lr,
        }
        if not active:
            return Check(
                active=False,
                value=now,
                evidence=evidence,
                message="the covariance no longer predicts an entropy collapse within the horizon",
            )
        return Check(
            active=True,
            value=now,
            evidence=evidence,
            severity=Severity.WARNING,
            message=f"entropy {now:.3g} is predicted to reach {target:.3g} in ~{steps:.0f} steps (step ~{when}): "
            f"Cov(log π, A) = {f.cov:.3g} with η̂ = {eta:.3g} (from {f.pairs} audited steps) drains "
            f"{-rate:.3g} nats per step",
        )

    def audit_series(self, step: int) -> list[list[Any]]:
        return [row for row in self.latest if row[1] in (step, step + 1)]

    def chart_marks(self) -> list[dict[str, Any]]:
        s = self.settings
        f = self.forecaster
        if f.pairs < s["min_pairs"]:
            return []
        target = self.target()
        points = f.trajectory(target, horizon=10 * s["horizon"])
        if not points:
            return []
        marks: list[dict[str, Any]] = [
            {
                "kind": "trajectory",
                "points": points,
                "label": f"predicted from Cov(log π, A) (η̂ {f.eta:.3g})",
            }
        ]
        steps = f.steps_to(target)
        if steps is not None and steps <= s["horizon"] and f.last_entropy is not None:
            marks.append(
                {
                    "kind": "forecast",
                    "step": math.ceil(f.last_entropy[0] + steps),
                    "from_step": int(f.last_entropy[0]),
                    "y": target,
                    "label": f"Cov(log π, A) predicts {target:.3g} at step ~{math.ceil(f.last_entropy[0] + steps)}",
                }
            )
        return marks


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


@register_rule(RuleId.ENTROPY_REWARD_FIT)
class EntropyRewardFit(Rule):
    """The reward ceiling the run is heading for, from its early steps (Cui et al. 2025: across models and
    tasks, reward and entropy follow R = −a·e^H + b, so a run that trades entropy for reward saturates at
    R = b − a when its entropy is spent). The fit uses the (entropy, reward) points of the first
    ``fit_steps`` steps (at least ``min_points``); once that window closes, a fit with a > 0 and
    R² ≥ ``min_r2`` opens one ``info`` finding carrying a, b and the ceiling (and a line at the ceiling on the
    reward panel). It stays open: it describes the run, it does not page."""

    signal = Signal.REWARD.value
    inputs = (Signal.REWARD.value, Signal.ENTROPY.value)
    severity = Severity.INFO
    state_components = ("first_step", "points", "fit", "done")
    summary = "the reward ceiling R = b − a implied by the early entropy–reward fit R = −a·e^H + b (info)"
    defaults: ClassVar[Mapping[str, Any]] = {"fit_steps": 100, "min_points": 10, "min_r2": 0.5}
    fire_after = 1
    resolve_after = 1
    advice = (
        "Informational: at the current exchange rate between entropy and reward the run saturates near this "
        "ceiling. To go higher, keep entropy from being spent (Clip-Cov / KL-Cov, Clip-Higher, an entropy "
        "bonus) rather than training longer."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        require(s["fit_steps"] >= 1 and s["min_points"] >= 3, cls.id, "need fit_steps >= 1, min_points >= 3")
        require(0.0 <= s["min_r2"] <= 1.0, cls.id, "min_r2 must be in [0, 1]")

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        self.first_step: int | None = None
        self.points: list[list[float]] = []
        self.fit: dict[str, float] | None = None
        self.done = False

    def chart_marks(self) -> list[dict[str, Any]]:
        if self.fit is None:
            return []
        return [
            {
                "kind": "line",
                "y": self.fit["ceiling"],
                "label": "entropy–reward ceiling",
                "severity": "info",
            }
        ]

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        if self.done:
            return None
        r, h = signals.get(Signal.REWARD.value), signals.get(Signal.ENTROPY.value)
        if r is None or h is None:
            return None
        s = self.settings
        if self.first_step is None:
            self.first_step = step
        if step - self.first_step < s["fit_steps"]:
            if h < 50.0:  # e^H overflows far beyond any token entropy
                self.points.append([h, r])
            return None
        self.done = True
        if len(self.points) < s["min_points"]:
            return None
        fit = reward_ceiling_fit(self.points)
        self.points = []
        if fit is None or fit["a"] <= 0 or fit["r2"] < s["min_r2"]:
            return None
        self.fit = fit
        return Check(
            active=True,
            value=r,
            evidence={**fit, "fit_steps": s["fit_steps"], "reward_now": r, "entropy_now": h},
            message=f"the early steps fit R = −{fit['a']:.3g}·e^H + {fit['b']:.3g} (R² {fit['r2']:.2f}, "
            f"{fit['points']:.0f} points): the reward ceiling at entropy 0 is {fit['ceiling']:.3g} "
            f"(now {r:.3g} at entropy {h:.3g})",
        )


_COMPONENT = re.compile(r"^rewards/(?P<name>.+?)(?:/mean)?$|^reward_extra_infos?/(?P<extra>.+?)(?:/mean)?$")
_NOT_COMPONENTS = ("total_reward", "total")


def reward_component(name: str) -> str | None:
    """The reward component a metric name carries (TRL ``rewards/<name>/mean`` and ``rewards/<name>``, verl
    ``reward_extra_info(s)/<key>``), or None (``/std`` columns and totals are not components)."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name.endswith("/std"):
        return None
    match = _COMPONENT.match(name)
    if match is None:
        return None
    component = match.group("name") or match.group("extra")
    return None if component in _NOT_COMPONENTS or "/" in component else component


@register_rule(RuleId.REWARD_COMPONENTS_DIVERGE)
class RewardComponentsDiverge(Rule):
    """Reward components pulling apart: one rising while another falls (a format reward climbing while the
    correctness reward drops is the policy learning to please the easy reward — reward hacking).

    Components: TRL's ``rewards/<name>/mean`` (``rewards/<name>`` in older TRL), verl's
    ``reward_extra_info/<key>`` metrics. For each, the early level is the mean of its first ``seed_points``
    points and the current level the mean of its last ``window`` points; a component *rises* (*falls*) when
    its level moved by at least ``min_change`` × max(|early|, |current|, ``abs_scale``) in that direction
    and the move is ``min_t`` standard errors (Welch's t of the two windows) away from noise. One rising
    while another falls is active; the episode closes when no pair diverges.

    A penalty (a component never above 0 in either window) that deepens while the total reward rises by
    the same test is the cost of what the policy gained, not a reward traded away: it does not count as
    falling (a reward component that falls counts whatever the total does — a correctness reward given
    up for a format reward raises the total too)."""

    signal = Signal.REWARD.value
    state_components = ("seeds", "recent")
    summary = "one reward component rising while another falls (e.g. format up, correctness down)"
    defaults: ClassVar[Mapping[str, Any]] = {
        "seed_points": 10,
        "window": 10,
        "min_change": 0.3,
        "abs_scale": 0.05,
        "min_t": 3.0,
        "max_components": 16,
    }
    fire_after = 10
    resolve_after = 20
    advice = (
        "One reward is being gamed at the expense of another: read a few completions that score high on the "
        "rising component and low on the falling one. Re-weight the components, make the easy one "
        "conditional on the hard one (format reward only when the answer is right), or cap it."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(s["seed_points"] >= 2 and s["window"] >= 2, rid, "seed_points and window must be >= 2")
        require(s["min_change"] > 0.0 and s["abs_scale"] > 0.0, rid, "min_change, abs_scale must be > 0")
        require(s["min_t"] >= 0.0 and s["max_components"] >= 2, rid, "need min_t >= 0, max_components >= 2")

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        self.seeds: dict[str, list[float]] = {}
        self.recent: dict[str, list[float]] = {}
        # the total reward's seed and recent windows, on the steps that log components
        self.total_seed: list[float] = []
        self.total_recent: list[float] = []
        self._names: dict[str, str | None] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "seeds": {k: list(v) for k, v in self.seeds.items()},
            "recent": {k: list(v) for k, v in self.recent.items()},
            "total_seed": list(self.total_seed),
            "total_recent": list(self.total_recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seeds = {str(k): [float(x) for x in v] for k, v in (state.get("seeds") or {}).items()}
        self.recent = {str(k): [float(x) for x in v] for k, v in (state.get("recent") or {}).items()}
        self.total_seed = [float(x) for x in state.get("total_seed") or []]
        self.total_recent = [float(x) for x in state.get("total_recent") or []]

    def _penalty(self, component: str) -> bool:
        """Whether ``component`` is a penalty: never above 0 in its seed or recent window."""
        return _never_positive(self.seeds[component], self.recent[component])

    def _component(self, name: str) -> str | None:
        hit = self._names.get(name, "")
        if hit == "":
            hit = self._names[name] = reward_component(name)
        return hit

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        s = self.settings
        seen = False
        names = self._names
        for name, value in metrics.items():
            component = names.get(name, "")
            if component == "":
                component = self._component(name)
            if component is None or not math.isfinite(value):
                continue
            if component not in self.seeds and len(self.seeds) >= s["max_components"]:
                continue
            seen = True
            seed = self.seeds.setdefault(component, [])
            if len(seed) < s["seed_points"]:
                seed.append(value)
            recent = self.recent.setdefault(component, [])
            recent.append(value)
            del recent[: max(0, len(recent) - s["window"])]
        if not seen:
            return None
        total = signals.get(self.signal)
        if total is not None and math.isfinite(total):
            if len(self.total_seed) < s["seed_points"]:
                self.total_seed.append(total)
            self.total_recent.append(total)
            del self.total_recent[: max(0, len(self.total_recent) - s["window"])]
        if len(self.seeds) < 2:
            return None
        total_rose = (
            len(self.total_seed) >= s["seed_points"]
            and len(self.total_recent) >= s["window"]
            and (_move(self.total_seed, self.total_recent, s) or 0.0) > 0
        )
        moves: dict[str, float] = {}
        for component, seed in self.seeds.items():
            recent = self.recent[component]
            if len(seed) < s["seed_points"] or len(recent) < s["window"]:
                continue
            move = _move(seed, recent, s)
            if move is not None:
                moves[component] = move
        rising = sorted((c for c, m in moves.items() if m > 0), key=lambda c: -moves[c])
        falling = sorted(
            (c for c, m in moves.items() if m < 0 and not (total_rose and self._penalty(c))),
            key=lambda c: moves[c],
        )
        active = bool(rising and falling)
        if not active and self.idle:
            return IDLE
        evidence = {"moves": moves, "rising": rising, "falling": falling}
        if not active:
            return Check(active=False, evidence=evidence, message="the reward components move together again")
        up, down = rising[0], falling[0]
        return Check(
            active=True,
            value=_mean(self.recent[down]),
            signal=f"rewards/{down}",
            evidence=evidence,
            message=f"reward component {down!r} fell to {_mean(self.recent[down]):.3g} ({moves[down]:+.0%}) while "
            f"{up!r} rose {moves[up]:+.0%} "
            f"(early vs last {s['window']} points): the policy is trading one reward for another",
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _never_positive(*windows: list[float]) -> bool:
    return all(v <= 0.0 for window in windows for v in window)


def _move(seed: list[float], recent: list[float], s: Mapping[str, Any]) -> float | None:
    """The relative move of a component from its seed window to its recent one, if significant."""
    early, now = _mean(seed), _mean(recent)
    scale = max(abs(early), abs(now), s["abs_scale"])
    relative = (now - early) / scale
    if abs(relative) < s["min_change"]:
        return None
    var_e = sum((v - early) ** 2 for v in seed) / (len(seed) - 1)
    var_n = sum((v - now) ** 2 for v in recent) / (len(recent) - 1)
    se = math.sqrt(var_e / len(seed) + var_n / len(recent))
    if se > 0 and abs(now - early) / se < s["min_t"]:
        return None
    return relative
