"""One fair-share rule (``service.fair_share``) decides for the upload slots (``UploadGate``), the bytes
being parsed (``ParseGate``) and the audit queue (``AuditPool._admit``): each gate refuses exactly what
it refused when it carried its own copy of the rule, with the same message and detail. The oracles below
are those copies, as they were."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlvitals.service.api.limits import SMALL_BODY, ParseGate, UploadGate
from rlvitals.service.audits import AuditPool
from rlvitals.service.errors import Busy
from rlvitals.service.fair_share import OVER_LIMIT, OVER_SHARE, fair_share

from tests.support.budget import examples

PROPERTY = settings(
    max_examples=examples(1500, floor=200),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PARTIES = ("a", "b", "c", "d")


# ---------------------------------------------------------------- the oracles: the three old copies


def old_upload(max_uploads, per_client, held, client, run):
    """UploadGate.admit's refusals (count checks) before the shared rule."""
    per_client = per_client or max_uploads
    per_party = max(1, max_uploads - 1)
    uploads = sum(held.values())
    mine = held.get((client, run), 0)
    party = sum(n for (who, _), n in held.items() if who == client)
    if mine >= per_client or party >= per_party:
        limit = per_client if mine >= per_client else per_party
        return (
            f"this client has {party} batch uploads being received ({mine} to this run); the limit is "
            f"{per_client} per run (max_uploads_per_client) and {per_party} in all "
            "(max_concurrent_uploads - 1): retry shortly",
            {"uploads": party, "run_uploads": mine, "limit": limit},
        )

    def crowded_out():
        if uploads >= 2 * max_uploads:
            return False
        by_party: dict[str, int] = {}
        for (who, _), n in held.items():
            by_party[who] = by_party.get(who, 0) + n
        share = max(1, max_uploads // len(by_party.keys() | {client}))
        return party < share and any(n > share for who, n in by_party.items() if who != client)

    if uploads >= max_uploads and not crowded_out():
        return (
            f"{uploads} batch uploads are being received; the limit is {max_uploads} "
            "(max_concurrent_uploads): retry shortly",
            {"uploads": uploads, "limit": max_uploads},
        )
    return None


def old_parse(limit, clients, nbytes, client):
    """ParseGate._refusal before the shared rule."""
    held = sum(clients.values())
    if nbytes <= SMALL_BODY or not held:
        return None
    mine = clients.get(client, 0)
    parties = len(clients.keys() | {client})
    share = limit // parties
    if mine and parties > 1 and mine + nbytes > share:
        return (
            f"this client's request bodies of {mine} (weighted) bytes are being parsed; {nbytes} more "
            f"would pass its share of max_parsing_bytes ({share} of {limit}, shared by {parties} "
            "clients): retry shortly",
            {"held": held, "limit": limit, "request": nbytes, "client_held": mine, "client_share": share},
        )
    if held + nbytes > limit:
        crowded = any(n > share for other, n in clients.items() if other != client)
        if not (crowded and mine + nbytes <= share and held + nbytes <= 2 * limit):
            return (
                f"request bodies of {held} (weighted) bytes are being parsed; {nbytes} more would "
                f"pass the limit of {limit} (max_parsing_bytes): retry shortly",
                {"held": held, "limit": limit, "request": nbytes},
            )
    return None


def old_audit(size, waiting, run_id):
    """AuditPool._admit before the shared rule."""
    total, mine = sum(waiting.values()), waiting.get(run_id, 0)
    runs = len(waiting.keys() | {run_id})
    share = max(1, size // runs)
    if mine >= share and runs > 1:
        return (
            f"this run holds its share of the audit queue ({mine} of its batches waiting; each of the "
            f"{runs} runs with audits waiting may hold {share} of audit_queue_size {size}); retry later",
            {"waiting": total, "limit": size, "run_waiting": mine, "run_share": share},
        )
    crowded = any(count > share for other, count in waiting.items() if other != run_id)
    if total >= size and not (crowded and total < 2 * size):
        return (
            f"audit queue is full ({total} batches waiting); retry later",
            {"waiting": total, "limit": size},
        )
    return None


# ---------------------------------------------------------------- the gates now


def new_upload(max_uploads, per_client, held, client, run):
    gate = UploadGate(max_uploads=max_uploads, max_bytes=1 << 40, per_client=per_client)
    gate.held = dict(held)
    gate.uploads = sum(held.values())
    try:
        with gate.admit(0, client, run):
            assert gate.held[(client, run)] == held.get((client, run), 0) + 1
    except Busy as refusal:
        return refusal.message, refusal.detail
    assert gate.held == held and gate.uploads == sum(held.values())
    return None


def new_parse(limit, clients, nbytes, client):
    gate = ParseGate(limit=limit)
    gate.clients = dict(clients)
    gate.held = sum(clients.values())
    refusal = gate.try_hold(nbytes, client)
    if refusal is None:
        assert gate.clients[client] == clients.get(client, 0) + nbytes
        return None
    assert gate.clients == clients  # nothing held on a refusal
    return refusal.message, refusal.detail


def new_audit(size, waiting, run_id):
    counted = []
    pool = SimpleNamespace(
        settings=SimpleNamespace(audit_queue_size=size),
        telemetry=SimpleNamespace(count_batch=counted.append),
    )
    try:
        AuditPool._admit(pool, run_id, waiting)
    except Busy as refusal:
        assert counted == ["queue_full"] and refusal.headers == {"Retry-After": "1"}
        return refusal.message, refusal.detail
    assert counted == []
    return None


def holdings(keys, most):
    return st.dictionaries(keys, st.integers(1, most), max_size=4)


# ---------------------------------------------------------------- properties


@PROPERTY
@given(
    max_uploads=st.integers(1, 8),
    per_client=st.one_of(st.none(), st.integers(1, 8)),
    held=holdings(st.tuples(st.sampled_from(PARTIES), st.integers(0, 2)), 6),
    client=st.sampled_from(PARTIES),
    run=st.integers(0, 2),
)
def test_upload_slots_are_refused_as_before(max_uploads, per_client, held, client, run):
    assert new_upload(max_uploads, per_client, held, client, run) == old_upload(
        max_uploads, per_client, held, client, run
    )


@PROPERTY
@given(
    limit=st.integers(1024, 40 * SMALL_BODY),
    clients=holdings(st.sampled_from(PARTIES), 30 * SMALL_BODY),
    nbytes=st.one_of(st.integers(1, 2 * SMALL_BODY), st.integers(1, 40 * SMALL_BODY)),
    client=st.sampled_from(PARTIES),
)
def test_parse_bytes_are_refused_as_before(limit, clients, nbytes, client):
    assert new_parse(limit, clients, nbytes, client) == old_parse(limit, clients, nbytes, client)


@PROPERTY
@given(
    limit=st.integers(0, 6),
    clients=holdings(st.sampled_from(PARTIES), 3),
    nbytes=st.integers(1, 3),
    client=st.sampled_from(PARTIES),
)
def test_parse_bytes_are_refused_as_before_with_shares_of_a_few_bytes(limit, clients, nbytes, client):
    """Budgets of a few bytes, shares of 0 among them (a body past SMALL_BODY, held ones too)."""
    scaled = {who: n * SMALL_BODY for who, n in clients.items()}
    args = (limit, scaled, nbytes * SMALL_BODY + 1, client)
    assert new_parse(*args) == old_parse(*args)


@PROPERTY
@given(
    size=st.integers(1, 10),
    waiting=holdings(st.integers(1, 4), 14),
    run_id=st.integers(1, 4),
)
def test_audit_queue_places_are_refused_as_before(size, waiting, run_id):
    assert new_audit(size, waiting, run_id) == old_audit(size, waiting, run_id)


@pytest.mark.parametrize(
    ("limit", "holdings", "party", "size", "options", "refused", "share"),
    [
        (4, {}, "a", 1, {}, None, 4),  # alone: the whole budget
        (4, {"a": 4}, "a", 1, {}, OVER_LIMIT, 4),  # alone, no share to exceed: the plain limit
        (4, {"a": 1, "b": 1}, "a", 2, {}, OVER_SHARE, 2),  # holding some, past its share of 4 // 2
        (4, {"a": 1, "b": 1}, "a", 2, {"cap_share": False}, None, 2),  # uncapped: fits the limit
        (4, {"b": 4}, "a", 2, {}, None, 2),  # b took more than its share first: a gets its own
        (4, {"b": 4}, "a", 3, {}, OVER_LIMIT, 2),  # ... but not past it
        (4, {"b": 7}, "a", 2, {}, OVER_LIMIT, 2),  # ... nor past twice the limit
        (4, {"b": 2, "c": 2}, "b", 1, {"cap_share": False}, OVER_LIMIT, 2),  # nobody over: the limit
        (2, {"b": 1, "c": 1, "d": 1}, "a", 1, {}, OVER_LIMIT, 1),  # shares of at least one
        (2, {"b": 1, "c": 1, "d": 1}, "a", 1, {"min_share": 0}, OVER_LIMIT, 0),  # or none
    ],
)
def test_the_rule_on_its_own(limit, holdings, party, size, options, refused, share):
    decision = fair_share(limit, holdings, party, size, **options)
    assert (decision.refused, decision.share) == (refused, share)
    assert decision.mine == holdings.get(party, 0) and decision.total == sum(holdings.values())
    assert decision.parties == len(holdings.keys() | {party})
