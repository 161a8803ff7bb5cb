"""The learning-rate schedules of a ps task's model: where its optimizers run, by its global step.

A store's model (:class:`~psframe.ps.store.store_model.StoreModel`) has up to
two optimizers, the dense variables' and the embedding tables'; each may have
a schedule (:mod:`psframe.optim.lr_scheduler`). :class:`ModelSchedules` holds
a :class:`~psframe.optim.schedule_clock.ScheduleClock` for each that has one,
reading the store's global step (its counter, shared by the serving
processes of a task), and gives it to the parts that step that optimizer:
:class:`~psframe.ps.store.optimized_variables.OptimizedVariables` and each
dynamic table part bring their optimizer to the global step's
hyperparameters before they step it. Without a schedule nothing is held and
a step costs one test of ``None``.

The metrics the chief reports step the ``ReduceLROnPlateau`` schedules
(:meth:`ModelSchedules.report`); checkpoints keep each clock's state
(:meth:`ModelSchedules.state_dict`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy

from psframe.errors import OptimizerConfigError
from psframe.optim import OptimizerSpec
from psframe.optim.schedule_clock import ScheduleClock

log = logging.getLogger(__name__)

# The clocks by what a checkpoint's shard calls their optimizer (psframe.checkpoint.shard).
OPTIMIZERS = ("optimizer", "table_optimizer")


class ModelSchedules:
    """The schedules of a model's optimizers, at the global step ``global_step[0]``.

    Args:
        optimizer: the dense variables' optimizer (None: no model).
        table_optimizer: the tables' (None: no table).
        global_step: a one-element int64 array: the store's global step, read, never changed.

    Raises:
        OptimizerConfigError: a schedule's function cannot be imported here, or torch refuses a schedule.
    """

    def __init__(
        self,
        optimizer: OptimizerSpec | None,
        table_optimizer: OptimizerSpec | None,
        global_step: numpy.ndarray | None = None,
    ) -> None:
        steps = global_step if global_step is not None else numpy.zeros(1, dtype=numpy.int64)

        def step() -> int:
            return int(steps[0])

        self.clocks: dict[str, ScheduleClock] = {
            name: ScheduleClock(spec, step)
            for name, spec in zip(OPTIMIZERS, (optimizer, table_optimizer))
            if spec is not None and spec.schedule is not None
        }

    @property
    def dense(self) -> ScheduleClock | None:
        """The dense variables' schedule; None without one."""
        return self.clocks.get("optimizer")

    @property
    def tables(self) -> ScheduleClock | None:
        """The embedding tables' schedule; None without one."""
        return self.clocks.get("table_optimizer")

    @property
    def plateau(self) -> bool:
        """Whether a reported metric steps one of them (``ReduceLROnPlateau``)."""
        return any(clock.schedule.plateau for clock in self.clocks.values())

    def unshared(self) -> str | None:
        """Why the serving processes of a task cannot run these schedules beside it: a plateau schedule
        (the chief's metrics reach this process alone), or a function (this process imported it; a
        serving process, another program, may not); None: they can, each by the shared global step."""
        if self.plateau:
            return "a ReduceLROnPlateau schedule runs in this process (the chief's metrics reach it alone)"
        if any(clock.schedule.calls_functions for clock in self.clocks.values()):
            return "a schedule calls a function this process imported"
        return None

    def learning_rate(self) -> float | None:
        """The dense variables' learning rate at the global step now (the tables' where only they have a
        schedule); None without a schedule."""
        clock = self.dense or self.tables
        return None if clock is None else float(clock.hyperparameters()["lr"])

    def report(self, metric: float, at_step: int) -> int:
        """Step every ``ReduceLROnPlateau`` schedule with ``metric``, from global step ``at_step`` on
        (see :meth:`ScheduleClock.report`; call it under the store's lock).

        Returns:
            The global step from which it counts.

        Raises:
            OptimizerConfigError: no schedule here is stepped by metrics.
        """
        plateaus = [clock for clock in self.clocks.values() if clock.schedule.plateau]
        if not plateaus:
            held = ", ".join(repr(c.schedule) for c in self.clocks.values()) or "no schedule"
            raise OptimizerConfigError(
                f"a metric was reported, but no optimizer here has a ReduceLROnPlateau schedule ({held}); "
                f"give the optimizer schedule=psframe.optim.lr_scheduler.ReduceLROnPlateau(...)"
            )
        return max(clock.report(metric, at_step) for clock in plateaus)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each clock's state, by optimizer (``"optimizer"``, ``"table_optimizer"``), as builtins."""
        return {name: clock.state_dict() for name, clock in self.clocks.items()}

    def load_state_dict(self, states: Mapping[str, Mapping[str, Any] | None]) -> None:
        """Go on from the states :meth:`state_dict` gave; a clock without one (or with one of another
        schedule) steps again from global step 0, as it reaches the global step."""
        for name, clock in self.clocks.items():
            state = states.get(name)
            if state is None:
                if clock.schedule.plateau:
                    log.warning("%r: no state to restore; the schedule starts over", clock.schedule)
                continue
            try:
                clock.load_state_dict(state)
            except ValueError as e:
                log.warning("%r: its state is not restored (%s); it steps again from global step 0", clock.schedule, e)
