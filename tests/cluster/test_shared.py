"""psframe.ps.serving.shared_store: one model, one lock and one set of counters for a ps task's
processes. No network.

This file holds the cluster tier's tests of the subject; `tests/unit/test_shared.py` holds the other
tiers'.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from psframe.ps.serving.shared_store import SharedStore
from tests.unit.test_shared import memory  # noqa: F401


@pytest.mark.cluster
def test_the_lock_is_reentrant_and_waitable_and_excludes_other_processes(memory):
    condition = threading.Condition(memory.lock)
    with memory.lock, memory.lock:  # reentrant
        probe = (
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('took it')\n"
            "except BlockingIOError:\n    print('held')"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe, os.path.join(memory.folder, "lock")],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        assert out == "held"
        woke = threading.Event()

        def notify():
            with memory.lock:  # only possible while the waiter released every level
                condition.notify_all()
                woke.set()

        threading.Thread(target=notify, daemon=True).start()
        assert condition.wait(timeout=10) and woke.is_set()
    out = subprocess.run(
        [sys.executable, "-c", probe, os.path.join(memory.folder, "lock")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert out == "took it"


@pytest.mark.cluster
def test_folders_of_owners_that_died_are_removed(memory):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    base = os.path.dirname(memory.folder)
    orphan = os.path.join(base, f"psframe-ps-{dead}-test")
    os.makedirs(orphan)
    other = SharedStore.create(num_workers=1)
    try:
        assert not os.path.exists(orphan)
        assert os.path.exists(memory.folder)  # this process is alive: its folder stays
    finally:
        other.close()
    assert not os.path.exists(other.folder)
