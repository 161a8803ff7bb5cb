"""Transparent huge pages for the large tensors a ps task reads and writes at random.

A step of an embedding table touches a few thousand rows scattered over
gigabytes: the table's rows, and as many rows of its optimizer state. With
4 KiB pages nearly every one of those rows costs a TLB miss and a page-table
walk on top of the cache miss; with 2 MiB pages the walks mostly hit the
cache. Measured on 2 cores, a 10^7 x 64 Adagrad table (2.56 GB and as much
state), 3,500 rows read, updated and written a step: 3.0 ms on 4 KiB pages,
1.5 ms on 2 MiB pages (0.6 ms on a 10^4-row table).

Linux's transparent huge pages (THP) in their ``madvise`` mode, the default
of many distributions, back only memory advised with ``MADV_HUGEPAGE``;
torch never advises its CPU tensors (unless ``THP_MEM_ALLOC_ENABLE=1`` was
set before its first allocation). So:

- :func:`empty` and :func:`full` make a large tensor whose pages are
  advised before any is touched: its first touches fault in huge pages.
- :func:`back` advises a tensor that already exists and has the kernel
  collapse its touched pages at once (``MADV_COLLAPSE``, Linux 6.1+): for
  what torch made, such as an optimizer's state (about 1.5 s per GB, once).

Only tensors of at least :data:`MIN_BYTES` are advised: a huge page is the
unit the kernel then allocates, so small tensors would round up. Everything
here is a no-op where THP is off (``never``), outside Linux, or with
``PSFRAME_HUGE_PAGES=0`` in the environment; a kernel that refuses an
advice leaves the tensor on small pages, as before, and says nothing.
Shared memory (a ps task with serving processes) follows the kernel's
``shmem_enabled`` setting instead, usually ``never``: it stays on small pages.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import weakref
from collections.abc import Iterable, Sequence

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 32 << 20
OPT_OUT_VARIABLE = "PSFRAME_HUGE_PAGES"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

# madvise advices, from Linux's <asm-generic/mman-common.h>.
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25

# The tensors advised so far, by id (a WeakSet would compare tensors with ==):
# back() is called on the same optimizer state again and again.
_backed: dict[int, weakref.ref] = {}


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` when huge pages can be advised here, else None."""
    if not sys.platform.startswith("linux"):
        return None
    if os.environ.get(OPT_OUT_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        with open(THP_SETTING) as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def enabled() -> bool:
    """Whether large tensors are advised onto huge pages in this process."""
    return _madvise() is not None


def _advise(tensor: torch.Tensor, *, collapse: bool) -> bool:
    """Advise the huge pages that lie wholly inside ``tensor``'s memory; True if it was advised."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or tensor.is_sparse:
        return False
    storage = tensor.untyped_storage()
    if storage.nbytes() < MIN_BYTES:
        return False
    start = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (storage.data_ptr() + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return False
    if collapse:
        madvise(start, end - start, _MADV_COLLAPSE)  # best effort: EINVAL before Linux 6.1, EAGAIN when short
    return True


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``, on huge pages if it is large (see the module's doc)."""
    tensor = torch.empty(tuple(shape), dtype=dtype)
    _advise(tensor, collapse=False)
    _remember(tensor)
    return tensor


def full(shape: Sequence[int], value: float | bool, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(shape, value, dtype=dtype)``, on huge pages if it is large."""
    return empty(shape, dtype).fill_(value)


def copy(value: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``value`` on the host, on huge pages if it is large."""
    return empty(value.shape, value.dtype).copy_(value.detach())


def back(tensors: Iterable[object]) -> None:
    """Move the large CPU tensors among ``tensors`` (others are skipped) onto huge pages, in place.

    Their values and addresses stay; pages already touched are collapsed
    now, which takes a while for gigabytes, so each tensor is done once.
    """
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not _is_backed(tensor):
            _advise(tensor, collapse=True)
            _remember(tensor)  # advised or refused, it is not tried again


def back_state(optimizer: torch.optim.Optimizer | None) -> None:
    """:func:`back` every tensor of ``optimizer``'s state (made by torch, lazily for some optimizers)."""
    if optimizer is not None:
        for state in optimizer.state.values():
            back(state.values())


def _is_backed(tensor: torch.Tensor) -> bool:
    seen = _backed.get(id(tensor))
    return seen is not None and seen() is tensor


def _remember(tensor: torch.Tensor) -> None:
    key = id(tensor)

    def forget(_: weakref.ref, key: int = key) -> None:
        _backed.pop(key, None)

    _backed[key] = weakref.ref(tensor, forget)
