"""A ps task's service over a model in shared memory, for a task served from several processes.

The plain :class:`~psframe.ps.service.ParameterServerService` knows nothing of
serving processes (:mod:`psframe.ps.serving.serving_processes`); this module puts one
over a :class:`~psframe.ps.serving.shared_store.SharedStore`:

- :func:`shared_service` gives a service whose store (variables, optimizer
  state, counters, lock), push ledger and worker clock live in the shared
  folder, so that every process of the task sees one model, one global step
  and one record of each worker's pushes.
- :class:`Publisher` wraps the owner's service: after a call that may have
  changed the model (Init, PushPull), it publishes the model for the serving
  processes to map once it can be shared, and again when restored state
  replaced it. Until then, and in synchronous training, the serving
  processes forward every push to the owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from psframe.cluster import ClusterSpec
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.service import ParameterServerService
from psframe.ps.serving.shared_store import SharedStore, publish_store
from psframe.ps.serving.store_memory import SharedStoreMemory
from psframe.ps.store import VariableStore

log = logging.getLogger(__name__)


def shared_service(
    shared: SharedStore,
    cluster: ClusterSpec,
    task_index: int,
    store: VariableStore | None = None,
    **options: Any,
) -> ParameterServerService:
    """A ps service whose model, push ledger and worker clock live in ``shared``.

    Args:
        shared: the task's shared folder (the owner's, or a serving process's view of it).
        cluster, task_index: the task.
        store: the store over the shared model (a serving process maps what the owner
            published); default: an empty one allocating in ``shared`` (the owner's).
        options: the service's other keyword arguments (timeouts, checkpoint folder, security,
            ``max_workers``...).
    """
    task_name = ClusterSpec.task_name("ps", task_index)
    if store is None:
        store = VariableStore(
            task_name, lock=shared.lock, counters=shared.counters, memory=SharedStoreMemory(shared.allocate)
        )
    service = ParameterServerService(
        cluster,
        task_index,
        store,
        ledger=PushLedger(shared.slots, shared.push_counts),
        last_seen=shared.last_seen,
        **options,
    )
    service.live_relayout = False  # the serving processes share one layout, made once
    return service


class Publisher:
    """The owner's service, publishing its model to the serving processes whenever it was made anew.

    Args:
        service: the owner's service (made by :func:`shared_service`).
        shared: the task's shared folder, as its owner.
    """

    def __init__(self, service: ParameterServerService, shared: SharedStore) -> None:
        if not shared.owner:
            raise ValueError("only the owner of a shared folder publishes its model")
        self.service = service
        self.task_name = service.task_name
        self._shared = shared
        # The store's generation last published, or last found impossible to share:
        # a new generation (variables made anew, e.g. restored) is tried again.
        self._settled = -1
        self.publish()  # a model restored when the service was made

    def publish(self) -> None:
        """Publish the model if it changed since it was last published and can be shared
        now (asynchronous training only: a sync round lives in the owner, and every sync
        push is forwarded to it)."""
        store = self.service.store
        if store.generation == self._settled or not store.ready or self.service.aggregator is not None:
            return
        published = publish_store(self._shared, store, self.task_name)
        if published is not None:  # True, or False (it cannot be): settled until it is made anew
            self._settled = store.generation

    def handlers(self) -> dict[str, Callable]:
        """The service's handlers; Init and PushPull publish what they changed."""
        handlers = dict(self.service.handlers())
        init, push_pull = handlers["Init"], handlers["PushPull"]

        def init_and_publish(data: bytes) -> bytes:
            reply = init(data)
            self.publish()
            return reply

        def push_pull_and_publish(requests: Iterator[bytes]) -> Iterator[bytes]:
            for reply in push_pull(requests):
                self.publish()  # before the worker hears back: its next push may reach a serving process
                yield reply

        handlers["Init"], handlers["PushPull"] = init_and_publish, push_pull_and_publish
        return handlers
