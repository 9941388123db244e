"""rlvitals.client: the trainer-side hook. ``init`` a run, ``log`` scalars, ``log_batch`` loss tensors, ``finish``.

Light by design: no web stack, no database, and torch/numpy only when the caller passes their objects.
Nothing here raises on server, network or disk trouble (it warns once, spools, retries and counts);
wrong arguments raise at once.

The names below load on first use, so importing one submodule (``rlvitals.client.cli`` when the
``rlvitals`` command starts, ``rlvitals.client.history``) does not load the sender and httpx with it:
``rlvitals serve`` would otherwise keep ~10 MiB of client it never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlvitals.client.problems import ClientWarning
    from rlvitals.client.run import FinishReport, Lifecycle, Run, detect_rank, finish, init
    from rlvitals.client.settings import (
        DEFAULT_FINISH_TIMEOUT,
        DEFAULT_TIMEOUT,
        ClientSettings,
        RetryPolicy,
        default_spool_dir,
    )

_EXPORTS = {
    "ClientWarning": "rlvitals.client.problems",
    "FinishReport": "rlvitals.client.run",
    "Lifecycle": "rlvitals.client.run",
    "Run": "rlvitals.client.run",
    "detect_rank": "rlvitals.client.run",
    "finish": "rlvitals.client.run",
    "init": "rlvitals.client.run",
    "DEFAULT_FINISH_TIMEOUT": "rlvitals.client.settings",
    "DEFAULT_TIMEOUT": "rlvitals.client.settings",
    "ClientSettings": "rlvitals.client.settings",
    "RetryPolicy": "rlvitals.client.settings",
    "default_spool_dir": "rlvitals.client.settings",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlvitals.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
