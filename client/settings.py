"""The client's knobs as value objects, with their defaults in one place.

``ClientSettings`` is frozen and validated in ``__post_init__``; ``rlvitals.init(settings=...)`` takes one,
and a few common knobs (``batch_every``) are also plain ``init`` keywords. Environment variables are read
only when ``init`` runs (``RLVITALS_URL``, ``RLVITALS_API_KEY``, ``RLVITALS_SPOOL_DIR``), never at import.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 15.0  # seconds per request: a server answering in 2 s is slow, not down
DEFAULT_CONNECT_TIMEOUT = 3.0
DEFAULT_INIT_TIMEOUT = 5.0  # how long init() waits for the server before carrying on in the background
DEFAULT_FINISH_TIMEOUT = 30.0


def default_spool_dir() -> Path:
    """``RLVITALS_SPOOL_DIR`` or ``~/.rlvitals/spool``."""
    env = os.environ.get("RLVITALS_SPOOL_DIR")
    if env:
        return Path(env).expanduser()
    try:
        return Path.home() / ".rlvitals" / "spool"
    except RuntimeError:  # no home directory (some containers): the temp dir still works
        import tempfile

        return Path(tempfile.gettempdir()) / "rlvitals-spool"


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with jitter: ``min(maximum, initial * multiplier**attempt) * U(1-j, 1+j)``.

    A server's ``Retry-After`` (429/503) raises the wait to at least that many seconds, still capped at
    ``max_retry_after``.
    """

    initial: float = 0.2
    multiplier: float = 2.0
    maximum: float = 10.0
    jitter: float = 0.2
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.maximum < self.initial:
            raise ValueError(
                f"need 0 < initial <= maximum, got initial={self.initial} maximum={self.maximum}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        base = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        wait = base * random.uniform(1 - self.jitter, 1 + self.jitter)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_retry_after))
        return wait


@dataclass(frozen=True)
class ClientSettings:
    """How the client batches, bounds memory, samples tensor batches and talks to the server.

    - ``flush_interval``: seconds between background drains of the log queue.
    - ``max_steps_per_request``: step records coalesced into one ``POST .../metrics``.
    - ``max_memory_points``: scalar values held in memory awaiting send; beyond it they spool to disk.
    - ``max_memory_batch_bytes``: tensor-batch bytes held in memory; beyond it they spool to disk.
    - ``max_spool_bytes``: the spool's own cap; a batch beyond it is dropped (counted), scalars still try.
    - ``batch_every``: capture a tensor batch on steps where ``step % batch_every == 0``.
    - ``batch_micro_batches``: ``"first"`` (first ``log_batch`` call of a sampled step) or ``"all"``.
    - ``scalars_all_ranks`` / ``batches_all_ranks``: which ranks send (default: scalars from rank 0 only,
      audit batches from every rank).
    - ``halt_on``: opt in to stopping on a critical incident: ``("critical",)`` for any, or the causes /
      rules whose critical incidents stop the run (``("non_finite", "collapse")``); ``run.should_stop()``
      turns true at the first step boundary after the server reports one (docs/incidents.md).
    - ``halt_wait``: with ``halt_on``, the most seconds ``should_stop()`` waits for the server's answer to
      the steps logged so far (a sender running behind would stop the run steps late); 0: never wait.
    - ``gil_switch_interval``: while a run is open, ``sys.setswitchinterval`` is lowered to this (if it is
      higher; CPython's default is 5 ms) so the client's background threads can never keep the trainer's
      thread waiting for the GIL longer than that. ``None`` leaves the interpreter alone.
    """

    timeout: float = DEFAULT_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    init_timeout: float = DEFAULT_INIT_TIMEOUT
    flush_interval: float = 0.2
    max_steps_per_request: int = 1000
    max_memory_points: int = 500_000
    max_memory_batch_bytes: int = 256 * 2**20
    max_spool_bytes: int = 10 * 2**30
    batch_every: int = 10
    batch_micro_batches: str = "first"
    scalars_all_ranks: bool = False
    batches_all_ranks: bool = True
    gil_switch_interval: float | None = 0.0005
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    halt_on: tuple[str, ...] = ()
    halt_wait: float = 2.0

    def halts_on(self, incident: dict) -> bool:
        """Whether this open critical incident (the server's short form) should stop the run."""
        wanted = self.halt_on
        return bool(wanted) and (
            "critical" in wanted or incident.get("cause") in wanted or incident.get("primary_rule") in wanted
        )

    def __post_init__(self) -> None:
        for name in ("timeout", "connect_timeout", "flush_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.init_timeout < 0:
            raise ValueError(f"init_timeout must be >= 0, got {self.init_timeout}")
        if not self.halt_wait >= 0:
            raise ValueError(f"halt_wait must be >= 0, got {self.halt_wait}")
        for name in ("max_steps_per_request", "max_memory_points", "batch_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.max_memory_batch_bytes < 0 or self.max_spool_bytes < 0:
            raise ValueError("byte limits must be >= 0")
        if self.batch_micro_batches not in ("first", "all"):
            raise ValueError(
                f"batch_micro_batches must be 'first' or 'all', got {self.batch_micro_batches!r}"
            )
        if self.gil_switch_interval is not None and not 0 < self.gil_switch_interval <= 0.1:
            raise ValueError(
                f"gil_switch_interval must be in (0, 0.1] s or None, got {self.gil_switch_interval}"
            )
        if not isinstance(self.retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {type(self.retry).__name__}")
        halt_on = (self.halt_on,) if isinstance(self.halt_on, str) else self.halt_on
        if not isinstance(halt_on, (tuple, list, set, frozenset)) or not all(
            isinstance(x, str) and x for x in halt_on
        ):
            raise TypeError(f"halt_on must be a tuple of non-empty strings, got {self.halt_on!r}")
        object.__setattr__(self, "halt_on", tuple(halt_on))
