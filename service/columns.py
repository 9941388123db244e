"""Metric history kept in memory as columns, so a history query does not re-read the points table.

Per run: ``{name: (steps, values)}``, steps ascending, values spelled as the API answers them (floats,
``None``, ``"NaN"``, ``"Infinity"``, ``"-Infinity"``), plus the run's ``data_version`` they stand for.
A query reads the run's version from the database first; the columns answer only when they stand for
exactly that version, otherwise the missing series are read from the database and remembered.

Ingest in this process extends the columns after its transaction commits, when they stood for the
version its transaction started from (``version - 1``); otherwise (another process or thread wrote in
between, a step arrived out of order) the affected columns are dropped and read again on the next
query. So an answer is the database's at the version it names, on every replica: a replica that
did not see a write learns it from the version and re-reads. Bounded by ``max_points`` (least recently
used runs go first); ``0`` disables the store.

Held compactly: steps in an ``array('q')``, values in an ``array('d')`` with the few values that are
not finite floats (null, ``"NaN"``, ``"±Infinity"``) kept aside by position, 16 bytes a point
against ~70 as Python lists of int and float objects; a query gets lists back.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

Column = tuple[list[int], list]


class _Held:
    """One series: ``steps`` and ``values`` arrays; ``odd`` maps a position to a value that is not a
    float (its array slot holds 0.0)."""

    __slots__ = ("odd", "steps", "values")

    def __init__(self, steps: Sequence[int], values: Sequence) -> None:
        self.steps = array("q", steps)
        self.odd: dict[int, object] = {}
        if all(v.__class__ is float for v in values):
            self.values = array("d", values)
        else:
            self.values = array("d")
            for value in values:
                self.append_value(value)

    def append_value(self, value) -> None:
        if value.__class__ is not float:
            self.odd[len(self.values)] = value
            value = 0.0
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.steps)

    def column(self) -> Column:
        values = self.values.tolist()
        for at, value in self.odd.items():
            values[at] = value
        return self.steps.tolist(), values


class _Run:
    __slots__ = ("points", "series", "version")

    def __init__(self, version: int):
        self.version = version
        self.series: dict[str, _Held] = {}
        self.points = 0


class SeriesColumns:
    def __init__(self, max_points: int):
        self.max_points = max_points
        self._runs: OrderedDict[int, _Run] = OrderedDict()
        self._points = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def holds(self, run_id: int) -> bool:
        """Whether any of the run's series are held (ingest then reports its new version)."""
        return run_id in self._runs

    def get(self, run_id: int, version: int, names: Sequence[str]) -> dict[str, Column]:
        """Copies of the columns of ``names`` held for exactly ``version``; names not held are missing
        from the answer."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.version != version:
                self.misses += len(names)
                return {}
            self._runs.move_to_end(run_id)
            # lists made here: ingest threads append to the held arrays while the caller encodes these
            found = {name: run.series[name].column() for name in names if name in run.series}
            self.hits += len(found)
            self.misses += len(names) - len(found)
            return found

    def get_arrays(self, run_id: int, version: int, name: str) -> tuple[array, array, dict] | None:
        """A copy of one held series as ``(steps, values, odd)`` arrays (``odd``: position -> the value
        that is not a float; its slot in ``values`` holds 0.0), for exactly ``version``; ``None`` when
        not held. The binary history answer copies these straight out, making no Python object per point."""
        with self._lock:
            run = self._runs.get(run_id)
            held = run.series.get(name) if run is not None and run.version == version else None
            if held is None:
                self.misses += 1
                return None
            self._runs.move_to_end(run_id)
            self.hits += 1
            return array("q", held.steps), array("d", held.values), dict(held.odd)

    def put(self, run_id: int, version: int, loaded: dict[str, Column]) -> None:
        """Remember series read from the database at ``version`` (read after the version)."""
        size = sum(len(steps) for steps, _ in loaded.values())
        if not loaded or size > self.max_points // 4:  # one run may not evict most of the store
            return
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.version != version:
                if run is not None:
                    self._points -= run.points
                run = self._runs[run_id] = _Run(version)
            for name, column in loaded.items():
                old = run.series.get(name)
                if old is not None:
                    run.points -= len(old)
                    self._points -= len(old)
                run.series[name] = _Held(column[0], column[1])
                run.points += len(column[0])
                self._points += len(column[0])
            self._runs.move_to_end(run_id)
            self._evict()

    def extend(self, run_id: int, version: int, rows: Iterable[tuple[str, int, object]]) -> None:
        """After a committed ingest that moved the run from ``version - 1`` to ``version``: append its
        ``(name, step, spelled value)`` rows (insert-or-ignore: a step already held keeps its value)."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return
            if run.version != version - 1:  # someone else wrote in between: read it all again
                self._drop(run_id)
                return
            run.version = version
            series = run.series
            dropped: set[str] = set()
            added = 0
            for name, step, value in rows:
                column = series.get(name)
                if column is None:
                    continue  # not held: read from the database when asked for
                steps = column.steps
                if not steps or step > steps[-1]:
                    steps.append(step)
                    column.append_value(value)
                    added += 1
                elif step < steps[-1] and name not in dropped:
                    dropped.add(name)  # out of order: may be new or a resend; re-read
            for name in dropped:
                added -= len(series.pop(name))
            run.points += added
            self._points += added
            self._evict()

    def _drop(self, run_id: int) -> None:
        run = self._runs.pop(run_id, None)
        if run is not None:
            self._points -= run.points

    def _evict(self) -> None:
        while self._points > self.max_points and self._runs:
            _, run = self._runs.popitem(last=False)
            self._points -= run.points
