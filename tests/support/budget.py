"""How many examples the fuzzers and the big property tests draw.

``make test`` (and so CI) draws each one's full budget. ``make test-fast``, the edit–test loop, sets
``RLVITALS_TEST_EXAMPLES=0.25`` and draws a quarter of it (never fewer than ``floor``): the same
derandomized strategies, fewer examples. Any fraction in (0, 1] works; unset or 1 is the full budget.
"""

from __future__ import annotations

import os


def examples(full: int, floor: int = 10) -> int:
    """``full`` scaled by ``RLVITALS_TEST_EXAMPLES`` (a fraction in (0, 1]), at least ``floor``."""
    raw = os.environ.get("RLVITALS_TEST_EXAMPLES", "").strip()
    if not raw:
        return full
    share = float(raw)
    if not 0 < share <= 1:
        raise ValueError(f"RLVITALS_TEST_EXAMPLES must be a fraction in (0, 1], not {raw!r}")
    return max(min(floor, full), round(full * share))
