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

# glibc's malloc, for processes that handle large buffers (a 26 MB body, a batch's tensors): blocks of
# 128 KiB and more are mapped on their own and unmapped when freed (the default threshold grows to 32
# MB as such blocks are freed, after which they stay in the heap), and at most two arenas are kept
# instead of eight per core. Set as the environment of a child process, read by glibc at its start.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_ARENA_MAX": "2"}
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt's parameter numbers (malloc.h)


def _libc():
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    return _LIBC


def tune_malloc() -> bool:
    """``MALLOC_ENV``'s settings for this process, from now on (``mallopt``), each unless the user set
    that variable; False where the C library is not glibc."""
    mallopt = getattr(_libc() or None, "mallopt", None)
    if mallopt is None:
        return False
    import os

    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(_M_MMAP_THRESHOLD, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]))
    if "MALLOC_ARENA_MAX" not in os.environ:
        mallopt(_M_ARENA_MAX, int(MALLOC_ENV["MALLOC_ARENA_MAX"]))
    return True


def release_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): a batch's audit frees
    hundreds of MB of tensors in pieces glibc keeps for reuse, in the arena of the thread that freed
    them; without this a worker holds that memory long after the audit. No-op elsewhere."""
    trim = getattr(_libc() or None, "malloc_trim", None)
    if trim is not None:
        trim(0)
