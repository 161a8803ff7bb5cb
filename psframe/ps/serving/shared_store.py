"""The memory a ps task's serving processes share: variables, optimizer state, counters, one lock.

A ps task served from several processes (:mod:`psframe.ps.serving.serving_processes`) keeps
its variables and their optimizer state in files of a folder in shared
memory (``/dev/shm``), which every one of its processes maps
(``torch.from_file(..., shared=True)``): an update applied by any process is
applied to the one copy. Beside them:

- ``header``: int64 counters: the model's version (bumped at each
  publication), the global step, applied and refused pushes, and the count
  the fixed table rows' versions are stamped from (:mod:`psframe.ps.store.row_versions`);
- ``last_seen``: when each worker was last heard from, for the roster;
- ``push_ledger``: each worker's last push applied and steps applied
  (:mod:`psframe.ps.protocol.ledger`);
- ``lock``: one lock for all: ``flock`` between processes, a reentrant
  lock between the threads of each;
- ``model.json``: which file holds which variable and which optimizer state,
  written by the owner once every variable has its optimizer state (torch.optim
  makes it at a variable's first update, in whichever process applies it: so
  the owner applies every update until then, and the others forward to it).

Only the owner allocates and publishes; the others map what it published.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy
import torch

from psframe.errors import PortInUseError
from psframe.memory.scratch import remove_orphans
from psframe.optim import OptimizerSpec
from psframe.optim.lr_scheduler import ScheduleSpec
from psframe.ps.protocol.ledger import LEDGER_ROWS, NOT_HELD
from psframe.wire.dtypes import dtype_from_name, dtype_name

log = logging.getLogger(__name__)

_PREFIX = "psframe-ps-"
_HEADER_SLOTS = 8  # model version, global step, pushes, refused pushes, row version count, and room to grow
_MODEL = "model.json"


class SharedLock:
    """A reentrant lock held across the threads of this process and the processes of the task."""

    def __init__(self, path: str) -> None:
        self._threads = threading.RLock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._depth = 0  # guarded by self._threads

    def acquire(self, blocking: bool = True) -> bool:
        if not self._threads.acquire(blocking):
            return False
        if self._depth == 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._threads.release()
                return False
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    # What threading.Condition needs of a reentrant lock (the sync barrier waits on one
    # over this lock): release every level while waiting, take them all back after.
    # The stubs of threading.RLock leave these private methods out.

    def _is_owned(self) -> bool:
        return self._threads._is_owned()  # type: ignore[attr-defined]

    def _release_save(self) -> tuple[int, Any]:
        depth, self._depth = self._depth, 0
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return depth, self._threads._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, saved: tuple[int, Any]) -> None:
        depth, state = saved
        self._threads._acquire_restore(state)  # type: ignore[attr-defined]
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth = depth

    def close(self) -> None:
        os.close(self._fd)


class PortLock:
    """A port this process's task serves from several processes, held against other such tasks.

    Tasks that listen with ``SO_REUSEPORT`` could otherwise share a port
    unnoticed; a task of one process cannot (its socket refuses to share).
    The lock is a ``flock`` on a file named after the port: it ends with the process.

    Raises:
        PortInUseError: another task of several processes on this host holds the port.
    """

    def __init__(self, port: int, task_name: str) -> None:
        self._fd = os.open(
            os.path.join(tempfile.gettempdir(), f"psframe-port-{port}.lock"), os.O_RDWR | os.O_CREAT, 0o600
        )
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise PortInUseError(
                f"{task_name} cannot listen on port {port}: another ps task served from "
                f"several processes on this host holds it; stop it or give this task a free port"
            ) from None

    def release(self) -> None:
        os.close(self._fd)


class SharedStore:
    """One ps task's shared folder, as its owner (``create``) or a serving process (:meth:`attach`) sees it.

    Args:
        folder: the folder.
        num_workers: the workers of the cluster (members from the start).
        slots: the task's worker slots (``max_workers``; one ``last_seen`` and ledger column each).
        owner: True in the process that made the folder (it allocates, publishes and removes it).
    """

    def __init__(self, folder: str, num_workers: int, slots: int, *, owner: bool) -> None:
        self.folder = folder
        self.owner = owner
        self.slots = slots
        self._header = self._map("header", torch.int64, _HEADER_SLOTS).numpy()
        self.counters = self._header[1:5]  # global step, pushes, refused pushes, row versions: see VariableStore
        self.last_seen = self._map("last_seen", torch.float64, slots).numpy()
        # Each worker's last push applied and steps applied (psframe.ps.protocol.ledger): a worker's
        # stream sent again after a reconnect may reach another process of the task.
        # And the checkpoint cut's hold on them (psframe.ps.protocol.ledger): any process may apply a push.
        rows = LEDGER_ROWS
        self.push_counts = self._map("push_ledger", torch.int64, rows * slots).numpy().reshape(rows, slots)
        if owner:
            self.push_counts[3] = NOT_HELD
        if owner:  # the cluster's workers are members from the start; other slots once they join
            self.last_seen[:num_workers] = time.monotonic()
        self.lock = SharedLock(os.path.join(folder, "lock"))
        self._files: dict[int, str] = {}  # data_ptr -> file, of what the owner allocated
        self._next = 0

    @classmethod
    def create(cls, num_workers: int, slots: int | None = None) -> SharedStore:
        """A new folder, in ``/dev/shm`` where there is one, for the owner.

        Folders left by owners that died without stopping (SIGKILL) are removed
        first: their names carry their owner's pid.
        """
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_orphans(base, _PREFIX)
        folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=base)
        return cls(folder, num_workers, slots or num_workers, owner=True)

    @classmethod
    def attach(cls, folder: str, num_workers: int, slots: int | None = None) -> SharedStore:
        return cls(folder, num_workers, slots or num_workers, owner=False)

    def _map(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.from_file(os.path.join(self.folder, name), shared=True, size=numel, dtype=dtype)

    @property
    def version(self) -> int:
        """The version of the model published last (0: none yet)."""
        return int(self._header[0])

    def allocate(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Memory for a variable or optimizer state, in a new file of the folder (owner only)."""
        name = f"t{self._next}"
        self._next += 1
        numel = 1
        for dim in shape:
            numel *= dim
        tensor = self._map(name, dtype, max(numel, 1))[:numel].view(shape)
        self._files[tensor.data_ptr()] = name
        return tensor

    def publish(
        self,
        variables: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping[str, Any]],
        optimizer: OptimizerSpec,
        tables: Sequence[str] = (),
        table_optimizer: OptimizerSpec | None = None,
        row_versions: Mapping[str, torch.Tensor] | None = None,
    ) -> bool:
        """Say where the model is, for the serving processes to map (owner, under :attr:`lock`).

        Returns:
            False, publishing nothing, if some of it is not in the folder (state that is
            not a tensor: it could not be shared, so the owner keeps applying every update).
        """
        try:
            model = {
                "optimizer": _spec_to_json(optimizer),
                "tables": list(tables),
                "table_optimizer": None if table_optimizer is None else _spec_to_json(table_optimizer),
                "variables": {name: self._describe(value) for name, value in variables.items()},
                "states": {
                    name: {key: self._describe(value) for key, value in state.items()} for name, state in states.items()
                },
                "row_versions": {name: self._describe(value) for name, value in (row_versions or {}).items()},
            }
        except (KeyError, TypeError):
            return False
        tmp = os.path.join(self.folder, f"{_MODEL}.tmp")
        with open(tmp, "w") as f:
            json.dump(model, f)
        os.replace(tmp, os.path.join(self.folder, _MODEL))
        self._header[0] += 1
        return True

    def _describe(self, tensor: Any) -> dict:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{type(tensor).__name__} cannot be shared")
        return {"file": self._files[tensor.data_ptr()], "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}

    def load(
        self,
    ) -> tuple[
        dict[str, torch.Tensor],
        dict[str, dict[str, torch.Tensor]],
        OptimizerSpec,
        list[str],
        OptimizerSpec | None,
        dict[str, torch.Tensor],
    ]:
        """The published model, mapped: variables, optimizer state, optimizer, the
        embedding tables, their optimizer and their rows' versions (serving processes)."""
        with open(os.path.join(self.folder, _MODEL)) as f:
            model = json.load(f)

        def mapped(entry: dict) -> torch.Tensor:
            shape = tuple(entry["shape"])
            numel = int(numpy.prod(shape)) if shape else 1
            return self._map(entry["file"], dtype_from_name(entry["dtype"]), max(numel, 1))[:numel].view(shape)

        variables = {name: mapped(entry) for name, entry in model["variables"].items()}
        states = {name: {key: mapped(entry) for key, entry in state.items()} for name, state in model["states"].items()}
        table_optimizer = model["table_optimizer"]
        return (
            variables,
            states,
            _spec_from_json(model["optimizer"]),
            model["tables"],
            None if table_optimizer is None else _spec_from_json(table_optimizer),
            {name: mapped(entry) for name, entry in model["row_versions"].items()},
        )

    def close(self) -> None:
        """Release the lock's file; the owner also removes the folder (mapped memory stays valid)."""
        self.lock.close()
        if self.owner:
            shutil.rmtree(self.folder, ignore_errors=True)


def _spec_to_json(spec: OptimizerSpec) -> dict:
    return {"name": spec.name, "kwargs": dict(spec.kwargs), "schedule": spec.schedule and spec.schedule.to_dict()}


def _spec_from_json(spec: dict) -> OptimizerSpec:
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["kwargs"].items()}
    schedule = spec.get("schedule")  # each process steps it with the shared global step
    return OptimizerSpec(spec["name"], kwargs, None if schedule is None else ScheduleSpec.from_dict(schedule))


def publish_store(memory: SharedStore, store: Any, task_name: str) -> bool | None:
    """Publish a store's model once every variable has its optimizer state (owner, under the store's lock).

    Returns:
        True once published; None while some variable has no optimizer state
        yet (try again after the next update); False if it cannot be shared
        (optimizer state that is not a tensor, or a dynamic table, whose rows grow
        in this process's memory): the owner then keeps applying every update.
    """
    with store.lock:
        if store.dynamic_tables:
            log.info("%s: dynamic tables live in this process; it applies every update", task_name)
            return False
        unshared = store.schedules.unshared()
        if unshared is not None:
            log.info("%s: %s; it applies every update", task_name, unshared)
            return False
        if store.optimizer_state() is None:
            return None
        store.share_state()
        names = store.names
        published = memory.publish(
            dict(zip(names, store.read(names))),
            store.optimizer_state(),
            store.optimizer_spec,
            sorted(store.tables),
            store.table_optimizer_spec,
            store.row_versions(),
        )
    if published:
        log.info("%s: the model is shared with the serving processes (version %d)", task_name, memory.version)
    else:
        log.info("%s: the optimizer's state cannot be shared; this process applies every update", task_name)
    return published
