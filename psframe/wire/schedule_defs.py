"""Learning-rate schedules as wire messages: ``ScheduleDef``, the ``schedule`` of an ``OptimizerDef``.

A schedule (:class:`psframe.optim.lr_scheduler.ScheduleSpec`) travels with its
optimizer in ``InitHeader`` and comes back in ``TaskInfo``: a class name, its
keyword arguments as ``Value`` messages (tuples of whole numbers, such as
milestones, as integers, so they arrive as they left), the schedules of a
chain, and the name and arguments of a function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psframe.optim.lr_scheduler import ArgValue, FunctionRef, ScheduleSpec
from psframe.wire import psframe_pb2 as pb


def schedule_to_proto(spec: ScheduleSpec) -> pb.ScheduleDef:
    """The wire form of a schedule."""
    message = pb.ScheduleDef(name=spec.name, schedulers=[schedule_to_proto(s) for s in spec.schedulers])
    put_values(message.kwargs, spec.kwargs)
    if spec.function is not None:
        message.function = spec.function.path
        for value in spec.function.args:
            _put(message.function_args.add(), value)
        put_values(message.function_kwargs, spec.function.kwargs)
    return message


def schedule_from_proto(message: pb.ScheduleDef) -> ScheduleSpec:
    """The schedule of a wire message (checked again on arrival; its function is imported only where
    the schedule runs).

    Raises:
        OptimizerConfigError: the name or arguments are not acceptable.
    """
    function = None
    if message.function:
        function = FunctionRef(
            message.function,
            tuple(value_of(v) for v in message.function_args),
            {k: value_of(v) for k, v in message.function_kwargs.items()},
        )
    return ScheduleSpec(
        message.name,
        {k: value_of(v) for k, v in message.kwargs.items()},
        tuple(schedule_from_proto(s) for s in message.schedulers),
        function,
    )


def value_of(value: pb.Value) -> Any:
    """What a ``Value`` holds: a number, bool or string, or a tuple of numbers."""
    kind = value.WhichOneof("kind")
    if kind in ("numbers", "integers"):
        return tuple(getattr(value, kind).values)
    return None if kind is None else getattr(value, kind)


def put_values(slots: Any, values: Mapping[str, ArgValue]) -> None:
    """Write keyword arguments into a map of ``Value`` (an optimizer's or a schedule's); a tuple
    of ints travels as integers, any other tuple as numbers."""
    for key, value in values.items():
        _put(slots[key], value)


def _put(slot: pb.Value, value: ArgValue) -> None:
    if isinstance(value, bool):
        slot.flag = value
    elif isinstance(value, int):
        slot.integer = value
    elif isinstance(value, float):
        slot.number = value
    elif isinstance(value, str):
        slot.text = value
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        slot.integers.values.extend(value)
    else:
        slot.numbers.values.extend(float(v) for v in value)
