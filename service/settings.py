"""Server configuration: one validated object, built once and passed into ``create_app(settings)``.

Every field can be set from the environment with the ``RLVITALS_`` prefix (``RLVITALS_PORT=9000``,
``RLVITALS_WEBHOOK_URLS='["http://hooks.local/a"]'``); the ``rlvitals serve`` flags override them.
Nothing in the server reads the environment anywhere else, so tests build their own ``Settings``.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class Settings(BaseSettings):
    """All server settings (documented, one per row, in docs/server.md)."""

    model_config = SettingsConfigDict(env_prefix="RLVITALS_", extra="forbid", validate_assignment=True)

    # --- network ---------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to bind.")
    workers: int = Field(1, ge=1, le=64, description="uvicorn worker processes (each with its own pools).")
    insecure: bool = Field(
        False, description="Allow binding a non-loopback address while no API key exists (open writes)."
    )
    require_key_for_reads: bool | None = Field(
        None,
        description="Reads (API, SSE, /metrics, dashboard; not /healthz) need an API key once one "
        "exists. Default: on when host is not a loopback address.",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host header values accepted besides loopback names, IP addresses and the bind "
        'address (DNS-rebinding guard); ".example.com" allows its subdomains, "*" any host.',
    )

    # --- storage ---------------------------------------------------------------------------------
    data_dir: Path = Field(Path(".rlvitals"), description="Directory for the default SQLite database.")
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL: sqlite:///path.db or postgresql+psycopg://user@host/db. "
        "Default: sqlite file rlvitals.db in data_dir (WAL mode).",
    )
    db_pool_size: int = Field(10, ge=1, le=200, description="PostgreSQL connection pool size per process.")

    # --- request limits --------------------------------------------------------------------------
    max_batch_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="Largest accepted safetensors batch body (bytes); larger -> 413.",
    )
    max_request_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest accepted JSON body (bytes); larger -> 413."
    )
    max_points_per_request: int = Field(
        250_000,
        ge=1,
        description="Most points (step x metric values) one POST /metrics may carry; more -> 413.",
    )
    max_metric_names_per_run: int = Field(
        10_000,
        ge=0,
        description="Most distinct metric names one run may hold (0: no limit); points adding more -> 413.",
    )
    max_concurrent_uploads: int = Field(
        4,
        ge=1,
        description="Batch uploads being received at once per process; more -> 429 + Retry-After (a client "
        "under its share, this / clients uploading, is admitted while another holds more than its own, up "
        "to 2x this).",
    )
    max_upload_bytes_in_flight: int = Field(
        1024 * 1024 * 1024,
        ge=1024,
        description="Bytes (declared Content-Length) of the batch uploads being received at once per "
        "process; an upload that would pass it -> 429 + Retry-After.",
    )
    max_uploads_per_client: int = Field(
        3,
        ge=1,
        description="Batch uploads one client (its API key; without keys, its address) may have being "
        "received at once to one run per process (and at most max_concurrent_uploads - 1 across its runs), "
        "so one party cannot hold every upload slot; more -> 429.",
    )
    upload_min_rate: int = Field(
        256 * 1024,
        ge=1,
        description="Slowest average rate (bytes/s) a batch upload may arrive at after its first "
        "body_timeout seconds: a body is cut off (408) once it is behind body_timeout + received/rate.",
    )
    max_parsing_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        description="Weighted bytes of request bodies being received and parsed at once per process: a "
        "JSON body counts 8x its size (what parsing it costs in memory), a batch upload its size; a "
        "request that would pass it -> 429 + Retry-After (one is always admitted when none is in flight, "
        "and so is a body under 128 KiB). Each client (an API key the server has accepted, else the address) "
        "has a share, the limit / clients with bodies in flight: one already holding a body is refused one "
        "more past its share; "
        "one within its share is admitted while another client holds more than its own, up to 2x the limit.",
    )
    max_audit_tokens: int = Field(
        16 * 1024 * 1024,
        ge=1,
        description="Largest batch x response_len one audit may compute over (bounds its CPU); larger -> 413.",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a connection may take to send a request's headers before it is closed.",
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request body may pause between chunks; then 408."
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="Open connections per process (uvicorn limit_concurrency); a request on one more -> 503.",
    )
    max_json_depth: int = Field(
        64,
        ge=2,
        le=200,
        description="Deepest nesting of JSON objects/arrays accepted in a run's config and a batch's "
        "config/reported metadata; deeper -> 422 (so nothing stored is too deep to read back).",
    )
    max_run_config_bytes: int = Field(
        256 * 1024,
        ge=2,
        description="Largest run config (its JSON, in bytes) accepted by POST /api/v1/runs; larger -> 422. "
        "Tags are bounded by the schema: at most 100, of 200 characters each.",
    )
    max_steps_per_request: int = Field(
        100_000, ge=1, description="Most steps one POST /metrics may carry; more -> 413."
    )

    series_memory_points: int = Field(
        4_000_000,
        ge=0,
        description="Metric points kept in memory as columns for history queries (about 70 bytes each; "
        "0 disables). Extended by this process's ingest, checked against the run's data version, so "
        "answers always match the database.",
    )
    query_cache_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="In-process cache of encoded history answers (bytes; 0 disables). Entries are keyed "
        "by the run's data version, so they are never stale.",
    )

    # --- audits ----------------------------------------------------------------------------------
    audit_workers: int = Field(
        2,
        ge=0,
        le=64,
        description="Audit threads per server process (0: this replica only ingests), run in its audit "
        "worker process (see audit_process).",
    )
    audit_process: bool = Field(
        True,
        description="Run audits in a separate worker process that the server starts when the first audit "
        "is queued, restarts if it dies and takes down with it, so audits never take the request-serving "
        "process's CPU (false: audit threads inside the server process).",
    )
    audit_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="How much lower the audit worker process's CPU priority is than the server's (added "
        "to its nice value; 0: the same), so requests win the cores while audits wait.",
    )
    audit_queue_size: int = Field(
        64,
        ge=1,
        description="Most audit jobs waiting at once (all replicas); beyond it POST /batches -> 429. Each "
        "run with jobs waiting holds at most max(1, audit_queue_size // runs with jobs waiting) (-> 429); a "
        "run under its share is admitted while another holds more than its own, up to 2x the size.",
    )
    audit_poll_interval: float = Field(
        0.5,
        gt=0,
        le=60,
        description="Seconds between idle workers' checks for jobs queued by other replicas.",
    )
    audit_claim_timeout: float = Field(
        300.0, gt=0, description="Seconds after which a job claimed by a dead replica is handed out again."
    )
    audit_histograms: bool = Field(
        True,
        description="After each audit, store the importance-ratio and advantage histograms the "
        "dashboard's audits page draws (computed after the result is visible, so never delaying it).",
    )
    keep_batches: bool = Field(
        False, description="Keep uploaded tensors after their audit finished (default: drop them)."
    )

    # --- health rules ----------------------------------------------------------------------------
    rules: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Per-rule setting overrides, e.g. {"entropy_collapse": {"enabled": false}}.',
    )
    rules_file: Path | None = Field(
        None, description="JSON or YAML file with rule overrides (same shape as rules; rules wins)."
    )

    plugins: bool = Field(
        True,
        description="Load the losses, aggregation modes, KL and advantage estimators and health rules "
        "that installed packages declare as rlvitals.* entry points (docs/plugins.md).",
    )

    health_flush_interval: float = Field(
        1.0,
        gt=0,
        le=300,
        description="Seconds between housekeeping rounds (SQLite WAL checkpoints).",
    )
    health_spacing: float = Field(
        0.1,
        ge=0,
        le=10,
        description="Seconds a run's health rules wait after one evaluation before the next: under a "
        "steady stream of writes one evaluation takes every write of that spell (the rules' state is "
        "written once per evaluation), while the first write after a quiet spell is evaluated at once. "
        "Larger: less evaluation overhead, alerts up to this much later; 0: evaluate every write alone.",
    )
    health_wait: float = Field(
        2.0,
        ge=0,
        le=60,
        description="The health rules run after a metrics write has answered (within milliseconds); "
        "alert and incident reads, and a metrics write sent with ?wait=rules (a trainer that halts on "
        "critical incidents), wait at most this many seconds for them to reach the writes before.",
    )

    # --- alert delivery --------------------------------------------------------------------------
    webhook_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="URLs that receive every alert transition as JSON."
    )
    slack_webhook_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description='Slack-compatible incoming webhooks ({"text": ...}).'
    )
    webhook_info: bool = Field(
        False,
        description="Also send info alerts (e.g. pg_clipfrac below its band) to the webhooks; by default "
        "they are shown on the dashboard and in the API only.",
    )
    webhook_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds one webhook attempt may take in all (connect, send, answer); then it is "
        "cut off and retried.",
    )
    webhook_max_attempts: int = Field(8, ge=1, description="Attempts before a delivery is marked failed.")
    webhook_backoff: float = Field(0.5, gt=0, description="First retry delay (s); doubles each attempt.")
    webhook_backoff_max: float = Field(60.0, gt=0, description="Cap on the retry delay (s).")
    webhook_workers: int = Field(
        1,
        ge=0,
        le=32,
        description="Webhook sender threads per destination URL and process (0: this process sends none); "
        "each URL has its own, so a slow one delays only itself.",
    )
    webhook_rule_limit: int = Field(
        5,
        ge=0,
        description="Most alert notifications per (run, rule) in webhook_rule_window (0: no limit); the "
        "skipped ones are counted in the next notification sent.",
    )
    webhook_rule_window: float = Field(3600.0, gt=0, description="Seconds of webhook_rule_limit's window.")
    webhook_events: Literal["incidents", "alerts"] = Field(
        "incidents",
        description="What the webhooks announce: incidents (one notification when an incident opens, "
        "escalates, reopens or resolves; findings of one cause are grouped) or alerts (every alert "
        "transition, rate-limited per rule).",
    )
    incidents: dict[str, Any] = Field(
        default_factory=dict,
        description='Incident grouping and damping overrides, e.g. {"quiet_steps": 100} (hold_steps, '
        "hold_points, quiet_steps, quiet_points, reopen_steps, explained_share, truncated_share).",
    )
    gpus_per_run: float | None = Field(
        None,
        gt=0,
        description="GPUs a run uses, for the GPU-hours spent after an incident's onset (a run's own "
        'config["rlvitals"]["gpus"] wins); unset: only the hours are shown.',
    )
    webhook_per_minute: int = Field(
        30,
        ge=0,
        description="Most POSTs to one webhook URL per rolling minute, across runs and replicas (0: no "
        "limit); the notifications that would pass it are sent together in one digest once there is room.",
    )
    webhook_response_bytes: int = Field(
        64 * 1024,
        ge=0,
        description="Most bytes of a webhook receiver's answer read (and discarded; never decompressed); "
        "the connection is closed after them.",
    )

    # --- live events -----------------------------------------------------------------------------
    sse_heartbeat: float = Field(15.0, gt=0, description="Seconds between SSE keep-alive comments.")
    sse_queue_size: int = Field(
        1000, ge=1, description="Events buffered per SSE client; a slower client is disconnected."
    )

    log_level: str = Field("info", description="Log level of uvicorn and of the server's own messages.")
    access_log: bool = Field(False, description="Log every request (uvicorn access log; costs ingest speed).")

    @field_validator("webhook_urls", "slack_webhook_urls", "allowed_hosts", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        # Accept "a,b" as well as a JSON list from the environment.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("database_url")
    @classmethod
    def _psycopg_for_postgresql(cls, value: str | None) -> str | None:
        # libpq's and Heroku's spellings mean psycopg2 to SQLAlchemy; the server extra installs psycopg 3.
        scheme, sep, rest = (value or "").partition("://")
        if sep and scheme in ("postgres", "postgresql"):
            return f"postgresql+psycopg://{rest}"
        return value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'rlvitals.db').resolve()}"

    @property
    def host_is_loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def reads_need_key(self) -> bool:
        if self.require_key_for_reads is not None:
            return self.require_key_for_reads
        return not self.host_is_loopback


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
