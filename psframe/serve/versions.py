"""The versions ``psframe serve`` serves: each one built whole aside, then switched to by one reference.

A :class:`ServedVersion` is immutable once made: the snapshot of one checkpoint step
(:class:`psframe.export.Snapshot`), the model loaded from it (its own instance, or None), and
where it came from. The :class:`VersionHolder` holds the current one. A request takes
:meth:`VersionHolder.current` once and reads only that object, so it sees one version whole
however many switches happen meanwhile; the follower builds the next version fully (tensors and
model) before :meth:`VersionHolder.publish` swaps the one reference. Nothing a request may be
reading is ever changed in place: an older version stays whole until the last request holding
it lets it go.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from psframe.export import Snapshot


@dataclass(frozen=True, eq=False)
class ServedVersion:
    """One version of the served model.

    Attributes:
        number: 1 for the first version this process served, then one more at each switch.
        snapshot: the parameters and dynamic tables' rows of the checkpoint at :attr:`step`.
        base_step: the step of the full checkpoint its chain starts at.
        deltas_applied: the delta checkpoints applied on that full checkpoint to make it.
        committed_at: when the checkpoint of :attr:`step` was committed (its manifest's
            ``created``, seconds since the epoch).
        loaded_at: when this process finished building it (seconds since the epoch).
        model: the model loaded with this version's parameters (an instance of its own, in
            ``eval()`` mode), or None when ``psframe serve`` has no ``--model``.
    """

    number: int
    snapshot: Snapshot
    base_step: int
    deltas_applied: int
    committed_at: float
    loaded_at: float = field(default_factory=time.time)
    model: torch.nn.Module | None = None

    @property
    def step(self) -> int:
        """The global step of the checkpoint it serves."""
        return self.snapshot.step


class VersionHolder:
    """The version served now: read by any number of requests, switched by one follower.

    Example::

        holder = VersionHolder()
        holder.publish(version)         # the follower, once the version is whole
        served = holder.current()       # a request: once, then only ``served``
    """

    def __init__(self) -> None:
        self._current: ServedVersion | None = None
        self._publishing = threading.Lock()

    def current(self) -> ServedVersion | None:
        """The version served now (None before the first one): read once per request."""
        return self._current  # one read of one reference: a request gets the old or the new, whole

    def next_number(self) -> int:
        """The number the next version published must carry."""
        current = self._current
        return 1 if current is None else current.number + 1

    def publish(self, version: ServedVersion) -> None:
        """Serve ``version`` from now on.

        Raises:
            ValueError: its number is not the one after the current version's (two followers,
                or a version built on a version that is no longer current).
        """
        with self._publishing:
            if version.number != self.next_number():
                raise ValueError(
                    f"version {version.number} (step {version.step}) cannot follow version "
                    f"{self.next_number() - 1}: versions are published in order, each once"
                )
            self._current = version


__all__ = ["ServedVersion", "VersionHolder"]
