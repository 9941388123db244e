"""A run's series as a file: CSV or Parquet, one row per step, one column per metric.

Columns are named exactly like the series of ``GET /api/v1/runs/{id}/metrics`` (the names the trainer
logged), after a ``step`` column; every point is exported (no downsampling), optionally cut to a step
range. A step where a metric has no point, or logged null, is an empty cell (CSV) or null (Parquet);
non-finite values stay what they were: ``NaN``, ``Infinity``, ``-Infinity`` in CSV (the API's
spelling, which ``float()`` and pandas read back), IEEE values in Parquet's float64 columns.

CSV text cells (the header: metric names a trainer chose) that begin with ``=``, ``+``, ``-``, ``@``,
a tab or a carriage return get a leading single quote (OWASP's rule against formula injection: a
spreadsheet would otherwise run ``=HYPERLINK(...)`` as a formula). Values are never escaped: they are
numbers or the API's spellings of non-finite numbers, so ``-0.5`` and ``-Infinity`` stay numbers.

Parquet needs pyarrow (part of the server extra); a server without it answers 400 saying so.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from typing import Any

from rlvitals.analyzers.contract.batch_rules import NON_FINITE
from rlvitals.service import metrics
from rlvitals.service.context import Services
from rlvitals.service.errors import BadRequest, NotFound
from rlvitals.service.storage import repository as repo

FORMATS = {"csv": "text/csv; charset=utf-8", "parquet": "application/vnd.apache.parquet"}
_SPELLED = NON_FINITE  # the contract's one spelling table
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as a formula (OWASP)


@dataclass(frozen=True)
class Exported:
    body: bytes
    media_type: str
    filename: str


def export_series(
    ctx: Services,
    run_id: int,
    *,
    fmt: str,
    names: list[str] | None = None,
    start: int | None = None,
    end: int | None = None,
) -> Exported:
    if fmt not in FORMATS:
        raise BadRequest(f"format must be one of {sorted(FORMATS)}, got {fmt!r}")
    writer = _parquet_writer() if fmt == "parquet" else None  # fail before reading anything
    with ctx.db.read() as session:
        run = repo.get_run(session=session, run_id=run_id)
        if run is None:
            raise NotFound(f"run {run_id} does not exist")
        result = metrics._query(session, run_id, names, 0, start=start, end=end)
    series = result["series"]
    steps, columns = _wide(series)
    base = _filename(run)
    if fmt == "csv":
        return Exported(_csv(steps, columns), FORMATS[fmt], f"{base}.csv")
    return Exported(writer(steps, columns), FORMATS[fmt], f"{base}.parquet")


def _wide(series: dict[str, dict[str, list]]) -> tuple[list[int], dict[str, list[Any]]]:
    """Steps (every step any metric has) and, per metric, one value or ``None`` per step."""
    steps = sorted({step for s in series.values() for step in s["step"]})
    row_of = {step: i for i, step in enumerate(steps)}
    columns: dict[str, list[Any]] = {}
    for name, s in series.items():
        column: list[Any] = [None] * len(steps)
        for step, value in zip(s["step"], s["value"], strict=True):
            column[row_of[step]] = value
        columns[name] = column
    return steps, columns


def _csv(steps: list[int], columns: dict[str, list[Any]]) -> bytes:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    names = list(columns)
    out.write(",".join(["step", *(_quoted(csv_text(name)) for name in names)]) + "\n")
    cols = [columns[n] for n in names]
    for i, step in enumerate(steps):
        # floats as repr (round-trips exactly), the API's spellings as they are, None as empty
        w.writerow(
            [step, *("" if (v := c[i]) is None else v if v.__class__ is str else repr(v) for c in cols)]
        )
    return out.getvalue().encode()


def csv_text(text: str) -> str:
    """A text cell as spreadsheets take it literally: ``'`` before a leading formula character."""
    return "'" + text if text.startswith(FORMULA_START) else text


def _quoted(text: str) -> str:
    """RFC 4180 quoting, also for a lone CR (the csv module quotes only its line terminator's)."""
    if any(ch in text for ch in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _parquet_writer():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise BadRequest(
            "Parquet export needs pyarrow, which this server lacks: pip install 'rlvitals[server]' "
            "(or pyarrow), or ask for format=csv"
        ) from None

    def write(steps: list[int], columns: dict[str, list[Any]]) -> bytes:
        arrays = [pa.array(steps, pa.int64())]
        for column in columns.values():
            arrays.append(
                pa.array([_SPELLED.get(v, v) if v.__class__ is str else v for v in column], pa.float64())
            )
        table = pa.Table.from_arrays(arrays, names=["step", *columns])
        sink = io.BytesIO()
        pq.write_table(table, sink)
        return sink.getvalue()

    return write


def _filename(run: dict[str, Any]) -> str:
    """``<project>-<name>-<id>``, reduced to characters every file system and header takes."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{run['project']}-{run['name']}").strip("._-")[:100]
    return f"{stem or 'run'}-{run['id']}"
