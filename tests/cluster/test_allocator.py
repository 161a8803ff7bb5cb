"""psframe.memory.malloc: freed tensor buffers are reused, not mapped afresh every step.

This file holds the cluster tier's tests of the subject; `tests/unit/test_allocator.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest

from psframe.memory import malloc
from tests.unit.test_allocator import _CONSTRUCTORS_PROBE, _HEAP_PROBE, BUFFER_BYTES, PAGES_PER_BUFFER, _probe


@pytest.mark.cluster
@pytest.mark.skipif(malloc._glibc() is None, reason="needs glibc")
def test_tuned_process_keeps_large_buffers_in_the_heap_for_reuse():
    tuned = _probe(_HEAP_PROBE)
    assert tuned["tuned"] is True
    # Not a mapping of its own (unmapped on free), but heap memory the next one reuses.
    assert tuned["mapped"] < BUFFER_BYTES and tuned["kept"] >= BUFFER_BYTES, tuned
    untuned = _probe(_HEAP_PROBE, PSFRAME_TUNE_MALLOC="0")
    assert untuned["mapped"] >= BUFFER_BYTES, untuned


@pytest.mark.cluster
@pytest.mark.skipif(malloc._glibc() is None, reason="needs glibc")
def test_opting_out_keeps_glibcs_defaults():
    untuned = _probe(PSFRAME_TUNE_MALLOC="0")
    assert untuned["tuned"] is False
    # glibc maps a buffer this large on every allocation: every page faults again.
    assert untuned["faults"] >= 4 * PAGES_PER_BUFFER, untuned


@pytest.mark.cluster
@pytest.mark.skipif(malloc._glibc() is None, reason="glibc only")
def test_constructors_leave_the_process_allocator_alone():
    # Process-wide settings are the entry points' (psframe server) or the script's own call.
    assert _probe(_CONSTRUCTORS_PROBE) == {"trainer": False, "server": False, "explicit": True}
