"""Layouts of one model: its replica bound to a placement on a cluster's ps tasks, and a client of them.

A worker makes one at start-up, and one more for each layout a re-layout (or a stage of one)
takes the model to (:mod:`psframe.worker.session.relayout`).
"""

from __future__ import annotations

from typing import Any

import torch

from psframe.cluster import ClusterSpec
from psframe.cluster.placement import ShardPlacement
from psframe.config.liveness import Liveness
from psframe.config.options import BoundedStaleness, Placement
from psframe.config.security import Security
from psframe.worker.client.operations import RelayoutWord
from psframe.worker.client.ps_client import PsClient
from psframe.worker.model.replica import Replica, place_model
from psframe.worker.model.staging import HostStaging
from psframe.worker.session.relayout import Layout


class LayoutMaker:
    """Makes the replicas, placements and clients of one worker's model.

    Args:
        model: the local model (on ``device``).
        device: where it computes.
        placement: where the variables go (the option group as given).
        sync: synchronous training.
        wire_dtype: as the Trainer's.
        task_index: the worker's.
        rpc_timeout, shared_memory, security, liveness, staleness: the clients' settings.

    Its clients keep what ps 0's replies say of re-layouts in one :attr:`relayout_word`, which
    the chief reads after its steps whatever layout it trains on (:mod:`psframe.worker.relayout_leader`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        placement: Placement,
        *,
        sync: bool,
        wire_dtype: torch.dtype | None,
        task_index: int,
        rpc_timeout: float,
        shared_memory: bool,
        security: Security,
        liveness: Liveness,
        staleness: BoundedStaleness | None,
    ) -> None:
        self._model, self._device, self._placement = model, device, placement
        self._sync, self._wire_dtype = sync, wire_dtype
        self.relayout_word = RelayoutWord()
        self._client_options: dict[str, Any] = {
            "rpc_timeout": rpc_timeout,
            "wire_dtype": wire_dtype,
            "shared_memory": shared_memory,
            "security": security,
            "liveness": liveness,
            "staleness": staleness,
            "relayout_word": self.relayout_word,
        }
        self._task_index = task_index

    def replica(self, num_ps: int, placement: ShardPlacement | None = None) -> Replica:
        """The model bound to its placement on ``num_ps`` ps tasks (again after a re-layout), or to
        ``placement`` (a stage of a re-layout)."""
        return Replica(
            self._model,
            num_ps,
            HostStaging(self._device),
            sync=self._sync,
            wire_dtype=self._wire_dtype,
            placement=placement,
            **self._placement_options(),
        )

    def place(self, num_ps: int) -> ShardPlacement:
        """The model's own placement on ``num_ps`` ps tasks."""
        return place_model(self._model, num_ps, **self._placement_options())

    def client(self, cluster: ClusterSpec) -> PsClient:
        """A client of the ps tasks of ``cluster``."""
        return PsClient(cluster, self._task_index, **self._client_options)

    def layout(self, cluster: ClusterSpec, placement: ShardPlacement) -> Layout:
        """The model bound to ``placement`` on the ps tasks of ``cluster``, and a client of them."""
        return Layout(cluster, self.client(cluster), self.replica(cluster.num_ps, placement))

    def _placement_options(self) -> dict[str, Any]:
        given = self._placement
        return {
            "variable_devices": dict(given.variable_devices),
            "strategy": given.strategy,
            "min_partition_bytes": given.min_partition_bytes,
            "dense_parts": given.dense_parts,
            "soft_placement": given.soft,
            "max_shard_bytes": given.max_shard_bytes,
            "table_partition": given.table_partition,
            "table_parts": given.table_parts,
        }
