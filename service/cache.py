"""A bounded in-process cache of encoded history answers (``GET /api/v1/runs/{id}/metrics``).

Keys carry the run's ``data_version``, which every ingest bumps in its transaction, so an entry is
valid exactly as long as the run has not changed, on any replica; nothing needs invalidating, old
versions just age out of the LRU. The same version makes the answer's ETag, so a polling dashboard
gets ``304 Not Modified`` without a body.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class SeriesCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            body = self._entries.get(key)
            if body is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return body

    def put(self, key: Hashable, body: bytes) -> None:
        if len(body) > self.max_bytes // 4:  # one answer may not evict most of the cache
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._entries[key] = body
            self._size += len(body)
            while self._size > self.max_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._size -= len(dropped)
