"""rlvitals.client: the trainer-side hook. ``init`` a run, ``log`` scalars, ``log_batch`` loss tensors, ``finish``.

Light by design: no web stack, no database, and torch/numpy only when the caller passes their objects.
Nothing here raises on server, network or disk trouble (it warns once, spools, retries and counts);
wrong arguments raise at once.
"""

from __future__ import annotations

from rlvitals.client.problems import ClientWarning
from rlvitals.client.run import FinishReport, Lifecycle, Run, detect_rank, finish, init
from rlvitals.client.settings import (
    DEFAULT_FINISH_TIMEOUT,
    DEFAULT_TIMEOUT,
    ClientSettings,
    RetryPolicy,
    default_spool_dir,
)

__all__ = [
    "DEFAULT_FINISH_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "ClientSettings",
    "ClientWarning",
    "FinishReport",
    "Lifecycle",
    "RetryPolicy",
    "Run",
    "default_spool_dir",
    "detect_rank",
    "finish",
    "init",
]
