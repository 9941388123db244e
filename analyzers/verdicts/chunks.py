"""Row chunks: the audit's float64 passes over a batch take a few rows at a time, so an audit holds little
more than the batch itself however large the batch is (a whole float64 copy of one float32 tensor is
twice that tensor)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

CHUNK_ELEMENTS = 1 << 18  # 2 MB of float64 per tensor per chunk: a few MB of temporaries in all


def row_chunks(like: Any, elements: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """Row slices of ``like`` (a ``[B, T]`` or ``[B]`` tensor) of about ``elements`` elements each."""
    rows = int(like.shape[0])
    width = max(1, like.numel() // max(rows, 1))
    step = max(1, elements // width)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))
