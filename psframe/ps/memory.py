"""Giving freed message buffers back to the OS (glibc's ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import threading


class MemoryReturner:
    """Gives freed message buffers back to the OS every so many bytes handled.

    Requests and replies of a few MiB are allocated and freed on many gRPC
    threads; glibc's malloc keeps the freed pages of each thread's arena, and
    a ps task's resident memory would grow well past what it holds (see
    benchmarks/memory.py). ``malloc_trim`` returns them. A no-op without glibc,
    or when not ``enabled``: where :func:`psframe.allocator.tune_malloc`
    applied, freed buffers stay in one arena for the next step to reuse, and
    trimming them would only make it fault them back in.
    """

    EVERY_BYTES = 64 << 20

    def __init__(self, enabled: bool = True) -> None:
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim if enabled else None
        except (OSError, AttributeError):
            self._trim = None
        self._lock = threading.Lock()
        self._since = 0

    def handled(self, nbytes: int) -> None:
        if self._trim is None:
            return
        with self._lock:
            self._since += nbytes
            if self._since < self.EVERY_BYTES:
                return
            self._since = 0
        self._trim(0)
