"""Batch tensors in and out of the ``audits.blob`` column without whole extra copies in memory.

An upload is received into an anonymous temporary file (``SpooledBody``), validated through a
private memory map of it (the tensors are views: only the pages a check reads are touched), and
written to the database in 1 MiB chunks:

- SQLite: the ``audit_blobs`` row is inserted with ``zeroblob(n)`` as its last field (which SQLite
  does not materialise) and filled through incremental blob I/O; binding the whole body instead
  costs two more copies of it inside SQLite (the bound value and the record built from it);
- PostgreSQL: the row is streamed with ``COPY audit_blobs FROM STDIN (FORMAT BINARY)`` (a bound
  parameter would be built whole in libpq's output buffer).

The audit worker reads a blob back the same way, chunk by chunk into one ``bytearray`` of its size
(whose tensors are then views of it: one copy in all).
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select

CHUNK = 1024 * 1024
_PGCOPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)  # flags, header extension


class SpooledBody:
    """An upload's bytes in an anonymous temporary file (gone when closed, or when the process dies)."""

    def __init__(self, directory: str | None = None) -> None:
        self.file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (closed by close())
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.size += len(chunk)

    def __len__(self) -> int:
        return self.size

    @contextmanager
    def mapped(self) -> Iterator[memoryview]:
        """A writable, private (copy-on-write) view of the bytes; nothing is read until touched.
        Views taken from it (tensors) must be dropped before the block ends, or the mapping stays
        until they are garbage."""
        self.file.flush()
        if self.size == 0:
            yield memoryview(bytearray())
            return
        mapping = mmap.mmap(self.file.fileno(), self.size, access=mmap.ACCESS_COPY)
        view = memoryview(mapping)
        try:
            yield view
        finally:
            try:
                view.release()
                mapping.close()
            except BufferError:  # a view of it is still referenced (an exception's traceback)
                pass

    def chunks(self, size: int = CHUNK) -> Iterator[bytes]:
        self.file.flush()
        fd = self.file.fileno()
        offset = 0
        while offset < self.size:
            chunk = os.pread(fd, min(size, self.size - offset), offset)
            if not chunk:
                raise OSError(f"upload spool file ended at {offset} of {self.size} bytes")
            offset += len(chunk)
            yield chunk

    def close(self) -> None:
        self.file.close()


def _chunks(blob: Any) -> Iterator[bytes | memoryview]:
    if isinstance(blob, SpooledBody):
        yield from blob.chunks()
        return
    view = memoryview(blob)
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


def write_blob(session, table, audit_id: int, blob: Any, *, fill: bool = True) -> None:
    """Insert row ``audit_id`` of ``table`` (``audit_blobs``: ``id``, then ``blob``) with ``blob``
    written in chunks, in the caller's transaction. SQLite with ``fill=False``: only its room
    (``zeroblob``); ``fill_blob`` writes the bytes later, one short transaction a chunk."""
    raw = session.connection.driver_connection
    if session.dialect.name == "sqlite":
        raw.execute(f"INSERT INTO {table.name} (id, blob) VALUES (?, zeroblob(?))", (audit_id, len(blob)))
        if len(blob) and fill:
            with raw.blobopen(table.name, "blob", audit_id) as handle:
                for chunk in _chunks(blob):
                    handle.write(chunk)
        return
    with raw.cursor() as cur, cur.copy(f"COPY {table.name} (id, blob) FROM STDIN (FORMAT BINARY)") as copy:
        # One tuple of two fields: the id (int8), then the bytes (bytea), streamed.
        copy.write(_PGCOPY_SIGNATURE + struct.pack("!hiqi", 2, 8, audit_id, len(blob)))
        for chunk in _chunks(blob):
            copy.write(chunk)
        copy.write(struct.pack("!h", -1))  # trailer


def fill_blob(db, table, audit_id: int, blob: Any, *, chunk: int = CHUNK, pause: float = 0.001) -> None:
    """SQLite: write ``blob`` into the room ``write_blob(fill=False)`` made, one transaction per
    ``chunk`` bytes, so the database's single writer lock passes to other writers (the trainers'
    metric writes) between chunks instead of being held for the whole batch (``pause`` seconds
    between chunks let a waiting writer take it)."""
    offset = 0
    for part in _chunks(blob) if chunk == CHUNK else _rechunk(blob, chunk):
        if offset and pause:
            time.sleep(pause)
        with db.write() as session:
            raw = session.connection.driver_connection
            with raw.blobopen(table.name, "blob", audit_id) as handle:
                handle.seek(offset)
                handle.write(part)
        offset += len(part)


def _rechunk(blob: Any, size: int) -> Iterator[bytes | memoryview]:
    if isinstance(blob, SpooledBody):
        yield from blob.chunks(size)
        return
    view = memoryview(blob)
    for start in range(0, len(view), size):
        yield view[start : start + size]


def read_blob(session, table, audit_id: int) -> bytearray | None:
    """The ``blob`` of row ``audit_id`` as one ``bytearray``, read in chunks (``None``: no row)."""
    size = session.execute(select(func.length(table.c.blob)).where(table.c.id == audit_id)).scalar()
    if size is None:
        return None
    out = bytearray(size)
    if size == 0:
        return out
    if session.dialect.name == "sqlite":
        raw = session.connection.driver_connection
        with raw.blobopen(table.name, "blob", audit_id, readonly=True) as handle:
            for start in range(0, size, CHUNK):
                out[start : start + CHUNK] = handle.read(CHUNK)
    else:
        for start in range(0, size, 8 * CHUNK):
            out[start : start + 8 * CHUNK] = session.execute(
                select(func.substring(table.c.blob, start + 1, 8 * CHUNK)).where(table.c.id == audit_id)
            ).scalar()
    if len(out) != size:
        raise RuntimeError(f"audit {audit_id}: read {len(out)} bytes of a {size}-byte blob")
    return out
