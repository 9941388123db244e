"""Built-in health rules over the size of each policy update: pg_clipfrac, ppo_kl, pg_clipfrac_lower.
They register through :func:`register_rule` exactly as a user's rule would.

Healthy ranges (see docs/health.md): ppo_kl a small positive number that stays near its own level;
pg_clipfrac in [0.1, 0.3] (0 by construction with one update per batch); pg_clipfrac_lower close to 0.
The run-long trends (kl_loss, entropy) live in :mod:`.trend_rules`, the event rules (non_finite,
zero_advantage_groups, audit_mismatch) in :mod:`.event_rules`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from .detectors import DETECTORS, MEAN_ABS_TO_SIGMA, Ewma, Hysteresis, RobustBaseline, Window, make_detector
from .findings import IDLE, Check, Severity
from .registry import Rule, RuleId, register_rule, require
from .runconfig import CONFIG_KEYS, LOSS_MODE_KEYS, loss_mode, updates_per_batch
from .signals import Signal


@register_rule(RuleId.PG_CLIPFRAC_RANGE)
class PgClipfracRange(Rule):
    """pg_clipfrac (share of tokens where the PPO clip is active) outside its band, read with the run config.

    The smoothed value (EWMA, ``alpha``) must leave [``low``, ``high``] to open an episode and come back
    inside [low + margin, high − margin] to close it, where the margin is the larger of ``margin`` and
    ``noise_margin`` standard deviations of the smoothed value (learnt from the series), so a noisy series
    hovering at a threshold stays one episode instead of flapping. Above the band is a warning; below it is
    ``low_severity`` (``info`` by default: verl's own reference GRPO runs learn well at 0.002–0.009 with four
    updates per batch at lr 1e-6; set ``"warning"`` per run or server-wide to be paged for it).

    Config-aware modes (``evidence["mode"]``):

    - ``single_update``: one optimizer update per rollout batch (from ``updates_per_batch`` or the run
      config: verl ``ppo_epochs`` × ⌈train_batch_size / ppo_mini_batch_size⌉, TRL ``num_iterations`` ×
      ⌈steps_per_generation / gradient_accumulation_steps⌉). old_log_prob then equals log_prob, the ratio
      is 1 and pg_clipfrac is 0 by construction: the band does not apply, and any raw value above
      ``single_update_tol`` means the rollout's old_log_prob is not what the actor computes (critical).
    - ``inferred_single_update``: the config does not say, but every value so far is exactly 0 (TRL with the
      default ``num_iterations=1``): nothing to report; the first non-zero value ends the inference.
    - ``gspo``: sequence-level ratios (verl ``policy_loss.loss_mode=gspo``, TRL
      ``importance_sampling_level=sequence``) clip about two orders of magnitude more tokens than
      token-level PPO (Zheng et al. 2025, GSPO): the band is [``gspo_low``, ``gspo_high``].
    - ``sapo``: soft gating, no hard clip (verl ``loss_mode=sapo``, TRL ``loss_type=sapo``): not checked.
    """

    signal = Signal.PG_CLIPFRAC.value
    inputs = (signal,)
    state_components = ("ewma", "noise", "side", "all_zero")
    summary = (
        "pg_clipfrac outside [0.1, 0.3] (above: warning, below: info); non-zero with one update per batch"
    )
    defaults: ClassVar[Mapping[str, Any]] = {
        "low": 0.1,
        "high": 0.3,
        "margin": 0.02,
        "noise_margin": 4.0,
        "alpha": 0.1,
        "single_update_tol": 0.0,
        "updates_per_batch": 0,
        "low_severity": "info",
        "gspo_low": 0.05,
        "gspo_high": 0.5,
    }
    fire_after = 5
    resolve_after = 20
    config_keys = (*CONFIG_KEYS, *LOSS_MODE_KEYS)
    evidence_note = (
        "verl's reference GRPO/PPO gsm8k runs (Qwen2.5-0.5B, gemma-2-2b, Qwen2-7B) sit at 0.002–0.009 and "
        "learn; TRL runs with num_iterations=1 log exactly 0: both were false warnings before severities"
    )
    advice = (
        "Too high: each update moves the policy too far; lower the learning rate or the updates per batch "
        "(ppo_epochs, fewer/larger mini-batches) and check for rollout/actor log-prob mismatch. Too low: "
        "the policy barely moves; raise the learning rate or take more updates per batch."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(
            0.0 <= s["low"] < s["high"] <= 1.0, rid, f"need 0 <= low < high <= 1, got {s['low']}, {s['high']}"
        )
        require(
            s["margin"] >= 0.0 and s["low"] + s["margin"] < s["high"] - s["margin"], rid, "margin too wide"
        )
        require(0.0 <= s["gspo_low"] < s["gspo_high"] <= 1.0, rid, "need 0 <= gspo_low < gspo_high <= 1")
        require(0.0 < s["alpha"] <= 1.0, rid, f"alpha must be in (0, 1], got {s['alpha']}")
        require(s["noise_margin"] >= 0.0, rid, "noise_margin must be >= 0")
        require(s["single_update_tol"] >= 0.0, rid, "single_update_tol must be >= 0")
        require(
            s["updates_per_batch"] >= 0, rid, "updates_per_batch must be >= 0 (0 = infer from run_config)"
        )
        require(
            s["low_severity"] in {v.value for v in Severity},
            rid,
            f"low_severity must be one of {[v.value for v in Severity]}, got {s['low_severity']!r}",
        )

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        explicit = settings["updates_per_batch"]
        if explicit:
            self.updates, self.updates_source = explicit, "settings: pg_clipfrac_range.updates_per_batch"
        else:
            self.updates, self.updates_source = updates_per_batch(run_config)
        self.loss_mode, self.loss_mode_source = loss_mode(run_config)
        if self.loss_mode == "gspo":
            self.low, self.high = settings["gspo_low"], settings["gspo_high"]
        else:
            self.low, self.high = settings["low"], settings["high"]
        self.ewma = Ewma(alpha=settings["alpha"])
        self.noise = Ewma(alpha=settings["alpha"])  # mean |x - smoothed| (innovation size)
        self.side: str | None = None
        self.all_zero = True  # every value so far is exactly 0 (infers one update per batch)

    def chart_marks(self) -> list[dict[str, Any]]:
        if self.loss_mode == "sapo" or self.updates == 1:
            return [{"kind": "line", "y": 0.0, "label": "0 by construction (one update per batch)"}]
        return [{"kind": "band", "low": self.low, "high": self.high, "label": f"band ({self.loss_mode})"}]

    def _base(self) -> dict[str, Any]:
        """The evidence every check of this rule starts with (built only for a check that is read)."""
        return {
            "updates_per_batch": self.updates,
            "updates_source": self.updates_source,
            "loss_mode": self.loss_mode,
            "loss_mode_source": self.loss_mode_source,
        }

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        x = signals.get(self.signal)
        if x is None or self.loss_mode == "sapo":
            return None
        s = self.settings
        if self.updates == 1:
            tol = s["single_update_tol"]
            active = x > tol
            return Check(
                active=active,
                value=x,
                severity=Severity.CRITICAL,
                evidence={**self._base(), "mode": "single_update", "tolerance": tol},
                message=(
                    f"pg_clipfrac is {x:.4g} with one update per batch, where it is 0 by construction: the "
                    "log-probs the actor computes differ from the rollout's old_log_prob (rollout/actor mismatch)"
                    if active
                    else "pg_clipfrac is back to 0, as one update per batch implies"
                ),
                advice=(
                    "Check where old_log_prob comes from: it must be recomputed by the actor with the same "
                    "weights, precision and padding as the update (not taken from the inference engine); "
                    "compare the two log-probs per token and consider truncated importance sampling."
                ),
            )
        self.all_zero = self.all_zero and x == 0.0
        if self.all_zero and self.updates is None:
            if self.idle:
                return IDLE
            return Check(
                active=False,
                value=x,
                evidence={**self._base(), "mode": "inferred_single_update"},
                message="pg_clipfrac is exactly 0 so far: one update per batch (inferred), as TRL's "
                "default num_iterations=1 gives",
            )
        if self.ewma.value is not None:
            self.noise.update(abs(x - self.ewma.value))
        m = self.ewma.update(x)
        low, high = self.low, self.high
        # release margin: at least `margin`, and `noise_margin` standard deviations of the smoothed value
        alpha = s["alpha"]
        smoothed_sd = MEAN_ABS_TO_SIGMA * (self.noise.value or 0.0) * math.sqrt(alpha / (2.0 - alpha))
        margin = min(max(s["margin"], s["noise_margin"] * smoothed_sd), 0.45 * (high - low))
        if (self.side == "high" and m < high - margin) or (self.side == "low" and m > low + margin):
            self.side = None
        if self.side is None:
            self.side = "high" if m > high else ("low" if m < low else None)
        if self.side is None and self.idle:
            return IDLE
        evidence = {
            **self._base(),
            "mode": self.loss_mode,
            "smoothed": m,
            "low": low,
            "high": high,
            "margin": margin,
            "side": self.side,
        }
        if self.side == "high":
            return Check(
                active=True,
                value=m,  # the smoothed value the message quotes (and the band is checked against)
                evidence=evidence,
                severity=Severity.WARNING,
                message=f"pg_clipfrac (smoothed {m:.3f}) is above the band [{low:g}, {high:g}]: "
                "updates push many tokens past the clip range",
                advice="Lower the learning rate or the updates per batch (ppo_epochs, fewer and larger "
                "mini-batches); check rollout/actor log-prob mismatch (old_log_prob from the inference engine).",
            )
        if self.side == "low":
            return Check(
                active=True,
                value=m,
                evidence=evidence,
                severity=Severity(s["low_severity"]),
                message=f"pg_clipfrac (smoothed {m:.3g}) is below the band [{low:g}, {high:g}]: "
                "the policy moves little within a batch (common and healthy at small learning rates)",
                advice="Only a problem if learning stalls: then raise the learning rate or take more updates "
                "per batch (ppo_epochs, smaller ppo_mini_batch_size). Set pg_clipfrac_range.low_severity to "
                '"warning" (run config rlvitals.rules, or the server\'s rules) to be alerted for it.',
            )
        return Check(
            active=False,
            value=x,
            evidence=evidence,
            message=f"pg_clipfrac (smoothed {m:.3f}) is back in band",
        )


@register_rule(RuleId.PPO_KL_DRIFT)
class PpoKlDrift(Rule):
    """ppo_kl (old vs new policy, the size of one update) drifting up from its own robust baseline.

    Baseline: :class:`RobustBaseline` (median/MAD over ``warmup`` points, then clipped EWMA updates with
    rate ``alpha``; its scale is floored at ``rel_floor``·|baseline| + ``abs_floor``, so numerically-zero
    ppo_kl, as with one update per batch, does not turn rounding noise into drift). Residuals are standardized, clipped to ±``z_clip`` and fed to a drift detector
    (``detector``: "cusum" or "page_hinkley", slack ``k``, threshold ``h``, capped at 2h so recovery is
    prompt). ``warmup`` counts steps (at least ``min_warmup_points`` points). Also fires when ppo_kl exceeds
    the absolute ``ceiling`` (critical) and when the median of its last ``negative_window`` points stays
    below −``negative_tol`` (ppo_kl estimates KL(π_old‖π_θ) on tokens sampled from π_old; it cannot
    be persistently negative unless old_log_prob is not the sampling policy's). The baseline is frozen
    while any condition holds, so it never chases the drift; a drift that persists for
    ``rebaseline_after`` points is accepted as the new level (the baseline is re-learnt and the episode
    resolves, saying so).
    """

    signal = Signal.PPO_KL.value
    inputs = (signal,)
    state_components = (
        "baseline",
        "detector",
        "drift",
        "ceiling",
        "smoothed",
        "negative",
        "drift_points",
        "rebaselined_at",
        "first_step",
    )
    summary = "ppo_kl drifting up from its own baseline, above a ceiling, or persistently negative"
    defaults: ClassVar[Mapping[str, Any]] = {
        "warmup": 20,
        "alpha": 0.01,
        "k": 1.5,
        "h": 14.0,
        "z_clip": 5.0,
        "rel_floor": 0.25,
        "abs_floor": 1e-4,
        "detector": "cusum",
        "ceiling": 0.05,
        "negative_tol": 5e-4,
        "negative_window": 9,
        "min_warmup_points": 5,
        "rebaseline_after": 300,
    }
    evidence_note = (
        "a verl console log with one −0.006 point among values rounded to 3 decimals fired 'negative' on "
        "that single outlier; several mini-batches on the same samples can legitimately give ppo_kl ≤ 0"
    )
    fire_after = 3
    resolve_after = 10
    advice = (
        "Each update moves the policy further than it used to: lower the learning rate or the updates per "
        "batch (ppo_epochs, fewer/larger mini-batches), tighten gradient clipping; if it coincides with a "
        "rollout change, check rollout/actor log-prob mismatch."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(s["warmup"] >= 2, rid, "warmup must be >= 2")
        require(0.0 < s["alpha"] <= 1.0, rid, "alpha must be in (0, 1]")
        require(
            s["negative_window"] >= 1 and s["min_warmup_points"] >= 2,
            rid,
            "need negative_window >= 1, min_warmup_points >= 2",
        )
        require(
            s["k"] >= 0.0 and s["h"] > 0.0 and s["z_clip"] > s["k"], rid, "need k >= 0, h > 0, z_clip > k"
        )
        require(
            s["rel_floor"] >= 0.0 and s["negative_tol"] >= 0.0, rid, "rel_floor, negative_tol must be >= 0"
        )
        require(s["ceiling"] > 0.0, rid, "ceiling must be > 0 (use inf to disable)")
        require(s["rebaseline_after"] >= 1, rid, "rebaseline_after must be >= 1")
        require(
            s["detector"] in DETECTORS,
            rid,
            f"detector must be one of {sorted(DETECTORS)}, got {s['detector']!r}",
        )

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        s = settings
        self.baseline = RobustBaseline(
            alpha=s["alpha"], warmup=s["warmup"], rel_floor=s["rel_floor"], abs_floor=s["abs_floor"]
        )
        self.detector = make_detector(s["detector"], k=s["k"], cap=2.0 * s["h"])
        self.drift = Hysteresis(on=s["h"], off=0.5 * s["h"])
        self.ceiling = Hysteresis(on=s["ceiling"], off=0.8 * s["ceiling"])
        self.smoothed = Window(size=s["negative_window"])
        self.first_step: int | None = None
        self.negative = Hysteresis(on=-s["negative_tol"], off=-0.5 * s["negative_tol"], upward=False)
        self.drift_points = 0
        self.rebaselined_at: int | None = None

    def _rebaseline(self, step: int) -> None:
        """Accept a persistent new level: learn the baseline afresh from the next points."""
        s = self.settings
        self.baseline = RobustBaseline(
            alpha=s["alpha"], warmup=s["warmup"], rel_floor=s["rel_floor"], abs_floor=s["abs_floor"]
        )
        self.detector = make_detector(s["detector"], k=s["k"], cap=2.0 * s["h"])
        self.drift.active = False
        self.drift_points = 0
        self.rebaselined_at = step
        self.first_step = step

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        x = signals.get(self.signal)
        if x is None:
            return None
        s = self.settings
        above_ceiling = self.ceiling.update(x)
        m = self.smoothed.update(x)
        negative = self.negative.update(m) if self.smoothed.full else False
        if self.first_step is None:
            self.first_step = step
        if (
            not self.baseline.ready
            and step - self.first_step + 1 >= s["warmup"]
            and self.baseline.count >= s["min_warmup_points"]
        ):
            self.baseline.seal()
        z = None
        if self.baseline.ready:
            z = max(-s["z_clip"], min(s["z_clip"], self.baseline.z(x)))
            drifting = self.drift.update(self.detector.update(z))
        else:
            drifting = False
        self.drift_points = self.drift_points + 1 if drifting else 0
        if self.idle and not (drifting or above_ceiling or negative):
            # nothing to report and no episode to close: what the branches below do, without the evidence
            # (not drifting, so drift_points is 0 and no rebaseline is due)
            self.baseline.update(x)
            return IDLE
        evidence = {
            "baseline": self.baseline.center if self.baseline.ready else None,
            "scale_up": self.baseline.scale_up if self.baseline.ready else None,
            "z": z,
            "statistic": self.detector.statistic,
            "detector": s["detector"],
            "k": s["k"],
            "h": s["h"],
            "ceiling": s["ceiling"],
            "smoothed": m,
            "negative_tol": s["negative_tol"],
            "drift_points": self.drift_points,
            "rebaselined_at": self.rebaselined_at,
        }
        if self.drift_points >= s["rebaseline_after"]:
            self._rebaseline(step)
            drifting = False
        elif not (drifting or above_ceiling or negative):
            self.baseline.update(x)  # frozen during an episode, so the baseline never chases the drift
        conditions = [
            name
            for name, on in (("ceiling", above_ceiling), ("drift_up", drifting), ("negative", negative))
            if on
        ]
        evidence["conditions"] = conditions
        if not conditions:
            accepted = self.rebaselined_at is not None and step - self.rebaselined_at <= 2 * s["warmup"]
            message = (
                f"ppo_kl stayed at its new level for {s['rebaseline_after']} points; accepted as its new baseline"
                if accepted
                else "ppo_kl is back near its baseline"
            )
            return Check(active=False, value=x, evidence=evidence, message=message)
        if "negative" in conditions and len(conditions) == 1:
            return Check(
                active=True,
                value=m,  # the median the message quotes
                evidence=evidence,
                # info: with several mini-batches per batch, ppo_kl <= 0 is legitimate (verl's reference runs)
                severity=Severity.INFO,
                message=f"ppo_kl has stayed negative (median of the last {s['negative_window']} points {m:.3g}): old_log_prob does not look like the "
                "log-probs of the policy that sampled the rollouts",
                advice="Check that old_log_prob is the sampling policy's, recomputed by the actor before the "
                "update, and the sign of your logging (ppo_kl = mean(old_log_prob - log_prob)).",
            )
        # the ceiling latch releases below 0.8 × ceiling: quote the highest value since it crossed (the
        # latest point may already be back under the ceiling) and the latest beside it when it is
        value = x
        parts = []
        if above_ceiling:
            value = self.ceiling.peak if self.ceiling.peak is not None else x
            parts.append(f"reached {value:.3g}, above the ceiling {s['ceiling']:g}")
            if x < s["ceiling"]:
                parts[-1] += f" (latest {x:.3g}; the alert clears below {self.ceiling.off:.3g})"
        if drifting:
            parts.append(
                ("" if above_ceiling else f"{x:.3g} ")
                + f"has drifted up from its baseline {self.baseline.center:.3g} "
                f"({s['detector']} statistic {self.detector.statistic:.1f} > {s['h']:g})"
            )
        return Check(
            active=True,
            value=value,
            evidence=evidence,
            severity=Severity.CRITICAL if above_ceiling else Severity.WARNING,
            message="ppo_kl " + " and ".join(parts),
        )

    def chart_marks(self) -> list[dict[str, Any]]:
        marks = [{"kind": "line", "y": self.settings["ceiling"], "label": "ceiling", "severity": "critical"}]
        if self.baseline.ready:
            marks.append({"kind": "line", "y": self.baseline.center, "label": "baseline", "severity": "info"})
        return marks


@register_rule(RuleId.PG_CLIPFRAC_LOWER_HIGH)
class PgClipfracLowerHigh(Rule):
    """pg_clipfrac_lower (share of negative-advantage tokens capped by the dual clip, ratio > clip_ratio_c)
    above ``threshold``; the episode closes once it stays below ``release`` × threshold."""

    signal = Signal.PG_CLIPFRAC_LOWER.value
    inputs = (signal,)
    state_components = ("latch",)
    summary = "dual-clip share pg_clipfrac_lower above ~0 (default 0.01)"
    defaults: ClassVar[Mapping[str, Any]] = {"threshold": 0.01, "release": 0.5}
    fire_after = 3
    resolve_after = 10
    advice = (
        "Negative-advantage tokens whose probability ratio exceeds clip_ratio_c: the policy moved far on "
        "tokens it was told to make less likely. Usually a rollout/actor log-prob mismatch (old_log_prob "
        "from the inference engine, precision differences; consider truncated importance sampling) or "
        "updates that are too large (lower the learning rate or ppo_epochs)."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        require(0.0 <= s["threshold"] <= 1.0, cls.id, "threshold must be in [0, 1]")
        require(0.0 <= s["release"] <= 1.0, cls.id, "release must be in [0, 1]")

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        threshold = settings["threshold"]
        self.latch = Hysteresis(on=threshold, off=settings["release"] * threshold)

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        x = signals.get(self.signal)
        if x is None:
            return None
        active = self.latch.update(x)
        if not active and self.idle:
            return IDLE
        threshold = self.settings["threshold"]
        if not active:
            return Check(
                active=False,
                value=x,
                evidence={"threshold": threshold, "release_below": self.latch.off},
                message=f"pg_clipfrac_lower is back below {self.latch.off:g}",
            )
        # the latch releases below release × threshold: quote the highest value since it crossed
        peak = self.latch.peak if self.latch.peak is not None else x
        latest = f" (latest {x:.3g}; the alert clears below {self.latch.off:.3g})" if x <= threshold else ""
        return Check(
            active=True,
            value=peak,
            evidence={"threshold": threshold, "release_below": self.latch.off},
            message=f"pg_clipfrac_lower reached {peak:.3g}, above {threshold:g}{latest}: the dual clip is "
            "capping many negative-advantage tokens",
        )

    def chart_marks(self) -> list[dict[str, Any]]:
        return [{"kind": "line", "y": self.settings["threshold"], "label": "threshold"}]
