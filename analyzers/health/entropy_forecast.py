"""The entropy forecast of the ``entropy_forecast`` rule and the reward ceiling of ``reward_ceiling``
(Cui et al. 2025, arXiv 2505.22617): :class:`EntropyForecaster` turns a stream of audited covariances
Cov(log pi, A) and observed entropies into a step size eta, a predicted entropy change and a trajectory;
:func:`reward_ceiling_fit` fits R = -a e^H + b. Plain Python with JSON state, so the health monitor
persists it. The covariance itself is computed per audited batch by
:mod:`rlvitals.analyzers.verdicts.entropy_dynamics`, whose docstring gives the estimator of eta."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class EntropyForecaster:
    """η̂, the predicted entropy change and trajectory from covariances and observed entropies.

    Feed :meth:`observe_cov` (an audited step's covariance, and the batch's own entropy when known) and
    :meth:`observe_entropy` (the entropy metric of a step). ``decay`` weights older (c, d) pairs down per
    pair; ``cov_alpha`` smooths the covariance the trajectory extrapolates. State: :meth:`state_dict`.
    """

    def __init__(self, *, decay: float = 0.9, cov_alpha: float = 0.3) -> None:
        self.decay = decay
        self.cov_alpha = cov_alpha
        self.pending: list[float] | None = None  # [step, cov, entropy at that step or NaN]
        self.scc = 0.0  # Σ w·c²
        self.scd = 0.0  # Σ w·c·d
        self.pairs = 0
        self.cov = None  # EWMA of the covariance
        self.last_entropy: list[float] | None = None  # [step, entropy]
        self.last_cov_step: int | None = None

    # ------------------------------------------------------------------ feeds

    def observe_entropy(self, step: int, entropy: float) -> None:
        """The entropy observed at ``step`` (the trainer's metric): closes a pending (c, d) pair."""
        if not math.isfinite(entropy):
            return
        pending = self.pending
        if pending is not None and step > pending[0]:
            start = pending[2]
            if (
                not math.isfinite(start)
                and self.last_entropy is not None
                and self.last_entropy[0] <= pending[0]
            ):
                start = self.last_entropy[1]
            if math.isfinite(start):
                c, d = pending[1], (entropy - start) / (step - pending[0])
                self.scc = self.decay * self.scc + c * c
                self.scd = self.decay * self.scd + c * d
                self.pairs += 1
            self.pending = None
        if self.last_entropy is None or step >= self.last_entropy[0]:
            self.last_entropy = [float(step), float(entropy)]

    def observe_cov(self, step: int, cov: float, entropy: float | None = None) -> None:
        """An audited step's covariance (several micro-batches of one step: the first is kept)."""
        if not math.isfinite(cov) or step == self.last_cov_step:
            return
        self.last_cov_step = step
        self.cov = cov if self.cov is None else self.cov + self.cov_alpha * (cov - self.cov)
        at = entropy if entropy is not None and math.isfinite(entropy) else math.nan
        if not math.isfinite(at) and self.last_entropy is not None and self.last_entropy[0] == step:
            at = self.last_entropy[1]
        self.pending = [float(step), float(cov), at]
        if math.isfinite(at) and (self.last_entropy is None or step >= self.last_entropy[0]):
            self.last_entropy = [float(step), float(at)]

    # ------------------------------------------------------------------ estimates

    @property
    def eta(self) -> float | None:
        """η̂ (≥ 0), or None before any pair or when the entropy does not follow the covariance."""
        if self.pairs == 0 or self.scc <= 0:
            return None
        eta = -self.scd / self.scc
        return eta if eta > 0 else None

    def rate(self) -> float | None:
        """The predicted entropy change per step (nats/step) at the smoothed covariance: −η̂·c̄."""
        eta = self.eta
        if eta is None or self.cov is None:
            return None
        return -eta * self.cov

    def predict_next(self, cov: float) -> float | None:
        """The entropy predicted one step after the latest observed one, at covariance ``cov``."""
        eta = self.eta
        if eta is None or self.last_entropy is None:
            return None
        return self.last_entropy[1] - eta * cov

    def steps_to(self, target: float) -> float | None:
        """Steps until the predicted trajectory (linear at the current rate) reaches ``target``; None when
        entropy is not predicted to fall or is at or below the target already."""
        rate = self.rate()
        if rate is None or rate >= 0 or self.last_entropy is None:
            return None
        gap = self.last_entropy[1] - target
        if gap <= 0:
            return None
        return gap / -rate

    def trajectory(self, target: float, horizon: int, points: int = 12) -> list[list[float]]:
        """``[[step, predicted entropy], ...]`` from the latest observed entropy, until it reaches
        ``target`` or ``horizon`` steps ahead (empty without a falling forecast)."""
        rate = self.rate()
        if rate is None or rate >= 0 or self.last_entropy is None:
            return []
        step0, h0 = self.last_entropy
        until = self.steps_to(target)
        span = float(horizon) if until is None else min(float(horizon), until)
        if span <= 0:
            return []
        return [
            [step0 + span * i / (points - 1), max(target, h0 + rate * span * i / (points - 1))]
            for i in range(points)
        ]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "pending": self.pending,
            "scc": self.scc,
            "scd": self.scd,
            "pairs": self.pairs,
            "cov": self.cov,
            "last_entropy": self.last_entropy,
            "last_cov_step": self.last_cov_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pending = state.get("pending")
        self.pending = [float(v) for v in pending] if pending else None
        self.scc = float(state.get("scc") or 0.0)
        self.scd = float(state.get("scd") or 0.0)
        self.pairs = int(state.get("pairs") or 0)
        self.cov = None if state.get("cov") is None else float(state["cov"])
        last = state.get("last_entropy")
        self.last_entropy = [float(v) for v in last] if last else None
        self.last_cov_step = None if state.get("last_cov_step") is None else int(state["last_cov_step"])


def reward_ceiling_fit(points: list[list[float]]) -> dict[str, float] | None:
    """Least-squares fit of R = −a·e^H + b on ``[[entropy, reward], ...]`` (Cui et al.'s empirical law
    between a run's entropy and its reward): ``{"a", "b", "ceiling", "r2", "points"}`` where the ceiling
    ``b − a`` is the reward predicted at H = 0 (the policy fully deterministic: where the run saturates if
    it keeps trading entropy for reward). ``None`` with fewer than 3 points or no spread in e^H."""
    n = len(points)
    if n < 3:
        return None
    xs = [math.exp(h) for h, _ in points]
    ys = [r for _, r in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a, b = -slope, my - slope * mx
    syy = sum((y - my) ** 2 for y in ys)
    resid = sum((y - (b - a * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - resid / syy if syy > 0 else 0.0
    return {"a": a, "b": b, "ceiling": b - a, "r2": r2, "points": n}
