"""What a ps task's store counts: steps, pushes, and the versions of what it holds.

Four counts live in one int64 array, which the processes serving one ps task
share (:mod:`psframe.ps.serving.shared_store`) so that they count as one: the
global step, the pushes applied and the pushes refused, and the count the
fixed table rows' versions are stamped from
(:mod:`psframe.ps.store.row_versions`). A fifth, the version of the
variables, is this process's own: bumped whenever a variable's value changes,
so that two reads under the store's lock that see the same version read the
same values.

The store counts a push and a step by index into the array
(:data:`PUSHES`, :data:`GLOBAL_STEP`), with no property between: it does so
on every push.

Not thread-safe: the store counts under its lock.
"""

from __future__ import annotations

import numpy

# Where each count lives in StoreCounts.array.
GLOBAL_STEP, PUSHES, REJECTED_PUSHES, ROW_VERSION = range(4)


class StoreCounts:
    """A store's counts.

    Args:
        array: the global step, applied pushes, refused pushes and the rows' version
            count, as an int64 array of 4 (shared with other processes); one of its own
            by default.
    """

    def __init__(self, array: numpy.ndarray | None = None) -> None:
        self.array = array if array is not None else numpy.zeros(4, dtype=numpy.int64)
        self.version = 0  # bumped whenever a variable's value changes

    @property
    def global_step(self) -> int:
        """Worker steps finished."""
        return int(self.array[GLOBAL_STEP])

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.array[GLOBAL_STEP] = value

    @property
    def pushes(self) -> int:
        """Pushes applied."""
        return int(self.array[PUSHES])

    @pushes.setter
    def pushes(self, value: int) -> None:
        self.array[PUSHES] = value

    @property
    def rejected_pushes(self) -> int:
        """Pushes refused (nothing of them was applied)."""
        return int(self.array[REJECTED_PUSHES])

    @rejected_pushes.setter
    def rejected_pushes(self, value: int) -> None:
        self.array[REJECTED_PUSHES] = value

    @property
    def global_step_cell(self) -> numpy.ndarray:
        """The global step as a one-element view of the array (which learning-rate schedules read)."""
        return self.array[GLOBAL_STEP : GLOBAL_STEP + 1]

    @property
    def row_version_cell(self) -> numpy.ndarray:
        """The count the fixed rows' versions are stamped from, as a one-element view of the array."""
        return self.array[ROW_VERSION : ROW_VERSION + 1]
