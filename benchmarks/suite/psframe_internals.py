"""The suite's one door below psframe's public API: every internal name the suite uses, and nothing else.

Some sections measure a piece of psframe that the public API does not offer
alone, and reach it here, and only here:

- the transport, security and memory sections time a worker's push+pull with
  no model around it: psframe's own client (``PsClient``) sends the requests
  the trainer's step plan makes (``StepPlan``), as a ``Trainer`` step would;
- the scaling section and the report count a step's messages from that plan,
  and the memory section cuts variables into the trainer's parts
  (``DEFAULT_MAX_SHARD_BYTES``);
- the sparse section asks psframe's table placement how it splits a batch's
  ids over the ps tasks (``place_tables``, ``Table.split``), and its ps tasks
  what they hold (a tool's ``PsClient``);
- the row-rate section calls a ps task's row path in this process, one
  thread, with no network: a store's fixed tables (``VariableStore``) and a
  dynamic table's part (``DynamicRows``, ``DynamicTableSpec``);
- the compact rows section weighs a dynamic table part's rows and their
  per-row optimizer state (``is_row_state``), and scores int8 rows as a
  server would, an id it lacks as its initial row (``initial_rows``).

A change to those internals breaks the suite in this module alone; the layout
test (``tests/unit/test_benchmark_layout.py``) keeps every other suite module on
the public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import psframe
from psframe.cluster.placement import DEFAULT_MAX_SHARD_BYTES, Shard, VariableInfo, place
from psframe.optim import OptimizerSpec
from psframe.optim.row_state import is_row_state
from psframe.ps.store import VariableStore
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.row_math import initial_rows
from psframe.tables.spec import DynamicTableSpec, place_tables
from psframe.wire import psframe_pb2, transport
from psframe.wire.encoding import MessageEncoding, parse
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from psframe.worker.model.table_views import Table
from psframe.worker.plan.step_plan import Request, Slot, StepPlan, batches

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DynamicRows",
    "DynamicTableSpec",
    "PsClient",
    "Step",
    "Tensors",
    "VariableStore",
    "create_variables",
    "initial_rows",
    "is_row_state",
    "push_pull",
    "push_pull_rpc_kind",
    "shard_requests",
    "step_message_bytes",
    "table_split_loads",
    "tool_client",
    "worker_client",
]

Tensors = list[tuple[str, torch.Tensor]]
Step = list[tuple[Request, Tensors]]  # a step's planned requests, each with its gradients


# ---------------------------------------------------------------- clients


def worker_client(cluster: psframe.ClusterSpec, rpc_timeout: float, security: psframe.Security | None) -> PsClient:
    """Worker 0's client of ``cluster``'s ps tasks (call ``wait_for_ps`` before using it)."""
    return PsClient(cluster, 0, rpc_timeout=rpc_timeout, security=security)


def tool_client(cluster: psframe.ClusterSpec, rpc_timeout: float) -> PsClient:
    """A tool's client: it asks the ps tasks what they hold and who serves, and is no worker."""
    return PsClient(cluster, 0, job_name="tool", rpc_timeout=rpc_timeout)


# ---------------------------------------------------------------- a worker's step


def _slots(shards: Sequence[Tensors]) -> list[Slot]:
    """``shards[i]``'s tensors as whole variables held by ps task i."""
    return [
        Slot(
            Shard(name, name, ps, 0, tensor.shape[0] if tensor.dim() else 1, tuple(tensor.shape), tensor.nbytes), tensor
        )
        for ps, tensors in enumerate(shards)
        for name, tensor in tensors
    ]


def shard_requests(shards: Sequence[Tensors], max_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Step:
    """The requests of one asynchronous worker step, as the trainer plans them
    (:class:`psframe.worker.plan.step_plan.StepPlan`), each with its gradients: ``shards[i]``."""
    by_name = {name: tensor for tensors in shards for name, tensor in tensors}
    plan = StepPlan.make(_slots(shards), len(shards), max_bytes, sync=False)
    return [(request, [(s.name, by_name[s.name]) for s in request.push]) for request in plan.step]


def create_variables(client: PsClient, shards: Sequence[Tensors], optimizer: OptimizerSpec) -> None:
    """Create ``shards[i]`` on ps task i with ``optimizer`` (one Init request at a time, as the trainer does)."""
    slots = _slots(shards)
    for ps, batch in batches(slots, len(shards), DEFAULT_MAX_SHARD_BYTES):
        control_calls.create(
            client,
            ps,
            [s for s in slots if s.shard.ps_task == ps],
            [(s.name, s.param) for s in batch],
            optimizer,
            sync=None,
            checkpoint_dir=None,
        )
    # Every ps task holds its variables once its last Init request is in.
    control_calls.wait_for_ps(client, timeout=30.0, ready=True)


def push_pull(client: PsClient, requests: Step) -> list[list[torch.Tensor]]:
    """One worker step: push the gradients of ``requests``, pull the same variables back."""
    return [reply.values for reply in client.push_pull(requests, step=0)]


def push_pull_rpc_kind() -> str:
    """ "stream" if PushPull is a bidirectional streaming RPC in psframe.proto, else "unary"."""
    return "stream" if transport.METHODS["PushPull"].streaming else "unary"


def step_message_bytes(variables: Sequence[tuple[str, tuple[int, ...]]], num_ps: int) -> list[int]:
    """The bytes pushed by each message of one async step of a worker whose float32 parameters are
    ``variables`` (name, shape), as psframe's placement and step plan make them with the trainer's
    defaults (messages of at most ``DEFAULT_MAX_SHARD_BYTES``)."""
    placement = place([VariableInfo(name, shape, 4) for name, shape in variables], num_ps)
    # The plan reads only the shards: no parameter is needed to count messages.
    slots = [Slot(shard, None) for shard in placement.shards]
    plan = StepPlan.make(slots, num_ps, DEFAULT_MAX_SHARD_BYTES, sync=False)
    return [sum(slot.shard.nbytes for slot in request.push) for request in plan.step]


# ---------------------------------------------------------------- tables


def table_split_loads(rows: int, dim: int, num_ps: int, partition: str, ids: torch.Tensor) -> list[float]:
    """How many of ``ids`` each ps task gets of a ``rows`` x ``dim`` float32 table cut by
    ``partition`` ("mod" or "range") over ``num_ps`` ps tasks, as a worker splits a lookup."""
    shards = place_tables([VariableInfo("table", (rows, dim), 4)], num_ps, partition=partition)
    table = Table("table", None, [Slot(shard, None) for shard in shards])
    return [float(part.numel()) for _, part, _ in table.split(ids)]


def gradient_message(gradient: torch.Tensor) -> tuple[Callable[[], bytes], Callable[[bytes], list[torch.Tensor]]]:
    """How a worker's request carries ``gradient`` (a contiguous CPU tensor): ``encode()`` makes the
    message of it, as every step does (its layout worked out once), and ``decode(message)`` reads the
    tensor back, as a ps task does."""
    encoding = MessageEncoding(psframe_pb2.PushPullHeader, [("w", gradient.dtype, tuple(gradient.shape))])
    buffers = encoding.buffers([gradient])

    def encode() -> bytes:
        return encoding.encode(psframe_pb2.PushPullHeader(step=1), buffers)

    def decode(message: bytes) -> list[torch.Tensor]:
        return encoding.tensors(parse(message, psframe_pb2.PushPullHeader))

    return encode, decode
