"""Background worker threads shared by the audit pool and the webhook sender.

A subclass sets ``thread_name``, implements ``_run`` (loop until ``self._stop`` is set, waiting on
``self._wake`` when idle) and says how many threads to start and how long ``stop`` waits for each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading


class WorkerThreads:
    thread_name = "rlvitals-worker"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    def _thread_count(self) -> int:
        raise NotImplementedError

    def _join_timeout(self) -> float:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._stop.clear()
        for i in range(self._thread_count()):
            thread = threading.Thread(target=self._run, name=f"{self.thread_name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=self._join_timeout())
        self._threads.clear()

    def wake(self, _kind: str | None = None) -> None:
        self._wake.set()


_LIBC = None


def release_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): a batch's audit frees
    hundreds of MB of tensors in pieces glibc keeps for reuse, in the arena of the thread that freed
    them; without this a worker holds that memory long after the audit. No-op elsewhere."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)
