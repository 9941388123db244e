"""Infrastructure trouble, as the trainer sees it: never an exception, one warning per kind, always counted.

Each kind is shown once, as one line: a WARNING record on the ``rlvitals.client`` logger (Python prints
it to stderr when logging is not configured; a trainer that configures logging gets it in its own format).
The same message is also issued as a ``ClientWarning``, which is ignored unless a filter asks for it:
``warnings.simplefilter("error", ClientWarning)`` or ``pytest.warns`` catch it, and nothing prints twice.
Repeats are logged at DEBUG; every occurrence is counted and the last few kept for ``finish()``'s report.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import deque

logger = logging.getLogger("rlvitals.client")


class ClientWarning(RuntimeWarning):
    """The server, network or disk misbehaved; the client carried on (the message says how)."""


# Lowest priority (append): any filter the user or pytest sets (-W, simplefilter, filterwarnings)
# comes first and wins; by default the log line is the one thing printed.
warnings.filterwarnings("ignore", category=ClientWarning, append=True)


class Problems:
    """Counts problems by kind; warns the first time each kind happens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.counts: dict[str, int] = {}
        self.recent: deque[str] = deque(maxlen=20)

    def report(self, kind: str, operation: str, cause: str, next_step: str) -> None:
        """Count a failure of ``operation``; the first of its ``kind`` warns (cause, and what happens next)."""
        self.warn(kind, f"rlvitals: {operation} failed: {cause}; {next_step}")

    def warn(self, kind: str, message: str) -> None:
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.recent.append(message)
            first = kind not in self._warned
            self._warned.add(kind)
        if not first:
            logger.debug(message)
            return
        logger.warning(message)
        # A warnings filter set to "error" must not turn trouble into an exception in the trainer.
        with contextlib.suppress(Exception):
            warnings.warn(message, ClientWarning, stacklevel=2)
