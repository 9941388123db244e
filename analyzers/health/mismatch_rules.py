"""The rollout-vs-training mismatch trend rule: a gap that is there, grows or jumps, with its likely cause.

It reads one *gap level* per step, the first source a run has of (each framework's own summary; the
server's audits write ``rlvitals/mismatch/*`` from the tokens, which come first):

1. ``logprob_abs_diff``: mean ``|log pi_train - log pi_rollout|`` (rlvitals audits, slime
   ``train_rollout_logprob_abs_diff``, open-instruct ``debug/vllm_vs_local_logprob_diff_mean``);
2. ``rollout_logp_diff_mean``: TRL ``sampling/sampling_logp_difference/mean``;
3. ``token_mult_prob_error - 1`` (NeMo-RL; ``E[exp|gap|] - 1`` is ``E|gap|`` to first order);
4. ``gen_kl`` (NeMo-RL ``gen_kl_error``, open-instruct ``debug/vllm_local_reverse_kl``, OpenRLHF ``vllm_kl``),
   ``|rollout_kl|`` (verl ``rollout_corr/kl``), ``rollout_probs_diff_mean`` (verl ``training/*``).

The source is kept for the run (levels of two sources are not compared). verl's and TRL's own summaries
(``rollout_corr/kl``, ``training/rollout_probs_diff_mean``, ``sampling/sampling_logp_difference/mean``)
have their level judged by ``rollout_mismatch``: on them this rule reports only a rise or a step while
the level is still below ``rollout_mismatch``'s bound (a rising gap at a still-acceptable level).
Conditions, any one active:

- **level** (gap units only: sources 1 and 3): the gap above ``max_gap`` (0.05 ~ ln 1.05: NeMo-RL's CI
  holds ``token_mult_prob_error < 1.05``); with the audit's own series, also verl's thresholds
  (``rollout_is_mean`` outside [``is_mean_low``, ``is_mean_high``], ESS < ``min_ess``, ``|kl| > max_kl``,
  ``chi2_token > max_chi2``), as verl's ``rollout_corr_helper`` checks them;
- **rising** (NeMo-RL's advice: a trend matters more than a spike): a fast EWMA more than ``rise`` above
  a slow one and ``min_gap`` above it, after ``warmup`` points;
- **step**: one point ``step_factor`` x above the fast EWMA and ``min_gap`` above it;
- **floor** (info): a steady gap above ``min_gap``, within the healthy level.

The message names the likely cause: a gap that rises while the learning rate is 0 or the gradient is
0 (or, when neither is logged, ``ppo_kl`` ~ 0) is a pipeline bug (critical: the policy is not moving,
so the data must be: an indexing bug, log-probs paired with the wrong tokens); a step is a weight sync
that failed or loaded other weights; a rise while the policy trains is stale weights in the sampler; a
gap that grows with position (audit ``position_growth`` >= ``position_growth``) is a KV cache or
precision drift; one concentrated in low-probability tokens and one-sided (``low_prob_ratio`` >=
``low_prob_ratio``, ``low_prob_bias`` >= 0.5) is a sampling setting (temperature/top-p/top-k) applied
by the engine and not by the trainer; otherwise a steady gap is numeric precision or kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from .detectors import Ewma
from .findings import IDLE, Check, Severity
from .registry import RULES, Rule, RuleId, register_rule, require
from .signals import Signal

SERIES = "rlvitals/mismatch/"
# (signal, in gap units) in priority order
_SOURCES: tuple[tuple[str, bool], ...] = (
    (Signal.LOGPROB_ABS_DIFF.value, True),
    (Signal.ROLLOUT_LOGP_DIFF_MEAN.value, False),
    (Signal.TOKEN_MULT_PROB_ERROR.value, True),
    (Signal.GEN_KL.value, False),
    (Signal.ROLLOUT_KL.value, False),
    (Signal.ROLLOUT_PROBS_DIFF_MEAN.value, False),
)
_MOTION = (Signal.LEARNING_RATE.value, Signal.GRAD_NORM.value, Signal.PPO_KL.value)
# sources whose level rollout_mismatch already judges (verl's and TRL's own checks): this rule only
# speaks while they are still at an acceptable level (a rise or a step below rollout_mismatch's bound)
_DEFER = {
    Signal.ROLLOUT_KL.value: "max_kl",
    Signal.ROLLOUT_PROBS_DIFF_MEAN.value: "max_probs_diff_mean",
    Signal.ROLLOUT_LOGP_DIFF_MEAN.value: "max_logp_diff_mean",
}

CAUSES = {
    "pipeline_bug": "a pipeline bug: the gap rises while the policy does not move ({still}), so the data "
    "changes, not the weights: check how rollout log-probs are paired with tokens (indexing, padding, "
    "packing, a shuffled batch)",
    "weight_sync": "a stale or failed weight sync: the gap jumped at one step and stayed up (the sampler "
    "got other weights, or stopped getting new ones)",
    "stale_weights": "stale weights in the sampler: the gap rises as the policy trains (the rollout "
    "engine's weight sync lags or stopped)",
    "cache_or_precision": "a KV cache or numeric precision drift: the gap grows with position in the "
    "response (last third {growth:.2g}x the first)",
    "sampling_settings": "sampling settings applied by the rollout engine only (temperature, top-p, "
    "top-k): the gap sits in low-probability tokens ({ratio:.2g}x the others) and leans one way",
    "precision": "numeric precision or kernel differences (e.g. a bf16 rollout engine vs an fp32 trainer): "
    "a steady gap from token to token",
}


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@register_rule(RuleId.MISMATCH_TREND)
class MismatchTrend(Rule):
    """See the module docstring."""

    signal = Signal.LOGPROB_ABS_DIFF.value
    inputs = (*(signal for signal, _ in _SOURCES), *_MOTION)
    summary = "the rollout-vs-training log-prob gap is there, rising or jumping; its likely cause named"
    defaults: ClassVar[Mapping[str, Any]] = {
        "fast_alpha": 0.3,
        "slow_alpha": 0.05,
        "rise": 1.0,
        "min_gap": 1e-3,
        "max_gap": 0.05,
        "step_factor": 4.0,
        "warmup": 8,
        "position_growth": 1.5,
        "low_prob_ratio": 3.0,
        "still_ppo_kl": 1e-7,
        "is_mean_low": 0.5,
        "is_mean_high": 2.0,
        "min_ess": 0.3,
        "max_kl": 0.1,
        "max_chi2": 1.0,
    }
    fire_after = 3
    resolve_after = 10
    severity = Severity.WARNING
    state_components = ("source", "fast", "slow", "motion", "shape", "points", "jump_step")
    evidence_note = (
        "NeMo-RL#1801 (token_mult_prob_error climbing until the run crashed), allenai/open-instruct#1473 "
        "(the gap kept growing at lr = 0: an indexing bug), verl's rollout_corr_helper thresholds"
    )
    advice = (
        "Find where the rollout engine and the trainer part ways: open the run's mismatch page (gap by "
        "position, by token probability, worst sequences), check the weight sync, the engine's dtype and "
        "sampling settings against the trainer's, and enable truncated importance sampling meanwhile."
    )

    @classmethod
    def validate(cls, s: Mapping[str, Any]) -> None:
        rid = cls.id
        require(0.0 < s["slow_alpha"] < s["fast_alpha"] <= 1.0, rid, "need 0 < slow_alpha < fast_alpha <= 1")
        require(s["rise"] > 0 and s["step_factor"] > 1, rid, "need rise > 0 and step_factor > 1")
        require(0 <= s["min_gap"] < s["max_gap"], rid, "need 0 <= min_gap < max_gap")
        require(s["warmup"] >= 1, rid, "warmup must be >= 1")
        require(
            0.0 < s["is_mean_low"] < 1.0 < s["is_mean_high"], rid, "need 0 < is_mean_low < 1 < is_mean_high"
        )

    def __init__(self, settings: Mapping[str, Any], run_config: Mapping[str, Any]) -> None:
        super().__init__(settings, run_config)
        self.source: str | None = None
        self.fast = Ewma(alpha=settings["fast_alpha"])
        self.slow = Ewma(alpha=settings["slow_alpha"])
        self.motion: dict[str, float] = {}  # latest learning rate, grad norm, ppo_kl
        self.shape: dict[str, float] = {}  # latest audit shape numbers
        self.points = 0
        self.jump_step: int | None = None  # the step of a jump, kept while the gap stays up

    def _level(self, signals: Mapping[str, float]) -> tuple[float, bool] | None:
        for signal, gap_units in _SOURCES:
            if self.source is not None and signal != self.source:
                continue
            x = signals.get(signal)
            if x is None:
                continue
            self.source = signal
            if signal == Signal.TOKEN_MULT_PROB_ERROR.value:
                x = x - 1.0
            return abs(x), gap_units
        return None

    def observe(self, step: int, signals: Mapping[str, float], metrics: Mapping[str, float]) -> Check | None:
        for signal in _MOTION:
            if signal in signals:
                self.motion[signal] = signals[signal]
        for name in ("position_growth", "low_prob_ratio", "low_prob_bias"):
            value = metrics.get(SERIES + name)
            if value is not None:
                self.shape[name] = value
        found = self._level(signals)
        if found is None:
            return None
        x, gap_units = found
        s = self.settings
        prev_fast = self.fast.value
        fast, slow = self.fast.update(x), self.slow.update(x)
        self.points += 1
        warm = self.points > s["warmup"]
        rising = warm and fast > slow * (1.0 + s["rise"]) and fast - slow > s["min_gap"]
        jumped = (
            self.points > 2
            and prev_fast is not None
            and x > s["step_factor"] * max(prev_fast, s["min_gap"])
            and x - prev_fast > s["min_gap"]
        )
        bound = _DEFER.get(self.source)
        if bound is not None and x > RULES[RuleId.ROLLOUT_MISMATCH.value].defaults[bound]:
            rising = jumped = False  # rollout_mismatch's to report
        verl = self._verl_failing(metrics)
        high = gap_units and x > s["max_gap"]
        floor = gap_units and x > s["min_gap"]
        if jumped:
            self.jump_step = step
        if not (rising or jumped or high or verl or floor):
            self.jump_step = None
            if self.idle:
                return IDLE
            return Check(active=False, value=x, evidence={"gap": x, "source": self.source},
                         message="rollout and training log-probs agree again")  # fmt: skip
        cause, still = self._cause(rising or jumped, self.jump_step is not None)
        what = []
        if jumped:
            what.append(f"jumped to {x:.3g} from about {prev_fast:.3g}")
        elif self.jump_step is not None:
            what.append(f"jumped at step {self.jump_step} and stays up")
        if rising:
            what.append(f"is rising (recent {fast:.3g} vs {slow:.3g} before)")
        if high:
            what.append(f"is above {s['max_gap']:g} (NeMo-RL's 1.05 bound on token_mult_prob_error)")
        if verl:
            what.append("is outside verl's healthy ranges: " + ", ".join(verl))
        if not what:
            what.append(f"steady, within the healthy level ({s['max_gap']:g})")
        if cause == "pipeline_bug":
            severity = Severity.CRITICAL
        elif rising or jumped or high or verl:
            severity = Severity.WARNING
        else:
            severity = Severity.INFO
        text = CAUSES[cause].format(
            still=still,
            growth=self.shape.get("position_growth", math.nan),
            ratio=self.shape.get("low_prob_ratio", math.nan),
        )
        return Check(
            active=True,
            value=x,
            signal=self.source,
            severity=severity,
            evidence={
                "gap": x,
                "source": self.source,
                "fast": fast,
                "slow": slow,
                "cause": cause,
                "rising": bool(rising),
                "jumped": bool(jumped),
                "verl": verl,
                "shape": dict(self.shape),
                "motion": dict(self.motion),
            },
            message=f"the rollout-vs-training log-prob gap ({self.source}) is {x:.3g}: {'; '.join(what)}. "
            f"Likely cause: {text}.",
        )

    def _verl_failing(self, metrics: Mapping[str, float]) -> list[str]:
        s = self.settings
        out = []
        is_mean = _finite(metrics.get(SERIES + "is_mean"))
        if is_mean is not None and not s["is_mean_low"] <= is_mean <= s["is_mean_high"]:
            out.append(f"IS mean {is_mean:.3g}")
        ess = _finite(metrics.get(SERIES + "ess"))
        if ess is not None and ess < s["min_ess"]:
            out.append(f"ESS {ess:.3g}")
        kl = _finite(metrics.get(SERIES + "kl"))
        if kl is not None and abs(kl) > s["max_kl"]:
            out.append(f"KL {kl:.3g}")
        chi2 = _finite(metrics.get(SERIES + "chi2_token"))
        if chi2 is not None and chi2 > s["max_chi2"]:
            out.append(f"chi2_token {chi2:.3g}")
        return out

    def _cause(self, moving_gap: bool, jumped: bool) -> tuple[str, str]:
        s = self.settings
        lr = self.motion.get(Signal.LEARNING_RATE.value)
        grad = self.motion.get(Signal.GRAD_NORM.value)
        kl = self.motion.get(Signal.PPO_KL.value)
        still = ""
        if lr is not None and lr == 0:
            still = "learning rate 0"
        elif grad is not None and grad == 0:
            still = "gradient norm 0"
        elif lr is None and grad is None and kl is not None and abs(kl) < s["still_ppo_kl"]:
            still = f"ppo_kl {kl:.2g}"
        if moving_gap and still:
            return "pipeline_bug", still
        if jumped:
            return "weight_sync", still
        if moving_gap:
            return "stale_weights", still
        growth = self.shape.get("position_growth")
        if growth is not None and growth >= s["position_growth"]:
            return "cache_or_precision", still
        ratio, bias = self.shape.get("low_prob_ratio"), self.shape.get("low_prob_bias")
        if ratio is not None and ratio >= s["low_prob_ratio"] and bias is not None and bias >= 0.5:
            return "sampling_settings", still
        return "precision", still

    def chart_marks(self) -> list[dict[str, Any]]:
        return [{"kind": "line", "y": self.settings["max_gap"], "label": "NeMo-RL 1.05 bound"}]
