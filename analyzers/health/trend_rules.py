"""Built-in health rules over run-long trends: kl_loss (policy vs reference) running away and entropy
collapsing. They register through :func:`register_rule` exactly as a user's rule would.

Healthy: kl_loss starts near 0 and creeps up slowly (linearly or slowing down); entropy declines slowly
and never collapses toward 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from .detectors import Ewma, Hysteresis, RobustBaseline
from .findings import Check, Severity
from .registry import Rule, RuleId, register_rule, require
from .signals import Signal


def _load(target: Any, state: Mapping[str, Any] | None) -> None:
    if state:
        target.load_state_dict(state)


@register_rule(RuleId.KL_LOSS_RUNAWAY)
class KlLossRunaway(Rule):
    """kl_loss (policy vs the frozen reference) growing faster than its slow healthy creep, or above a ceiling.

    Two EWMAs (``fast_alpha``, ``slow_alpha``) of kl_loss. For a series growing at slope s their gap is
    s·(lag_slow − lag_fast) with lag = (1 − α)/α, which gives the current slope. Growth is a runaway when
    (1) fast/slow − 1 > ``growth`` (the recent level is clearly above the recent past), (2) the current
    slope exceeds ``slope_ratio`` × the run's average slope fast/step (kl_loss starts near 0 at step 0, so
    healthy creep — linear or slowing — stays near or below 1×), (3) fast > ``min_level``, after
    ``warmup`` points. It resolves when fast/slow − 1 drops below growth/2. ``ceiling`` is absolute (critical).
    """

    signal = Signal.KL_LOSS.value
    summary = "kl_loss growing much faster than its slow creep, or above a ceiling"
    defaults: ClassVar[Mapping[str, Any]] = {
        "fast_alpha": 0.1,
        "slow_alpha": 0.02,
        "growth": 0.3,
        "slope_ratio": 3.0,
        "min_level": 1e-3,
        "warmup": 50,
        "ceiling": 0.5,
    }
    fire_after = 3
    resolve_after = 20
    advice = (
        "The policy is running away from the reference model: lower the learning rate, raise kl_loss_coef, "
        "and read some recent responses for reward hacking (length blow-up, repetition, format exploits)."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(0.0 < s["slow_alpha"] < s["fast_alpha"] <= 1.0, rid, "need 0 < slow_alpha < fast_alpha <= 1")
        require(s["growth"] > 0.0 and s["slope_ratio"] > 0.0, rid, "growth and slope_ratio must be > 0")
        require(s["min_level"] >= 0.0 and s["warmup"] >= 0, rid, "min_level and warmup must be >= 0")
        require(s["ceiling"] > 0.0, rid, "ceiling must be > 0 (use inf to disable)")

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        s = settings
        self.fast = Ewma(alpha=s["fast_alpha"])
        self.slow = Ewma(alpha=s["slow_alpha"])
        self.lag_gap = (1 - s["slow_alpha"]) / s["slow_alpha"] - (1 - s["fast_alpha"]) / s["fast_alpha"]
        self.ceiling = Hysteresis(on=s["ceiling"], off=0.8 * s["ceiling"])
        self.growing = False

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        x = signals.get(self.signal)
        if x is None:
            return None
        s = self.settings
        fast, slow = self.fast.update(x), self.slow.update(x)
        above_ceiling = self.ceiling.update(x)
        ratio = fast / slow - 1.0 if slow > 0 else 0.0
        slope = (fast - slow) / self.lag_gap
        average_slope = max(fast, 0.0) / max(step, 1)
        speedup = slope / average_slope if average_slope > 0 else 0.0
        if self.growing:
            self.growing = ratio >= 0.5 * s["growth"]
        else:
            self.growing = (
                self.fast.count > s["warmup"]
                and fast > s["min_level"]
                and ratio > s["growth"]
                and speedup > s["slope_ratio"]
            )
        evidence = {
            "fast": fast,
            "slow": slow,
            "growth": ratio,
            "growth_threshold": s["growth"],
            "slope_per_step": slope,
            "average_slope_per_step": average_slope,
            "speedup": speedup,
            "slope_ratio": s["slope_ratio"],
            "ceiling": s["ceiling"],
        }
        if not (self.growing or above_ceiling):
            return Check(active=False, value=x, evidence=evidence, message="kl_loss is creeping slowly again")
        parts = []
        if above_ceiling:
            parts.append(f"is above the ceiling {s['ceiling']:g}")
        if self.growing:
            parts.append(
                f"is growing fast ({ratio:.0%} above its slow average, {speedup:.1f}× the run's average rate)"
            )
        return Check(
            active=True,
            value=x,
            evidence=evidence,
            severity=Severity.CRITICAL if above_ceiling else Severity.WARNING,
            message=f"kl_loss {x:.3g} " + " and ".join(parts),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "fast": self.fast.state_dict(),
            "slow": self.slow.state_dict(),
            "ceiling": self.ceiling.state_dict(),
            "growing": self.growing,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in ("fast", "slow", "ceiling"):
            _load(getattr(self, name), state.get(name))
        self.growing = bool(state.get("growing", False))


@register_rule(RuleId.ENTROPY_COLLAPSE)
class EntropyCollapse(Rule):
    """Token entropy falling toward a floor relative to its early level.

    The early level is the median of the first ``warmup`` points. The smoothed entropy (EWMA ``alpha``)
    below ``ratio`` × early opens a warning, below the absolute ``floor`` a critical episode; it closes
    once the smoothed value is back above ``release`` × early (and above the floor).
    """

    signal = Signal.ENTROPY.value
    summary = "entropy collapsing toward 0 relative to its early level"
    defaults: ClassVar[Mapping[str, Any]] = {
        "warmup": 20,
        "alpha": 0.05,
        "ratio": 0.3,
        "release": 0.4,
        "floor": 0.02,
    }
    fire_after = 5
    resolve_after = 20
    advice = (
        "The policy is turning deterministic and stops exploring: raise clip_ratio_high (Clip-Higher, e.g. "
        "0.28), add a small entropy bonus (entropy_coeff), lower the learning rate or raise the rollout "
        "temperature, and check the reward for an exploit the policy has locked onto."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(s["warmup"] >= 1, rid, "warmup must be >= 1")
        require(0.0 < s["alpha"] <= 1.0, rid, "alpha must be in (0, 1]")
        require(0.0 < s["ratio"] <= s["release"] <= 1.0, rid, "need 0 < ratio <= release <= 1")
        require(s["floor"] >= 0.0, rid, "floor must be >= 0")

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        self.early = RobustBaseline(warmup=settings["warmup"])
        self.ewma = Ewma(alpha=settings["alpha"])
        self.collapsed = False

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        x = signals.get(self.signal)
        if x is None:
            return None
        s = self.settings
        m = self.ewma.update(x)
        if not self.early.ready:
            self.early.update(x)  # freezes at the warmup median; later points are not fed
            return Check(
                active=False, value=x, evidence={"smoothed": m}, message="entropy: learning its early level"
            )
        early = self.early.center
        relative = m / early if early > 0 else None
        below_ratio = relative is not None and relative < s["ratio"]
        below_floor = m < s["floor"]
        if self.collapsed:
            self.collapsed = m < s["floor"] or (relative is not None and relative < s["release"])
        else:
            self.collapsed = below_ratio or below_floor
        evidence = {
            "smoothed": m,
            "early_level": early,
            "relative": relative,
            "ratio": s["ratio"],
            "release": s["release"],
            "floor": s["floor"],
        }
        if not self.collapsed:
            return Check(active=False, value=x, evidence=evidence, message="entropy has recovered")
        share = f"{relative:.0%} of its early level {early:.3g}" if relative is not None else "near 0"
        return Check(
            active=True,
            value=x,
            evidence=evidence,
            severity=Severity.CRITICAL if below_floor else Severity.WARNING,
            message=f"entropy (smoothed {m:.3g}) has fallen to {share}"
            + (f", below the floor {s['floor']:g}" if below_floor else ""),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"early": self.early.state_dict(), "ewma": self.ewma.state_dict(), "collapsed": self.collapsed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _load(self.early, state.get("early"))
        _load(self.ewma, state.get("ewma"))
        self.collapsed = bool(state.get("collapsed", False))
