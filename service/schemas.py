"""Request and response schemas of HTTP API v1, one per purpose (and the OpenAPI document at /docs).

Replies are built as plain dicts and encoded by ``encoding.JSONResponse`` (non-finite floats as
strings); the ``*Public`` models here describe them for OpenAPI.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt
from rlvitals.analyzers.contract.batch_rules import NAN, NEG_INF, POS_INF

MAX_STEP = 2**63 - 1

# A metric value: a JSON number, null, or one of the non-finite spellings (stored, never rejected).
MetricValue = StrictFloat | None | Literal[NAN, POS_INF, NEG_INF]  # the contract's spelling
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL characters
MetricName = Annotated[str, Field(min_length=1, max_length=250, pattern=NO_NUL)]
Step = Annotated[StrictInt, Field(ge=0, le=MAX_STEP)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunCreate(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL)]
    project: Annotated[str, Field(min_length=1, max_length=200, pattern=NO_NUL)] = "default"
    config: dict[str, Any] = Field(default_factory=dict)
    tags: list[Annotated[str, Field(max_length=200, pattern=NO_NUL)]] = Field(
        default_factory=list, max_length=100
    )


class StepIn(_Strict):
    step: Step
    metrics: dict[MetricName, MetricValue]
    wall_time: StrictFloat | None = None


class MetricsIn(_Strict):
    steps: list[StepIn]


class CriticalIncident(BaseModel):
    id: int
    number: int
    cause: str
    title: str
    primary_rule: str
    onset_step: int
    message: str


class AcceptedPublic(BaseModel):
    accepted: int = Field(description="Points (step x metric values) accepted; resent ones are ignored.")
    steps: int
    evaluated: bool | None = Field(
        None,
        description="With ?wait=rules: whether the health rules had evaluated these points when the "
        "answer was sent (they run after the write; the answer waits at most health_wait seconds).",
    )
    critical_incidents: list[CriticalIncident] | None = Field(
        None,
        description="With ?wait=rules, present only while the run has open critical incidents: a trainer "
        "that asked to halt on them stops at its next step boundary.",
    )


class AlertPublic(BaseModel):
    id: int
    run_id: int
    rule: str
    severity: Literal["info", "warning", "critical"]  # info: shown, not sent to webhooks by default
    state: Literal["firing", "resolved"]
    signal: str | None = None
    first_step: int
    last_step: int
    value: float | str | None
    message: str
    advice: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    created_at: float
    updated_at: float
    resolved_at: float | None = None


class AlertsPublic(BaseModel):
    data: list[AlertPublic]
    count: int


class IncidentPublic(BaseModel):
    id: int
    run_id: int
    number: int = Field(description="The run's own count of its incidents: 1, 2, ...")
    cause: str
    title: str
    severity: Literal["info", "warning", "critical"]
    state: Literal["open", "resolved"]
    primary_rule: str
    onset_step: int
    last_step: int
    resolved_step: int | None = None
    message: str
    advice: str
    members: dict[str, dict[str, Any]] = Field(description="One entry per rule: its severity, steps, value.")
    findings: list[dict[str, Any]] = Field(description="Every finding behind it (rule, state, step, value).")
    dropped_findings: int
    reopened: int
    notified_severity: str | None = None
    created_at: float
    updated_at: float
    resolved_at: float | None = None
    spent_after_onset: dict[str, Any] | None = Field(
        None, description="hours (and gpu_hours with a GPU count) the run ran after the onset"
    )
    alerts_url: str


class IncidentDetailPublic(IncidentPublic):
    alerts: list[AlertPublic]


class IncidentsPublic(BaseModel):
    data: list[IncidentPublic]
    count: int


class RunPublic(BaseModel):
    id: int
    name: str
    project: str
    config: dict[str, Any]
    tags: list[str]
    last_step: int | None
    status: Literal["healthy", "warning", "critical"]
    firing_alerts: list[AlertPublic]
    created_at: float
    updated_at: float


class RunListed(RunPublic):
    config: dict[str, Any] | None = Field(None, description="Only with ?include=config.")


class RunsPublic(BaseModel):
    data: list[RunListed]
    count: int


class Verdict(BaseModel):
    ok: bool
    abs_err: float | str | None
    rel_err: float | str | None
    range: list[float | str] | None = Field(
        None,
        description="[low, high] when the value is only reproducible as a range (clip_cov's random draw).",
    )


class AuditPublic(BaseModel):
    id: int
    run_id: int
    step: int
    rank: int | None
    micro_batch: int | None
    status: Literal["pending", "done", "error"]
    reported: dict[str, Any]
    recomputed: dict[str, Any] | None
    verdicts: dict[str, Verdict] | None
    explanation: str | None
    summary: str | None = Field(
        None, description="One sentence: which metrics disagree and the likeliest reason."
    )
    details: dict[str, str] = Field(
        default_factory=dict, description="Per mismatched metric, its explanation."
    )
    reported_as: dict[str, str] = Field(
        default_factory=dict, description="Audit metric -> the name the trainer reported it under."
    )
    counterfactuals: dict[str, Any] | None
    groups: dict[str, Any] | None = Field(None, description="GRPO group diagnostics (with group_index).")
    advantages: dict[str, Any] | None = Field(
        None,
        description="Advantages of algorithm.adv_estimator (default grpo) recomputed from "
        "token_level_rewards/group_index vs the sent ones.",
    )
    rollout: dict[str, Any] | None = Field(
        None,
        description="Rollout correction recomputed from old_log_prob/rollout_log_probs/response_mask with "
        "algorithm.rollout_correction: verdicts on the reported rollout_corr/* and training/rollout_* values.",
    )
    distillation: dict[str, Any] | None = Field(
        None,
        description="verl's on-policy distillation loss recomputed from log_prob/teacher_log_probs with the "
        "config's distillation section: verdicts on the reported distillation/* values and the total loss.",
    )
    mismatch: dict[str, Any] | None = Field(
        None,
        description="Rollout-vs-training mismatch of old_log_prob vs rollout_log_probs (batches that carry "
        "rollout_log_probs): token_mult_prob_error (NeMo-RL), verl's IS/KL diagnostics, |gap| quantiles, "
        "and where the gap lives: by_position (mean |gap| per position bucket, first to last), by_length, "
        "by_prob, by_group, worst sequences. See docs/mismatch.md.",
    )
    ok: bool | None = None
    error: str | None = None
    created_at: float
    finished_at: float | None


class MismatchPublic(BaseModel):
    run_id: int
    series: dict[str, dict[str, list]] = Field(
        description="rlvitals/mismatch/* and the trainer's own gap metrics: {name: {steps, values}}."
    )
    audits: list[dict[str, Any]] = Field(
        description="Audits with a mismatch report: id, step, token_mult_prob_error, abs_gap_mean."
    )
    selected: dict[str, Any] | None = Field(
        None, description="One audit's report in full (the latest, or audit_id's): {id, step, mismatch}."
    )


class AuditsPublic(BaseModel):
    data: list[AuditPublic]
    count: int


class BatchAccepted(BaseModel):
    id: int
    # a new upload is "pending"; a resend (same record_id) answers its audit's current status
    status: Literal["pending", "done", "error"] = "pending"


class SeriesPublic(BaseModel):
    step: list[int]
    value: list[float | str | None]
    wall_time: list[float | None] | None = Field(
        default=None, description="Each point's wall time (Unix seconds), with wall_time=true."
    )


class MetricNamesPublic(BaseModel):
    names: list[str]


class HealthPublic(BaseModel):
    """The health rules' chart marks with this run's settings, and its latest canonical signals."""

    model_config = ConfigDict(extra="allow")
    marks: list[dict[str, Any]]
    signals: dict[str, Any]
    step: int | None = None


class HistogramPublic(BaseModel):
    model_config = ConfigDict(extra="allow")
    edges: list[float]
    counts: list[int]


class HistogramsPublic(BaseModel):
    """Importance-ratio and advantage histograms of an audited batch (``rlvitals.analyzers.verdicts.histograms``)."""

    model_config = ConfigDict(extra="allow")
    tokens: int
    non_finite: int
    clip: dict[str, float] | None = None
    ratio: HistogramPublic
    advantages: HistogramPublic


class MetricsPublic(BaseModel):
    series: dict[str, SeriesPublic]


class ErrorBody(BaseModel):
    code: str
    message: str
    detail: Any = None


class ErrorPublic(BaseModel):
    error: ErrorBody
