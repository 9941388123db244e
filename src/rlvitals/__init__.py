"""rlvitals: training-health diagnostics for PPO/GRPO trainers.

``import rlvitals`` gives the client API (``rlvitals.init``); the engine lives in
``rlvitals.analyzers`` and the server in ``rlvitals.service`` (``pip install 'rlvitals[server]'``).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_CLIENT_EXPORTS = ("init", "Run", "finish")


def __getattr__(name: str) -> Any:
    # Lazy so `import rlvitals.analyzers` never pays for the client's imports.
    if name in _CLIENT_EXPORTS:
        from rlvitals import client

        return getattr(client, name)
    raise AttributeError(f"module 'rlvitals' has no attribute {name!r}")
