"""A task's TaskInfo reads as a plain TaskStatus: names and Python values, no wire messages.

This file holds the unit tier's tests of the subject; `tests/service/test_status.py` holds the other
tiers'.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psframe import optim
from psframe.status import TaskState, TaskStatus, VariableStatus, WorkerStatus
from psframe.wire import messages
from psframe.wire import psframe_pb2 as pb


def _info(**fields) -> pb.TaskInfo:
    return pb.TaskInfo(
        job_name="ps",
        task_index=1,
        address="h1:2222",
        cluster_spec='{"ps": ["h0:2222", "h1:2222"], "worker": ["h2:2222"]}',
        cluster_fingerprint="abc",
        state=pb.TaskInfo.READY,
        version="1.2.3",
        pid=42,
        **fields,
    )


def test_every_field_of_a_ps_task_s_info_reads_as_python_values():
    info = _info(
        global_step=7,
        bytes_held=4096,
        applied_steps=9,
        rejected_pushes=1,
        dropped_gradients=2,
        finished_workers=[0],
        restored_step=5,
        checkpoint_dir="/ckpt",
        variables=[
            pb.VariableDef(name="w/part_1", variable="w", dtype="float32", shape=[3, 4]),
            pb.VariableDef(
                name="t", variable="t", dtype="float32", shape=[0, 4], table=True, dynamic=pb.DynamicTableDef()
            ),
        ],
        optimizer=messages.optimizer_to_proto(optim.Adam(lr=0.5)),
        table_optimizer=messages.optimizer_to_proto(optim.Adagrad(lr=0.1)),
        sync=pb.SyncDef(replicas_to_aggregate=1, total_num_replicas=2, timeout_seconds=30.0),
        workers=[
            pb.WorkerSeen(task_index=0, seconds_ago=1.5, finished=True, applied_steps=3, last_push_id=4),
            pb.WorkerSeen(task_index=1, seconds_ago=-1),
        ],
    )
    status = messages.task_status(info)
    assert status == TaskStatus(
        job_name="ps",
        task_index=1,
        address="h1:2222",
        cluster_spec=info.cluster_spec,
        cluster_fingerprint="abc",
        state=TaskState.READY,
        version="1.2.3",
        pid=42,
        global_step=7,
        variables=(
            VariableStatus("w/part_1", "float32", (3, 4), "w"),
            VariableStatus("t", "float32", (0, 4), "t", table=True, dynamic=True),
        ),
        bytes_held=4096,
        optimizer=optim.Adam(lr=0.5),
        table_optimizer=optim.Adagrad(lr=0.1),
        sync=optim.SyncReplicas(1, 2, 30.0),
        applied_steps=9,
        rejected_pushes=1,
        dropped_gradients=2,
        finished_workers=(0,),
        workers=(WorkerStatus(0, 1.5, True, 3, 4), WorkerStatus(1, None, False, 0, 0)),
        restored_step=5,
        checkpoint_dir="/ckpt",
    )
    assert status.name == "/job:ps/task:1" and status.variables[0].key == ("w/part_1", "float32", (3, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.global_step = 8  # type: ignore[misc]


@pytest.mark.parametrize("state", list(TaskState), ids=lambda s: s.value)
def test_every_state_has_its_name(state):
    info = _info(restored_step=-1)
    info.state = pb.TaskInfo.State.Value(state.name)
    assert messages.task_status(info).state is state


def test_what_a_task_without_a_model_leaves_unset_reads_as_none():
    status = messages.task_status(_info(restored_step=-1))
    assert (status.optimizer, status.table_optimizer, status.sync) == (None, None, None)
    assert (status.restored_step, status.checkpoint_dir, status.variables, status.workers) == (None, None, (), ())


# ---- applied steps: one meaning, in a ps task's status and in its last line


class _Clicks(torch.nn.Module):
    """A dense head, over an embedding table's rows when ``table``."""

    def __init__(self, table: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=True) if table else None
        self.head = torch.nn.Linear(4, 1)

    def loss(self, step: int, worker: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * step + worker)
        x = (
            self.emb(torch.randint(0, 10, (6,), generator=g))
            if self.emb is not None
            else torch.randn(6, 4, generator=g)
        )
        return torch.nn.functional.mse_loss(self.head(x).squeeze(1), torch.rand(6, generator=g))
