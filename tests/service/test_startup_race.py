"""A ps task becomes READY in one step: nobody sees it ready without its variables.

A worker that asks GetInfo while the chief's Init completes must see either
a task still waiting for the model, or the model whole (its variable
definitions, its barrier). Seen across hosts before this was fixed: a worker
failed with ``ClusterMismatchError: ... 24 variables expected, 0 found``
right after the ps logged that it created them.
"""

from __future__ import annotations

import threading

import pytest
import torch

import psframe
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb

WAIT_S = 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _info_asked_right_after_create(monkeypatch, server: psframe.Server) -> list[pb.TaskInfo]:
    """Make every store.create that creates the model ask GetInfo from another thread
    the moment it returns; the answers, once those threads are done."""
    answers: list[pb.TaskInfo] = []
    threads: list[threading.Thread] = []
    create = VariableStore.create

    def create_then_ask(self, *args, **kwargs):
        created = create(self, *args, **kwargs)
        if created:
            thread = threading.Thread(target=lambda: answers.append(server.service.info()))
            thread.start()
            # Without the fix the answer comes at once (READY, no variables); with
            # it the thread waits for the store's lock, held until Init is done.
            thread.join(WAIT_S)
            threads.append(thread)
        return created

    monkeypatch.setattr(VariableStore, "create", create_then_ask)
    return answers, threads


def _check(answers, threads, expected_variables: int) -> None:
    for thread in threads:
        thread.join(10.0)
        assert not thread.is_alive()
    assert answers, "the model was never created"
    for info in answers:
        if info.state == pb.TaskInfo.READY:
            assert len(info.variables) == expected_variables, "READY without its variable definitions"


@pytest.mark.parametrize("sync", [None, psframe.SyncReplicas(replicas_to_aggregate=1)], ids=["async", "sync"])
def test_get_info_never_sees_ready_without_the_whole_model(monkeypatch, local_cluster, sync):
    """READY comes with every variable definition, and (sync) with the barrier."""
    cluster = local_cluster(num_ps=1, num_workers=1, start_ps=False)
    with psframe.Server(cluster, "ps", 0, serving_processes=1) as server:
        answers, threads = _info_asked_right_after_create(monkeypatch, server)
        model = _model()
        with psframe.Trainer(
            model,
            cluster,
            task_index=0,
            optimizer=psframe.optim.SGD(lr=0.1),
            sync=sync,
            transport=psframe.Transport(connect_timeout=30.0),
        ):
            pass
        _check(answers, threads, expected_variables=len(list(model.parameters())))
        if sync is not None:
            assert all(info.HasField("sync") for info in answers if info.state == pb.TaskInfo.READY)
