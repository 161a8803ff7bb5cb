"""glibc malloc settings for a process that moves megabytes of tensors per step.

Every step, a ps task receives and sends its variables' bytes in buffers that
gRPC and torch allocate and free on several threads, and a worker allocates
its gradients afresh in ``backward``. With glibc's defaults those buffers go
back to the OS as soon as they are freed: an allocation above the mmap
threshold (which grows with use, up to 32 MiB) is its own mapping, unmapped
on free; every thread gets an arena of its own, whose freed pages are trimmed.
The next step maps them again, one page fault per 4 KiB, and the kernel
zeroes every page. On the large MLP benchmark (80 MB of variables,
synchronous) that was half of the ps's CPU time.

:func:`tune_malloc` keeps such buffers for reuse instead: one arena (gRPC's
threads and the training thread share freed buffers instead of each keeping
its own), allocations up to 256 MiB from the heap, and the heap's free top
kept up to 512 MiB. The process's memory then stays at its working set; it
stops being mapped and unmapped every step (``python -m benchmarks.suite.memory``
measures the ps's peak against what it holds).

It changes nothing where the user chose the allocator: ``MALLOC_*`` or
``GLIBC_TUNABLES=glibc.malloc...`` in the environment, another malloc
preloaded through ``LD_PRELOAD`` (tcmalloc, jemalloc), a C library other than
glibc, or ``PSFRAME_TUNE_MALLOC=0``. A ps task there trims freed buffers
every so many bytes instead (:class:`MemoryReturner`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

MiB = 1 << 20
ARENA_MAX = 1
MMAP_THRESHOLD = 256 * MiB
TRIM_THRESHOLD = 512 * MiB
OPT_OUT_VARIABLE = "PSFRAME_TUNE_MALLOC"

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_lock = threading.Lock()
_result: bool | None = None  # what the first call decided, for every later one


def user_choice(environ: Mapping[str, str]) -> str | None:
    """Why the allocator is left as it is, or None when psframe may tune it.

    >>> user_choice({})
    >>> user_choice({"MALLOC_ARENA_MAX": "2"})
    'MALLOC_ARENA_MAX is set'
    >>> user_choice({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    'LD_PRELOAD loads /usr/lib/libjemalloc.so.2'
    >>> user_choice({"PSFRAME_TUNE_MALLOC": "0"})
    'PSFRAME_TUNE_MALLOC=0'
    """
    if environ.get(OPT_OUT_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{OPT_OUT_VARIABLE}={environ[OPT_OUT_VARIABLE]}"
    for name in sorted(environ):
        if name.startswith("MALLOC_"):
            return f"{name} is set"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = environ.get("LD_PRELOAD", "")
    if "malloc" in preload:
        return f"LD_PRELOAD loads {preload}"
    return None


def tune_malloc(environ: Mapping[str, str] | None = None) -> bool:
    """Keep large freed buffers in this process for reuse (see the module's doc).

    A setting of the whole process, so no constructor makes it: the entry
    points do (``psframe server``, a ps task's serving processes), and a
    script calls it through :func:`psframe.tune_process` first thing, before
    any gRPC thread starts (an arena limit applies to threads that have none
    yet). Later calls return the first's answer. Where glibc refuses a
    setting, the ones before it stay and the answer is False, so the ps keeps
    trimming.

    Args:
        environ: the environment to read the user's choices from; default
            ``os.environ``.

    Returns:
        True if glibc's settings were changed, False if they were left alone.
    """
    global _result
    with _lock:
        if _result is not None:
            return _result
        reason = user_choice(os.environ if environ is None else environ)
        libc = _glibc() if reason is None else None
        if reason is None and libc is None:
            reason = "the C library is not glibc"
        if libc is not None:
            applied = all(
                libc.mallopt(param, value) == 1
                for param, value in (
                    (_M_ARENA_MAX, ARENA_MAX),
                    (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                    (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                )
            )
            if not applied:
                reason = "glibc refused a setting"
        _result = reason is None
        if _result:
            log.debug("malloc: %d arena, buffers up to %d MiB kept for reuse", ARENA_MAX, MMAP_THRESHOLD // MiB)
        else:
            log.debug("malloc left as it is: %s", reason)
        return _result


def malloc_tuned() -> bool:
    """Whether :func:`tune_malloc` changed glibc's settings in this process (it changes nothing)."""
    return bool(_result)


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc, else None (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it: an AttributeError elsewhere
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def trim() -> None:
    """Give the free memory of the heap back to the OS now (glibc's ``malloc_trim``; a no-op elsewhere).

    For a one-off: once a ps task moved its variables or optimizer state
    into shared memory, the private copies it freed would otherwise stay
    resident, kept for reuse (see :func:`tune_malloc`).
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class MemoryReturner:
    """Gives freed message buffers back to the OS every so many bytes handled.

    The fallback of a ps task where :func:`tune_malloc` left glibc's defaults:
    requests and replies of a few MiB are allocated and freed on many gRPC
    threads, each thread's arena keeps the freed pages, and the task's
    resident memory would grow well past what it holds (see
    benchmarks/suite/memory.py); ``malloc_trim`` returns them. A no-op without
    glibc, or when not ``enabled`` (where :func:`tune_malloc` applied, freed
    buffers stay in one arena for the next step, and trimming them would only
    make it fault them back in).
    """

    EVERY_BYTES = 64 << 20

    def __init__(self, enabled: bool = True) -> None:
        libc = _glibc() if enabled else None
        self._trim = libc.malloc_trim if libc is not None else None
        # Whether it gives anything back: a caller that counts bytes for it may skip it otherwise.
        self.enabled = self._trim is not None
        self._lock = threading.Lock()
        self._since = 0

    def handled(self, nbytes: int) -> None:
        """Count ``nbytes`` of messages handled; trim when enough have been (at once for
        :data:`EVERY_BYTES` or more: a caller may count them itself and tell only then)."""
        if self._trim is None:
            return
        with self._lock:
            self._since += nbytes
            if self._since < self.EVERY_BYTES:
                return
            self._since = 0
        self._trim(0)
