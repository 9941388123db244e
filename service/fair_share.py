"""The fair-share rule of the budgets several parties draw on at once: batch-upload slots
(``UploadGate``: clients), the bytes being parsed (``ParseGate``: clients), the audit queue
(``AuditPool``: runs).

Each party holding some of a budget has a fair share of it, ``limit // parties`` (the asking party
counted). A party already holding some is refused a request that would take it past its share (where
the budget caps shares); and a request past the limit is refused, except that one that fits the
asker's share is still admitted while another party holds more than its own share (it took the
budget before this one came), up to twice the limit. Pure: the callers hold the counts and word the
refusals.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple

OVER_SHARE = "over its share"
OVER_LIMIT = "over the limit"


class FairShare(NamedTuple):
    """A decision and the numbers it was made on (what a refusal reports)."""

    refused: str | None  # None (admitted), OVER_SHARE or OVER_LIMIT
    share: int  # each party's share: limit // parties, at least min_share
    parties: int  # the parties holding some, the asking one counted
    mine: int  # what the asking party holds
    total: int  # what all parties hold


def fair_share(
    limit: int,
    holdings: Mapping[Hashable, int],
    party: Hashable,
    size: int,
    *,
    cap_share: bool = True,
    min_share: int = 1,
) -> FairShare:
    """Whether ``party`` may take ``size`` more of a budget of ``limit``, ``holdings`` being what every
    party holds now (``party`` among them or not). ``cap_share``: a party already holding some is
    refused a request past its share while another party holds some (``OVER_SHARE``); without it only
    the limit refuses. ``min_share``: the smallest share (one slot or one job; bytes need none)."""
    mine = holdings.get(party, 0)
    total = sum(holdings.values())
    parties = len(holdings.keys() | {party})
    share = max(min_share, limit // parties)
    refused = None
    if cap_share and mine and parties > 1 and mine + size > share:
        refused = OVER_SHARE
    elif total + size > limit and not (
        total + size <= 2 * limit
        and mine + size <= share
        and any(held > share for other, held in holdings.items() if other != party)
    ):
        refused = OVER_LIMIT
    return FairShare(refused, share, parties, mine, total)
