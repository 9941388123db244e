"""Metric points: ingest (one transaction: points, the health feed's row, live events; the health rules
run after the commit, in ``service/evaluator.py``) and queries with spike-preserving downsampling."""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections.abc import Iterator
from typing import Any

import orjson
from rlvitals.analyzers.contract.batch_rules import NAN, NON_FINITE, spell
from rlvitals.service import series_format
from rlvitals.service.context import Services
from rlvitals.service.encoding import encode_float
from rlvitals.service.errors import NotFound, PayloadTooLarge
from rlvitals.service.events import Event
from rlvitals.service.incidents import open_critical
from rlvitals.service.schemas import StepIn
from rlvitals.service.storage import repository as repo
from rlvitals.service.workers import release_memory

_SPELLED = NON_FINITE  # the contract's one spelling table
_NAN_FLAG = 1


def _decode(value: float | str | None) -> float | None:
    if value is None or value.__class__ is float:
        return value
    if isinstance(value, str):
        return _SPELLED[value]
    return float(value)


def ingest_many(
    ctx: Services, items: list[tuple[int, list[StepIn]]], *, write=None
) -> list[dict[str, int] | Exception]:
    """Store the points of several requests in one transaction (group commit): insert-or-ignore,
    one health feed row per request (the evaluator's work), emit the points' live events. One outcome per item, in order:
    ``{"accepted": points, "steps": steps}``, or the exception it alone would have raised
    (``NotFound`` for an unknown run, ``PayloadTooLarge`` past ``max_steps_per_request``).

    An unknown run or an oversized request fails only its own item. Any other failure (the database)
    rolls the whole group back, and each item is then tried alone, so a request never fails because
    another one shared its transaction. ``write`` is the transaction to use (default
    ``ctx.db.write``; the writer thread passes its ``HeldWriter``'s). Items are written in run-id order (a stable sort: one run's
    requests keep their order), so replicas that lock several runs' rows always lock them in the same
    order and never deadlock on each other.
    """
    started = time.perf_counter()
    outcomes: list[dict[str, int] | Exception | None] = [None] * len(items)
    prepared: list[_Prepared] = []
    max_points = ctx.settings.max_points_per_request
    for index, (run_id, steps) in enumerate(items):
        if len(steps) > ctx.settings.max_steps_per_request:
            outcomes[index] = PayloadTooLarge(
                f"{len(steps)} steps in one request; the limit is {ctx.settings.max_steps_per_request}",
                detail={"limit": ctx.settings.max_steps_per_request},
            )
        elif (n := sum(len(s.metrics) for s in steps)) > max_points:
            outcomes[index] = PayloadTooLarge(
                f"{n} points in one request; the limit is {max_points} (max_points_per_request)",
                detail={"limit": max_points},
            )
        else:
            prepared.append(_prepare(index, run_id, steps))
    prepared.sort(key=lambda p: p.run_id)
    write = write or ctx.db.write
    if len(prepared) > 1:
        try:
            _publish(ctx, _write(ctx, write, prepared, outcomes), outcomes, started)
            return outcomes  # type: ignore[return-value]
        except Exception:
            pass  # rolled back: each alone below
    for p in prepared:
        try:
            stored = _write(ctx, write, [p], outcomes)
        except Exception as exc:
            outcomes[p.index] = exc
        else:
            _publish(ctx, stored, outcomes, started)
    return outcomes  # type: ignore[return-value]


class _Prepared:
    """One request's points, decoded and arranged for storage and for the health rules."""

    __slots__ = ("by_step", "index", "newest", "ordered", "rows", "run_id", "wall")

    def __init__(self, index, run_id, rows, by_step, wall, ordered):
        self.index, self.run_id, self.rows, self.by_step, self.wall = index, run_id, rows, by_step, wall
        self.ordered = ordered
        self.newest = ordered[-1] if ordered else None


def _prepare(index: int, run_id: int, steps: list[StepIn]) -> _Prepared:
    rows: list[tuple] = []
    by_step: dict[int, dict[str, float | None]] = {}
    wall: dict[int, float | None] = {}
    for item in steps:
        step, wall_time = item.step, item.wall_time
        decoded = by_step.setdefault(step, {})
        wall.setdefault(step, wall_time)
        for name, raw in item.metrics.items():
            value = raw if raw is None or raw.__class__ is float else _decode(raw)
            decoded.setdefault(name, value)  # a step sent twice in one request: the first is stored
            if value is not None and value != value:
                rows.append((run_id, name, step, None, _NAN_FLAG, wall_time))
            else:
                rows.append((run_id, name, step, value, 0, wall_time))
    return _Prepared(index, run_id, rows, by_step, wall, sorted(by_step))


def _fresh_names(ctx: Services, p: _Prepared) -> set[str] | None:
    """The request's names this process has not seen on the run (``None``: it knows none yet)."""
    known = ctx.run_names.get(p.run_id)
    if known is None:
        return None
    return {name for metrics in p.by_step.values() for name in metrics if name not in known}


def _check_names(ctx: Services, session, p: _Prepared) -> None:
    """Refuse (413) points that would give the run more than ``max_metric_names_per_run`` names.
    Counted in the database: when the request brings names this process has not seen on the run,
    the run's names are read again, after the caller's update of the run's row (a row lock every
    writer of the run takes, on every replica), so two replicas cannot each add up to the limit.
    A request with only known names costs no query."""
    limit = ctx.settings.max_metric_names_per_run
    if not limit:
        return
    fresh = _fresh_names(ctx, p)
    if fresh is None or fresh:
        ctx.run_names[p.run_id] = set(repo.metric_names(session=session, run_id=p.run_id))
        fresh = _fresh_names(ctx, p)
    known = ctx.run_names[p.run_id]
    if fresh and len(known) + len(fresh) > limit:
        raise PayloadTooLarge(
            f"run {p.run_id} would have {len(known) + len(fresh)} metric names; the limit is {limit} "
            "(max_metric_names_per_run): names are for metrics, not for ids or values",
            detail={"limit": limit, "run_names": len(known), "new_names": len(fresh)},
        )
    known |= fresh


class _Stored:
    __slots__ = ("events", "feed", "prepared", "version")

    def __init__(self, prepared, version, events, feed):
        self.prepared, self.version, self.events, self.feed = prepared, version, events, feed


def _write(ctx: Services, write, group: list[_Prepared], outcomes: list) -> list[_Stored]:
    """Write ``group`` in one transaction; raises (after rolling back) when it fails. An unknown
    run's outcome becomes ``NotFound``, with nothing written for it."""
    now = time.time()
    stored: list[_Stored] = []
    with write() as session:
        for p in group:
            done = _store(ctx, session, p, now)
            if done is None:
                outcomes[p.index] = NotFound(f"run {p.run_id} does not exist")
            else:
                stored.append(done)
    return stored


def _publish(ctx: Services, stored: list[_Stored], outcomes: list, started: float) -> None:
    """After the commit: the in-memory history columns, live events, the health evaluator, telemetry."""
    fed: list[int] = []
    for done in stored:
        p = done.prepared
        if done.version is not None:
            ctx.columns.extend(p.run_id, done.version, _column_rows(p.rows, ctx.db.is_sqlite))
        ctx.bus.flush(done.events)
        ctx.telemetry.observe_ingest(points=len(p.rows), seconds=time.perf_counter() - started)
        outcomes[p.index] = Accepted(accepted=len(p.rows), steps=len(p.ordered))
        outcomes[p.index].feed = done.feed
        if done.feed is not None:
            fed.append(p.run_id)
            if ctx.evaluator is not None:
                ctx.evaluator.offer(done.feed, p.by_step, p.wall, len(p.rows))
    if fed and ctx.evaluator is not None:
        ctx.evaluator.wake(fed)


class Accepted(dict):
    """A write's outcome, ``{"accepted": points, "steps": steps}``; ``feed``: its health feed row
    (``None``: nothing for the rules), what ``?wait=rules`` waits for."""

    feed: int | None = None


def answer(ctx: Services, run_id: int, outcome: dict[str, Any], *, wait_rules: bool) -> dict[str, Any]:
    """A write's answer. With ``wait_rules`` (blocking: call it in a worker thread), once the health
    rules evaluated its points (at most ``health_wait`` seconds): ``evaluated`` says whether they
    did, ``critical_incidents`` lists the run's open critical incidents (a halting trainer's answer)."""
    feed = getattr(outcome, "feed", None)
    if not wait_rules:
        return outcome
    outcome = dict(outcome)
    outcome["evaluated"] = ctx.evaluator is None or ctx.evaluator.wait(
        through=feed, run_id=run_id, timeout=ctx.settings.health_wait
    )
    with ctx.db.read() as session:
        critical = open_critical(session=session, run_id=run_id)
    if critical:
        outcome["critical_incidents"] = critical
    return outcome


def _store(ctx: Services, session, p: _Prepared, now: float) -> _Stored | None:
    """One request's share of the transaction: the run's row, the points and the health feed's row
    (the rules run later, on what was committed: service/evaluator.py). ``None`` (nothing written)
    when the run is unknown."""
    run_id, newest = p.run_id, p.newest
    version: int | None = None
    feed: int | None = None
    names = orjson.dumps(sorted({name for _, name, *_ in p.rows})).decode() if p.rows else None
    if newest is not None and ctx.db.is_postgresql and names is not None:
        # One round trip for the run's row, the feed row and, once this process knows the run's
        # metric names, the points (the names are checked first then: a refusal rolls the whole
        # transaction back, whatever order it was written in).
        names_known = not ctx.settings.max_metric_names_per_run or _fresh_names(ctx, p) == set()
        advanced = repo.advance_run_fed(
            session=session,
            run_id=run_id,
            first_step=p.ordered[0],
            last_step=newest,
            names=names,
            now=now,
            rows=p.rows if names_known else None,
        )
        if advanced is None:
            return None
        feed = advanced[1]
        if ctx.columns is not None and ctx.columns.holds(run_id):
            version = advanced[0]
        if not names_known:
            _check_names(ctx, session, p)
            repo.add_points(session=session, rows=p.rows)
    else:
        if newest is not None:
            exists = repo.advance_run(session=session, run_id=run_id, last_step=newest, now=now)
            if exists and ctx.columns is not None and ctx.columns.holds(run_id):
                version = repo.data_version(session=session, run_id=run_id)
        else:
            exists = repo.run_exists(session=session, run_id=run_id)
        if not exists:
            return None
        _check_names(ctx, session, p)
        repo.add_points(session=session, rows=p.rows)
        if names is not None:
            feed = repo.add_feed(
                session=session,
                run_id=run_id,
                first_step=p.ordered[0],
                last_step=newest,
                names=names,
                now=now,
            )
    events: list[Event] = []
    if p.rows and ctx.bus.wants(run_id):
        events.append(Event(run_id, "points", _points_event(run_id, p.ordered, p.by_step, p.wall)))
        ctx.bus.stage(session=session, events=events)
    return _Stored(p, version, events, feed)


def _column_rows(rows: list[tuple], sqlite: bool):
    """Stored rows as ``(name, step, value)`` the way a history query reads them back."""
    for _, name, step, value, flag, _ in rows:
        if value is None:
            yield name, step, (NAN if flag else None)
        elif value == 0.0:
            yield name, step, (0.0 if sqlite else value)  # SQLite stores -0.0 as 0.0
        elif value - value != 0.0:
            yield name, step, spell(value)
        else:
            yield name, step, value


def _points_event(run_id, ordered, by_step, wall) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "steps": [{"step": s, "metrics": by_step[s], "wall_time": wall[s]} for s in ordered],
    }


# --- queries --------------------------------------------------------------------------------------


def _query(
    session,
    run_id: int,
    names: list[str] | None,
    max_points: int,
    columns=None,
    version: int | None = None,
    *,
    start: int | None = None,
    end: int | None = None,
    wall_time: bool = False,
) -> dict[str, Any]:
    return {"series": dict(_query_series(session, run_id, names, max_points, columns, version,
                                         start=start, end=end, wall_time=wall_time))}  # fmt: skip


def _query_series(
    session,
    run_id: int,
    names: list[str] | None,
    max_points: int,
    columns=None,
    version: int | None = None,
    *,
    start: int | None = None,
    end: int | None = None,
    wall_time: bool = False,
    arrays: bool = False,
) -> Iterator[tuple[str, dict[str, list]]]:
    """``(name, {"step", "value"[, "wall_time"]})`` one series at a time: a reader that encodes each
    before asking for the next never holds more than one series as Python objects (a 20,000-step,
    12-metric answer peaked ~20 MB higher when every series was built first). ``arrays`` (the
    binary answer): a series the in-memory columns hold, not downsampled, comes as ``{"step":
    array('q'), "value": array('d'), "odd": {position: value that is not a float}}``."""
    if names is None:
        names = repo.metric_names(session=session, run_id=run_id)
    ranged = start is not None or end is not None
    for name in dict.fromkeys(names):  # a name asked for twice is answered once
        held = None
        if arrays and columns is not None and not wall_time:
            found = columns.get_arrays(run_id, version, name)
            if found is None:  # read it into the columns, then copy it out as arrays
                held = repo.series_columns(session=session, run_id=run_id, names=[name])
                columns.put(run_id, version, held)
                found = columns.get_arrays(run_id, version, name)
            if found is not None:
                steps, values, odd = found
                if ranged:
                    lo = 0 if start is None else bisect.bisect_left(steps, start)
                    hi = len(steps) if end is None else bisect.bisect_right(steps, end)
                    steps, values = steps[lo:hi], values[lo:hi]
                    odd = {at - lo: value for at, value in odd.items() if lo <= at < hi}
                if not max_points or len(steps) <= max_points:
                    yield name, {"step": steps, "value": values, "odd": odd}
                    continue
        if held is None:
            held = columns.get(run_id, version, [name]) if columns is not None else {}
        walls: dict[str, tuple[list, list]] | None = {} if wall_time else None
        if name not in held:  # (with wall_time, the same read brings the series' wall times)
            held = repo.series_columns(session=session, run_id=run_id, names=[name], walls=walls)
            if columns is not None:
                columns.put(run_id, version, held)
        steps, values = held.pop(name)
        if ranged:  # steps are in order (the table is read ORDER BY step; columns keep that order)
            lo = 0 if start is None else bisect.bisect_left(steps, start)
            hi = len(steps) if end is None else bisect.bisect_right(steps, end)
            if lo or hi < len(steps):
                steps, values = steps[lo:hi], values[lo:hi]
        if max_points and len(steps) > max_points:
            series = _series(_points(steps, values), max_points)
        else:
            series = {"step": steps, "value": values}
        if walls is not None:
            if name not in walls:  # served from the columns
                walls.update(
                    repo.series_wall_times(session=session, run_id=run_id, names=[name], start=start, end=end)
                )
            series["wall_time"] = _wall_times(series["step"], *walls[name])
        yield name, series


def _wall_times(kept: list[int], steps: list[int], walls: list) -> list:
    """The wall time of each of the ``kept`` steps (a downsampled subset of ``steps``, in order);
    ``None`` for a step the wall-time read did not see (written between the two reads)."""
    if kept == steps:
        return walls
    if not steps:
        return [None] * len(kept)
    import numpy as np  # downsampled reads only (see _series)

    index = np.searchsorted(np.asarray(steps, dtype=np.int64), np.asarray(kept, dtype=np.int64))
    index = np.minimum(index, len(steps) - 1).tolist()
    return [walls[i] if steps[i] == step else None for i, step in zip(index, kept, strict=True)]


def _points(steps: list[int], values: list) -> list[tuple[int, float | None, int]]:
    """API-spelled columns (see ``repo.series_columns``) back to ``(step, value, flag)`` points."""
    return [
        (
            step,
            (None if value is None else _SPELLED[value])
            if value is None or value.__class__ is str
            else value,
            1 if value == NAN else 0,
        )
        for step, value in zip(steps, values, strict=True)
    ]


def query_encoded(
    ctx: Services,
    run_id: int,
    *,
    names: list[str] | None,
    max_points: int,
    if_none_match: str | None = None,
    start: int | None = None,
    end: int | None = None,
    wall_time: bool = False,
    binary: bool = False,
) -> tuple[str, bytes | None]:
    """``(etag, JSON body)`` of ``{"series": {name: {"step": [...], "value": [...]}}}``: at most
    ``max_points`` per series (0: all), downsampled keeping each bucket's minimum and maximum so
    spikes survive; ``start`` / ``end`` (inclusive) keep only that step range, cut before
    downsampling so a zoomed-in chart gets it at full resolution. Served from the cache while the
    run's data is unchanged; the body is ``None`` when ``if_none_match`` already names this version
    (-> 304). ``wall_time`` adds each kept point's wall time (``"wall_time": [...]``, null where the
    trainer sent none): the dashboard's x axis in wall-clock time. ``binary``: the same series as
    fixed-width columns (``service/series_format.py``) instead of JSON."""
    key_names = tuple(names) if names is not None else None
    with ctx.db.read() as session:
        version = repo.data_version(session=session, run_id=run_id)  # before the data it stands for
        if version is None:
            raise NotFound(f"run {run_id} does not exist")
        tag = hashlib.blake2s(
            repr((key_names, max_points, start, end, wall_time, binary)).encode(), digest_size=6
        ).hexdigest()
        etag = f'W/"{run_id}.{version}.{tag}"'
        if if_none_match and etag in (part.strip() for part in if_none_match.split(",")):
            return etag, None
        key = (run_id, version, key_names, max_points, start, end, wall_time, binary)
        # The binary answer is copied out of the in-memory columns in about a millisecond: it is
        # not kept in the answer cache (20,000 steps of 12 metrics would hold 3.8 MB there).
        cache = ctx.series_cache if not binary else None
        body = cache.get(key) if cache is not None else None
        fresh = body is None
        if fresh:
            body = (series_format.encode_series if binary else _encode_series)(
                _query_series(
                    session,
                    run_id,
                    names,
                    max_points,
                    ctx.columns,
                    version,
                    start=start,
                    end=end,
                    wall_time=wall_time,
                    arrays=binary,
                )
            )
            if cache is not None:
                cache.put(key, body)
    if fresh and len(body) > _TRIM_AFTER:
        # the rows, lists and encoded parts of a large answer were freed in pieces glibc keeps for
        # reuse: hand them back (a 20,000-step, 12-metric answer: ~10 MB of RSS otherwise kept)
        release_memory()
    return etag, body


_TRIM_AFTER = 1 << 20  # answers larger than this (bytes) built from the columns or the table


def names_encoded(
    ctx: Services, run_id: int, *, if_none_match: str | None = None
) -> tuple[str, bytes | None]:
    """``(etag, JSON body)`` of ``{"names": [...]}``, every metric name the run logged (sorted); cached
    and tagged by the run's data version exactly as ``query_encoded``."""
    with ctx.db.read() as session:
        version = repo.data_version(session=session, run_id=run_id)
        if version is None:
            raise NotFound(f"run {run_id} does not exist")
        etag = f'W/"{run_id}.{version}.names"'
        if if_none_match and etag in (part.strip() for part in if_none_match.split(",")):
            return etag, None
        key = (run_id, version, "names")
        cache = ctx.series_cache
        body = cache.get(key) if cache is not None else None
        if body is None:
            body = _encode({"names": repo.metric_names(session=session, run_id=run_id)})
            if cache is not None:
                cache.put(key, body)
    return etag, body


def _encode_series(parts: Iterator[tuple[str, dict[str, list]]]) -> bytes:
    """``_encode({"series": dict(parts)})``, byte for byte, encoding each series as it comes."""
    return (
        b'{"series":{' + b",".join(orjson.dumps(name) + b":" + orjson.dumps(s) for name, s in parts) + b"}}"
    )


def _encode(result: dict[str, Any]) -> bytes:
    """The JSON of a query result (orjson: values are floats, None or the strings "NaN",
    "Infinity", "-Infinity" already, so nothing reaches it that it would turn into null)."""
    return orjson.dumps(result)


def _series(points: list[tuple[int, float | None, int]], max_points: int) -> dict[str, list]:
    if max_points and len(points) > max_points:
        points = downsample(points, max_points)
    if not points:
        return {"step": [], "value": []}
    steps = [p[0] for p in points]
    values = [p[1] for p in points]
    # Fast path: no null, no NaN (NULL in the table, or a float NaN read back from the in-memory
    # columns) and no infinities -> the values go out as they are. max()/min() cannot be used to
    # find these: a comparison with NaN is always false, and orjson would write NaN as null.
    if None in values or not all(map(math.isfinite, values)):
        values = [
            (NAN if flag else None)
            if value is None
            else (value if math.isfinite(value) else encode_float(value))
            for _, value, flag in points
        ]
    return {"step": steps, "value": values}


def downsample(
    points: list[tuple[int, float | None, int]], max_points: int
) -> list[tuple[int, float | None, int]]:
    """At most ``max_points`` of ``points`` (in step order): the series is cut into ``max_points // 2``
    buckets of consecutive points and each bucket keeps its minimum and its maximum, so a one-step
    spike always survives. A non-finite value (NaN / ±Infinity) is the most extreme thing a bucket can
    hold, so it is kept in place of the less extreme of the two. Missing values (null) are dropped
    unless a whole bucket is null."""
    import numpy as np  # only for downsampled reads: a server that ingests never loads it (~12 MiB)

    n = len(points)
    per_bucket = 2 if max_points >= 2 else 1
    buckets = max(1, max_points // per_bucket)
    values = np.array([np.nan if v is None else v for _, v, _ in points], dtype=np.float64)
    present = np.array([v is not None or flag for _, v, flag in points], dtype=bool)
    finite = np.isfinite(values) & present
    special = present & ~finite  # NaN flagged points and +-inf
    lo_key = np.where(finite, values, np.inf)
    hi_key = np.where(finite, values, -np.inf)
    edges = np.linspace(0, n, buckets + 1).round().astype(np.int64)
    keep: list[int] = []
    for b in range(buckets):
        start, end = int(edges[b]), int(edges[b + 1])
        if end <= start:
            continue
        chosen: list[int] = []
        if finite[start:end].any():
            lo = start + int(np.argmin(lo_key[start:end]))
            hi = start + int(np.argmax(hi_key[start:end]))
            chosen = [lo, hi] if per_bucket == 2 else [hi if abs(values[hi]) >= abs(values[lo]) else lo]
        if special[start:end].any():
            odd = start + int(np.argmax(special[start:end]))
            if chosen:
                median = float(np.median(values[start:end][finite[start:end]]))
                # replace whichever kept point lies closer to the bucket's median
                idx = min(range(len(chosen)), key=lambda i: abs(values[chosen[i]] - median))
                chosen[idx] = odd
            else:
                chosen = [odd]
        if not chosen:
            chosen = [start]
        keep.extend(sorted(set(chosen)))
    return [points[i] for i in keep]
