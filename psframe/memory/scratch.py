"""Scratch folders named after the process that made them, and their removal once it is gone.

A ps task keeps scratch data in folders of its own (the shared-memory store of
its serving processes, a dynamic table's rows on disk), each named
``<prefix><pid>-...``. A process killed with ``kill -9`` cannot remove its
folders; the next one to make such a folder calls :func:`remove_orphans`,
which removes those whose process no longer runs.
"""

from __future__ import annotations

import os
import shutil


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (another user's counts as running)."""
    try:
        os.kill(pid, 0)  # signal 0: is there such a process (nothing is sent)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(base: str, prefix: str) -> None:
    """Remove the folders under ``base`` named ``<prefix><pid>-...`` whose process no longer runs."""
    for name in os.listdir(base):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


__all__ = ["process_alive", "remove_orphans"]
