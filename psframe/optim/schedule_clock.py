"""How a ps task runs a learning-rate schedule: torch's own scheduler, stepped with the global step.

A :class:`ScheduleClock` holds the real ``torch.optim.lr_scheduler`` scheduler of
an optimizer's schedule (:mod:`psframe.optim.lr_scheduler`) over a dummy
optimizer of the same class and arguments, never stepped, and the global step
it has reached. Before each update the ps task asks it to bring an optimizer
up to date (:meth:`ScheduleClock.apply`): it steps the scheduler once per
global step passed since it last moved, exactly as one process calls
``scheduler.step()`` after each ``optimizer.step()``, and copies what the
scheduler set (``lr``; with cycling momentum, ``momentum`` or ``betas``) into
every parameter group of the optimizer. Nothing here computes a rate: torch's
classes do, so the rate at every global step is torch's.

``ReduceLROnPlateau`` is stepped by the metrics the chief reports
(:meth:`ScheduleClock.report`), each from a named global step on.

The state (the scheduler's ``state_dict``, the dummy optimizer's parameter
group, the step reached, the metrics waiting for their step) is kept in
checkpoints as builtins (:meth:`ScheduleClock.state_dict`): restored, the clock
goes on from there; without it, it steps again from global step 0 (a plateau
schedule then starts over).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from psframe.optim import kernels, lr_scheduler

if TYPE_CHECKING:
    from psframe.optim import OptimizerSpec

log = logging.getLogger(__name__)

# The parameter-group entries a scheduler sets, copied from the dummy optimizer to the real ones
# that have them; and the rate it started from, which torch's schedulers write into the groups of
# the optimizer they drive (the row kernels decide once for it: psframe.optim.rows_kernels).
SCHEDULED = ("lr", "momentum", "betas")
STARTED_FROM = "initial_lr"


class ScheduleClock:
    """The schedule of ``optimizer`` (an :class:`~psframe.optim.OptimizerSpec` with one), at the global step.

    Args:
        optimizer: the optimizer it drives, and its ``schedule``.
        global_step: the ps task's global step (read, never changed).

    Raises:
        OptimizerConfigError: the schedule's function cannot be imported, or torch refuses the schedule.
    """

    def __init__(self, optimizer: OptimizerSpec, global_step: Callable[[], int]) -> None:
        if optimizer.schedule is None:
            raise ValueError(f"{optimizer!r} has no schedule")
        self.spec, self.schedule = optimizer, optimizer.schedule
        self._global_step = global_step
        self.version = 0  # bumped whenever the hyperparameters change
        self.values: dict[str, Any] = {}  # what the scheduler set, at the step reached
        self._start()

    def _start(self) -> None:
        """The scheduler as built, at global step 0."""
        self._probe = kernels.probe(self.spec.name, self.spec.kwargs)
        self._probe._opt_called = True  # type: ignore[attr-defined]  # never stepped: no warning that it was not
        self._scheduler: Any = lr_scheduler.build(self.schedule, self._probe)
        self._at = 0
        self._pending: list[tuple[int, float]] = []  # plateau metrics waiting for their global step
        self._read()

    def _read(self) -> None:
        """Take what the scheduler set; a change is a new :attr:`version`."""
        group = self._probe.param_groups[0]
        values = {key: group[key] for key in (*SCHEDULED, STARTED_FROM) if key in group}
        if values != self.values:
            self.values = values
            self.version += 1

    @property
    def step(self) -> int:
        """The global step the scheduler has reached."""
        return self._at

    def hyperparameters(self) -> dict[str, Any]:
        """What the scheduler sets (``lr``, and ``momentum`` or ``betas`` where it has them; ``initial_lr``)
        at the global step now."""
        self._follow()
        return dict(self.values)

    def apply(self, optimizer: torch.optim.Optimizer, applied: int = -1) -> int:
        """Bring every parameter group of ``optimizer`` to the hyperparameters of the global step now
        (call it before the optimizer's step, under the lock that guards the step).

        Args:
            applied: the :attr:`version` this optimizer was brought to last (-1: never); nothing
                is written when it is the current one.

        Returns:
            The version it is at now, for the next call.
        """
        self._follow()
        if applied != self.version:
            values = self.values
            for group in optimizer.param_groups:
                for key, value in values.items():
                    if key in group or key == STARTED_FROM:
                        group[key] = value
        return self.version

    def _follow(self) -> None:
        step = self._global_step()
        if step != self._at:
            self._move(step)

    def _move(self, step: int) -> None:
        if step < self._at:  # the global step went back (a restore without this state): again from 0
            log.info("schedule %r: global step %d is before %d; stepping again from 0", self.schedule, step, self._at)
            self._start()
        if self.schedule.plateau:
            self._at = step
            while self._pending and self._pending[0][0] <= step:
                self._scheduler.step(self._pending.pop(0)[1])
        else:
            scheduler = self._scheduler
            for _ in range(step - self._at):
                scheduler.step()
            self._at = step
        self._read()

    def report(self, metric: float, at_step: int) -> int:
        """A metric for a ``ReduceLROnPlateau`` schedule, counted from global step ``at_step`` on (at once
        if the global step is there already; else once it gets there).

        Returns:
            The global step from which it counts.

        Raises:
            ValueError: the schedule is not stepped by metrics.
        """
        if not self.schedule.plateau:
            raise ValueError(f"{self.schedule!r} is stepped by the global step, not by metrics")
        self._follow()
        if at_step > self._at:
            self._pending.append((at_step, float(metric)))
            self._pending.sort(key=lambda pending: pending[0])
            return at_step
        self._scheduler.step(float(metric))
        self._read()
        return self._at

    # ---- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The clock's state, as builtins (dicts with string keys, lists, numbers, strings)."""
        self._follow()
        group = {k: v for k, v in self._probe.param_groups[0].items() if k != "params"}
        return {
            "step": self._at,
            "scheduler": _encode(self._scheduler.state_dict()),
            "group": _encode(group),
            "pending": [[step, metric] for step, metric in self._pending],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a state :meth:`state_dict` gave (a checkpoint's).

        Raises:
            ValueError: the state is not one this schedule gave.
        """
        self._start()
        try:
            self._scheduler.load_state_dict(_decode(state["scheduler"]))
            self._probe.param_groups[0].update(_decode(state["group"]))
            self._at = int(state["step"])
            self._pending = [(int(step), float(metric)) for step, metric in state["pending"]]
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            self._start()
            raise ValueError(f"not a state of {self.schedule!r}: {type(e).__name__}: {e}") from e
        self._read()


# A scheduler's state holds tuples and Counters (MultiStepLR's milestones, with int keys): tagged here,
# so that JSON and torch.load(weights_only=True) keep them.
_TUPLE, _ITEMS, _COUNTER = "__tuple__", "__items__", "__counter__"


def _encode(x: Any) -> Any:
    if isinstance(x, collections.Counter):
        return {_COUNTER: [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _encode(v) for k, v in x.items()}
        return {_ITEMS: [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"a schedule's state holds a {type(x).__name__}, which a checkpoint cannot keep: {x!r}")


def _decode(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {_COUNTER}:
            return collections.Counter({_decode(k): _decode(v) for k, v in x[_COUNTER]})
        if set(x) == {_ITEMS}:
            return {_decode(k): _decode(v) for k, v in x[_ITEMS]}
        if set(x) == {_TUPLE}:
            return tuple(_decode(v) for v in x[_TUPLE])
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_decode(v) for v in x]
    return x
