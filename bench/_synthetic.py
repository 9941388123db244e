"""The synthetic incident corpus: generated GRPO streams, labelled, scored like the real-log corpus.

A healthy stream (``grpo_stream``): ppo_kl ~1e-3 (log-normal noise, occasional 3x spikes), pg_clipfrac
~0.15-0.2, pg_clipfrac_lower ~0.001, kl_loss creeping up slowly, entropy declining slowly, 10-30%
zero-variance groups, passing audits every 25 steps. Each :class:`Scenario` perturbs one signal from
``ONSET`` on and says, as data, what a user should see: a :class:`RunLabels` with the incident's kind
(its rule), onset and end — or ``healthy`` when nothing warning-or-worse is due (a healthy stream, or a
perturbation whose finding is ``info`` by design). Our rules are run through ``HealthMonitor`` (metrics,
group statistics and audits, as a live run feeds them), their findings turned into alerts by the same
``alerts_from_findings`` the real-log corpus uses, and scored by ``score_run``
(``bench/detection.py --synthetic`` prints the table, ``tests/analyzers/test_analyzers_health_scenarios.py``
asserts it). Tolerance is 0: an alert before the onset is false.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlvitals.analyzers import Finding, HealthMonitor, Severity
from rlvitals.analyzers.health.scoring import Alert, Incident, RunLabels, RunScore, score_run

from bench._detection import alerts_from_findings

STEPS = 2000
ONSET = 1000
LENGTH = 150
AUDIT_EVERY = 25
SEEDS = (0, 1, 2, 3, 4, 5)
INCIDENT_SEEDS = SEEDS[:3]


@dataclass
class Point:
    step: int
    metrics: dict[str, float]
    groups: dict[str, float]
    audit: dict[str, Any] | None


Perturb = Callable[[Point, random.Random, int], None]  # (point, rng, steps since onset)


def grpo_stream(seed: int, *, steps: int = STEPS, single_update: bool = False) -> Iterator[Point]:
    """A healthy verl GRPO run; ``single_update`` gives the on-policy variant (clipfrac and ppo_kl 0)."""
    rng = random.Random(seed)
    entropy0 = rng.uniform(0.45, 0.9)
    kl_scale = rng.uniform(0.01, 0.05)
    for step in range(steps):
        f = step / steps
        ppo_kl = (1e-3 + 5e-4 * f) * math.exp(rng.gauss(0, 0.35)) + rng.gauss(0, 5e-5)
        if rng.random() < 0.01:
            ppo_kl *= 3
        clipfrac = 0.17 + 0.02 * math.sin(step / 150) + 0.02 * f + rng.gauss(0, 0.02)
        lower = abs(rng.gauss(0.0, 0.0015))
        if single_update:
            ppo_kl, clipfrac, lower = rng.gauss(0, 1e-7), 0.0, 0.0
        zero_std = min(1.0, max(0.0, 0.1 + 0.2 * f + rng.gauss(0, 0.05)))
        point = Point(
            step=step,
            metrics={
                "actor/ppo_kl": ppo_kl,
                "actor/pg_clipfrac": min(1.0, max(0.0, clipfrac)),
                "actor/pg_clipfrac_lower": lower,
                "actor/kl_loss": (2e-4 + kl_scale * f**0.7) * math.exp(rng.gauss(0, 0.1)),
                "actor/entropy": entropy0 * (1 - 0.4 * f) * math.exp(rng.gauss(0, 0.05)),
                "actor/pg_loss": rng.gauss(0, 0.05),
                "actor/grad_norm": abs(rng.gauss(0.3, 0.1)),
                "critic/score/mean": 0.3 + 0.5 * f + rng.gauss(0, 0.05),
                "response_length/mean": 300 + 100 * f + rng.gauss(0, 20),
                "response_length/clip_ratio": min(1.0, max(0.0, rng.gauss(0.03, 0.02))),
                "reward_std": abs(rng.gauss(0.35, 0.05)),
                "rollout_corr/kl": abs(rng.gauss(0.004, 0.002)),
                "rollout_corr/rollout_is_mean": rng.gauss(1.0, 0.02),
            },
            groups={
                "zero_std_frac": zero_std,
                "all_max_frac": 0.7 * zero_std,
                "all_min_frac": 0.3 * zero_std,
                "n_groups": 128.0,
            },
            audit=None,
        )
        if step % AUDIT_EVERY == 0:
            point.audit = {
                "ok": True,
                "empty": False,
                "verdicts": {"pg_loss": {"ok": True, "abs_err": 1e-8, "rel_err": 1e-7}},
                "explanation": "",
            }
        yield point


def run(
    points: Iterable[Point],
    *,
    settings: dict | None = None,
    run_config: dict | None = None,
    perturb: Perturb | None = None,
    seed: int = 0,
    onset: int = ONSET,
    length: int = LENGTH,
    monitor: HealthMonitor | None = None,
) -> list[Finding]:
    """Every finding ``HealthMonitor`` emits on ``points``, ``perturb`` applied on [onset, onset + length)."""
    monitor = monitor or HealthMonitor(settings=settings, run_config=run_config)
    rng = random.Random(10_000 + seed)
    findings: list[Finding] = []
    for point in points:
        if perturb is not None and onset <= point.step < onset + length:
            perturb(point, rng, point.step - onset)
        findings += monitor.observe(point.step, point.metrics)
        findings += monitor.observe_groups(point.step, point.groups)
        if point.audit is not None:
            findings += monitor.observe_audit(point.step, point.audit)
    return findings


# ----------------------------------------------------------------------------- perturbations


def scale(name: str, factor: float) -> Perturb:
    def perturb(point: Point, rng: random.Random, since: int) -> None:
        point.metrics[name] *= factor

    return perturb


def set_to(name: str, mean: float, sd: float) -> Perturb:
    def perturb(point: Point, rng: random.Random, since: int) -> None:
        point.metrics[name] = max(0.0, rng.gauss(mean, sd))

    return perturb


def negative_ppo_kl(point: Point, rng: random.Random, since: int) -> None:
    point.metrics["actor/ppo_kl"] = -abs(point.metrics["actor/ppo_kl"])


def kl_runaway(point: Point, rng: random.Random, since: int) -> None:
    point.metrics["actor/kl_loss"] *= 2 ** (since / 30)


def entropy_collapse(point: Point, rng: random.Random, since: int) -> None:
    # the policy locks onto one answer and stops being right: the reward sinks back to where it started
    point.metrics["actor/entropy"] *= max(0.08, 1 - since / 40)
    point.metrics["critic/score/mean"] = 0.3 + (point.metrics["critic/score/mean"] - 0.3) * max(
        0.0, 1 - since / 20
    )


def entropy_sharpening(point: Point, rng: random.Random, since: int) -> None:
    # the same fall of the entropy while the reward keeps rising: the policy sharpening on what it learnt
    point.metrics["actor/entropy"] *= max(0.08, 1 - since / 40)


def entropy_below_floor(point: Point, rng: random.Random, since: int) -> None:
    point.metrics["actor/entropy"] = 0.005


NAN_STEPS = 3


def nan(point: Point, rng: random.Random, since: int) -> None:
    if since < NAN_STEPS:
        point.metrics["actor/pg_loss"] = math.nan
        point.metrics["actor/grad_norm"] = math.inf


def groups(solved: bool) -> Perturb:
    def perturb(point: Point, rng: random.Random, since: int) -> None:
        share = min(1.0, max(0.0, rng.gauss(0.8, 0.05)))
        major, minor = 0.9 * share, 0.1 * share
        point.groups.update(
            zero_std_frac=share,
            all_max_frac=major if solved else minor,
            all_min_frac=minor if solved else major,
        )

    return perturb


def audit_mismatch(point: Point, rng: random.Random, since: int) -> None:
    if point.audit is not None:
        point.audit = {
            "ok": False,
            "empty": False,
            "verdicts": {
                "pg_loss": {"ok": False, "abs_err": 0.4, "rel_err": 0.25},
                "pg_clipfrac": {"ok": True, "abs_err": 0.0, "rel_err": 0.0},
            },
            "reported": {"pg_loss": 2.0},
            "recomputed": {"pg_loss": 1.6},
            "explanation": "reported pg_loss equals seq-mean-token-mean; config says token-mean",
        }


def length_collapse(point: Point, rng: random.Random, since: int) -> None:
    point.metrics["response_length/mean"] *= max(0.04, 1 - since / 20)


def policy_collapse(point: Point, rng: random.Random, since: int) -> None:
    # the degenerating policy of exp1a rho1.00 at step 135: reward to ~40 % while entropy doubles
    point.metrics["critic/score/mean"] *= 0.4
    point.metrics["actor/entropy"] *= 2.0


def grad_spike(point: Point, rng: random.Random, since: int) -> None:
    if since == 0:
        point.metrics["actor/grad_norm"] = 30.0


def lone_grad_spike(point: Point, rng: random.Random, since: int) -> None:
    # 20x the stream's median of ~0.3, no KL with it: clipped at 1.0, the update is still ~3x the usual
    if since == 0:
        point.metrics["actor/grad_norm"] = 6.0


def kl_spike(point: Point, rng: random.Random, since: int) -> None:
    # one logged point of kl far above a median of ~0.01-0.04, forgotten the next step
    if since == 0:
        point.metrics["actor/kl_loss"] = 0.6


SINGLE_UPDATE = {
    "actor_rollout_ref": {"actor": {"ppo_epochs": 1, "ppo_mini_batch_size": 64}},
    "data": {"train_batch_size": 64},
}
SINGLE_UPDATE_BY_BATCH = {
    "data": {"train_batch_size": 256},
    "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 256}},
}


# ----------------------------------------------------------------------------- the labelled scenarios


@dataclass(frozen=True)
class Scenario:
    """One synthetic stream and what it should raise.

    ``rule=None`` is a healthy stream. ``severity`` is the level the episode must reach; an ``info``
    scenario is labelled healthy (nothing warning-or-worse is due) and its info alert is checked apart.
    The incident lasts ``active`` steps from ``ONSET`` (the perturbation may act on fewer steps than it
    is applied to, e.g. three NaN steps); its rule must alert within ``detect_within`` steps of onset and
    resolve within ``resolve_within`` steps of the end of the perturbation (unless ``resolves`` is False).
    """

    name: str
    rule: str | None = None
    perturb: Perturb | None = None
    detect_within: int = 0
    resolve_within: int = 0
    severity: Severity = Severity.WARNING
    settings: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)
    single_update: bool = False
    length: int = LENGTH
    active: int | None = None
    seeds: tuple[int, ...] = INCIDENT_SEEDS
    resolves: bool = True

    @property
    def healthy(self) -> bool:
        return self.rule is None or self.severity is Severity.INFO

    @property
    def end(self) -> int:
        """The last step the incident is there (its label's ``end``)."""
        return ONSET + (self.length if self.active is None else self.active) - 1

    def labels(self, seed: int) -> RunLabels:
        run_id = f"{self.name}/seed{seed}"
        if self.healthy:
            return RunLabels(run_id=run_id, healthy=True)
        incident = Incident(kind=str(self.rule), onset=ONSET, end=self.end, why=self.name)
        return RunLabels(run_id=run_id, healthy=False, incidents=(incident,), tolerance=0)

    def monitor(self) -> HealthMonitor:
        return HealthMonitor(settings=self.settings or None, run_config=self.run_config or None)

    def findings(self, seed: int, monitor: HealthMonitor | None = None) -> list[Finding]:
        stream = grpo_stream(seed, single_update=self.single_update)
        return run(
            stream, perturb=self.perturb, seed=seed, length=self.length, monitor=monitor or self.monitor()
        )


HEALTHY: dict[str, Scenario] = {
    "healthy": Scenario("healthy", seeds=SEEDS),
    "healthy_single_update": Scenario(
        "healthy_single_update", single_update=True, run_config=SINGLE_UPDATE_BY_BATCH
    ),
    # TRL's default num_iterations=1 logs exactly 0: inferred single update, nothing to report
    "healthy_single_update_no_config": Scenario(
        "healthy_single_update_no_config", single_update=True, seeds=(7,)
    ),
    # every step clipped (median ~0.3 above grad_clip 0.2): a 20x pre-clip spike is a step of the usual size
    "healthy_clipped_grad_spike": Scenario(
        "healthy_clipped_grad_spike",
        perturb=lone_grad_spike,
        run_config={"actor_rollout_ref": {"actor": {"grad_clip": 0.2}}},
        length=2,
    ),
}

INCIDENTS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("ppo_kl_drift_up", "ppo_kl_drift", scale("actor/ppo_kl", 4.0), 20, 60),
        Scenario(
            "ppo_kl_above_ceiling",
            "ppo_kl_drift",
            set_to("actor/ppo_kl", 0.08, 0.01),
            10,
            60,
            Severity.CRITICAL,
        ),
        # info: several mini-batches on the same samples can legitimately give ppo_kl <= 0
        Scenario("ppo_kl_negative", "ppo_kl_drift", negative_ppo_kl, 25, 60, Severity.INFO),
        Scenario("clipfrac_above_band", "pg_clipfrac_range", set_to("actor/pg_clipfrac", 0.42, 0.03), 15, 40),
        # below the band is info by default (verl's reference runs learn at 0.002-0.009)
        Scenario(
            "clipfrac_below_band",
            "pg_clipfrac_range",
            set_to("actor/pg_clipfrac", 0.03, 0.01),
            15,
            40,
            Severity.INFO,
        ),
        Scenario(
            "clipfrac_below_band_opted_in",
            "pg_clipfrac_range",
            set_to("actor/pg_clipfrac", 0.03, 0.01),
            15,
            40,
            settings={"pg_clipfrac_range": {"low_severity": "warning"}},
        ),
        Scenario(
            "clipfrac_lower_high",
            "pg_clipfrac_lower_high",
            set_to("actor/pg_clipfrac_lower", 0.03, 0.005),
            5,
            20,
        ),
        Scenario("kl_loss_runaway", "kl_loss_runaway", kl_runaway, 120, 60),
        # one point each (the perturbation acts at the onset only; the label spans two steps)
        Scenario("grad_norm_lone_spike", "grad_norm_spike", lone_grad_spike, 0, 25, length=2),
        Scenario("kl_spike", "kl_spike", kl_spike, 0, 25, length=2),
        Scenario("entropy_collapse", "entropy_collapse", entropy_collapse, 60, 80),
        # said (info), not paged: an entropy that falls while the reward rose and holds, answers inside the cap
        Scenario("entropy_sharpening", "entropy_collapse", entropy_sharpening, 60, 80, Severity.INFO),
        Scenario("non_finite", "non_finite", nan, 1, 13, Severity.CRITICAL, active=NAN_STEPS),
        Scenario("entropy_explosion", "entropy_explosion", scale("actor/entropy", 4.0), 10, 30),
        Scenario("response_length_collapse", "response_length_collapse", length_collapse, 25, 30),
        Scenario(
            "truncation_high", "truncation_high", set_to("response_length/clip_ratio", 0.5, 0.05), 10, 30
        ),
        Scenario(
            "truncation_at_cap",
            "truncation_high",
            set_to("response_length/clip_ratio", 0.95, 0.02),
            10,
            30,
            Severity.CRITICAL,
        ),
        Scenario("reward_std_death", "reward_std_collapse", set_to("reward_std", 0.0, 0.0), 20, 30),
        Scenario(
            "grad_norm_zero", "grad_norm_zero", set_to("actor/grad_norm", 0.0, 0.0), 10, 30, Severity.CRITICAL
        ),
        Scenario("policy_collapse", "policy_collapse", policy_collapse, 1, 30),
        Scenario("rollout_kl_high", "rollout_mismatch", set_to("rollout_corr/kl", 0.3, 0.05), 10, 30),
        Scenario(
            "rollout_is_mean_low",
            "rollout_mismatch",
            set_to("rollout_corr/rollout_is_mean", 0.3, 0.05),
            10,
            30,
        ),
        # groups that tie because every sample solved the prompt: said (info, with the advice to filter or
        # re-sample them), not paged: the run is not failing
        Scenario("groups_all_solved", "zero_advantage_groups", groups(solved=True), 20, 80, Severity.INFO),
        Scenario("groups_all_failed", "zero_advantage_groups", groups(solved=False), 20, 80),
        Scenario(
            "audit_mismatch",
            "audit_mismatch",
            audit_mismatch,
            AUDIT_EVERY,
            3 * AUDIT_EVERY + 1,
            Severity.CRITICAL,
        ),
        # one update per batch: clipfrac must be exactly 0, so any clipping means rollout != actor
        Scenario(
            "single_update_clipfrac_nonzero",
            "pg_clipfrac_range",
            set_to("actor/pg_clipfrac", 0.004, 0.001),
            10,
            40,
            Severity.CRITICAL,
            single_update=True,
            run_config=SINGLE_UPDATE,
            seeds=(7,),
        ),
        # no config, clipfrac 0 so far (inferred single update): the first clipping above the band warns,
        # and ends the inference, so the 0 that follows is below the band: the episode stays open
        Scenario(
            "single_update_inferred_clipfrac_high",
            "pg_clipfrac_range",
            set_to("actor/pg_clipfrac", 0.45, 0.02),
            15,
            single_update=True,
            seeds=(7,),
            resolves=False,
        ),
        # the other drift detector catches the same drift
        Scenario(
            "ppo_kl_drift_page_hinkley",
            "ppo_kl_drift",
            scale("actor/ppo_kl", 4.0),
            25,
            60,
            settings={"ppo_kl_drift": {"detector": "page_hinkley"}},
            seeds=(4,),
        ),
        Scenario(
            "kl_loss_above_ceiling",
            "kl_loss_runaway",
            set_to("actor/kl_loss", 1.8, 0.1),
            10,
            60,
            Severity.CRITICAL,
            # the step onto the new level is kl_spike's finding too; this scenario checks the ceiling
            settings={"kl_spike": {"enabled": False}},
            length=100,
            seeds=(6,),
        ),
        # a drop straight below the absolute floor is critical from the first finding
        Scenario(
            "entropy_below_floor",
            "entropy_collapse",
            entropy_below_floor,
            10,
            80,
            Severity.CRITICAL,
            seeds=(7,),
        ),
        # a user's severity setting overrides the rule's
        Scenario(
            "non_finite_as_warning",
            "non_finite",
            nan,
            0,
            1,
            settings={"non_finite": {"severity": "warning", "resolve_after": 2}},
            active=NAN_STEPS,
            seeds=(8,),
        ),
    )
}

SCENARIOS: dict[str, Scenario] = {**HEALTHY, **INCIDENTS}


@dataclass
class SyntheticRun:
    """One scenario on one seed, in the shape ``bench/detection.py`` renders (``id``, ``labels``)."""

    scenario: Scenario
    seed: int
    labels: RunLabels
    findings: list[Finding]
    firing: list[Finding]  # still open at the end of the stream
    last_step: int = STEPS - 1

    @property
    def id(self) -> str:
        return self.labels.run_id

    @property
    def alerts(self) -> list[Alert]:
        return alerts_from_findings(self.findings, self.firing)

    def score(self) -> RunScore:
        return score_run(self.labels, self.alerts, last_step=self.last_step)


def synthetic_run(scenario: Scenario, seed: int) -> SyntheticRun:
    monitor = scenario.monitor()
    findings = scenario.findings(seed, monitor)
    return SyntheticRun(scenario, seed, scenario.labels(seed), findings, monitor.firing())


def load_synthetic(only: Iterable[str] | None = None) -> list[SyntheticRun]:
    """Every scenario on each of its seeds (``only``: scenario names)."""
    wanted = set(only) if only else None
    return [
        synthetic_run(s, seed)
        for s in SCENARIOS.values()
        if wanted is None or s.name in wanted
        for seed in s.seeds
    ]
