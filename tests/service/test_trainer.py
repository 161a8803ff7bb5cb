"""The trainer against real in-process ps servers on free loopback ports.

This file holds the service tier's tests of the subject; `tests/unit/test_trainer.py` holds the
other tiers'.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

import psframe
from psframe import cli
from psframe.errors import (
    ClusterMismatchError,
    ConnectTimeoutError,
    PortInUseError,
)
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from tests.conftest import free_cluster


def make_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize(
    "placement",
    [
        psframe.Placement(),
        psframe.Placement(strategy="round_robin"),
        # Force every weight matrix to be partitioned along dim 0 across both ps tasks.
        psframe.Placement(min_partition_bytes=64, max_shard_bytes=160),
    ],
    ids=["greedy", "round_robin", "partitioned"],
)
@pytest.mark.parametrize(
    "optimizer",
    [psframe.optim.SGD(lr=0.1, momentum=0.9, nesterov=True), psframe.optim.Adam(lr=0.01)],
    ids=["sgd_nesterov", "adam"],
)
def test_one_worker_matches_local_torch_optim_exactly(local_cluster, placement, optimizer):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = make_model(), make_model()
    local_opt = getattr(torch.optim, optimizer.name)(reference.parameters(), **optimizer.kwargs)
    with psframe.Trainer(model, cluster, optimizer=optimizer, placement=placement) as trainer:
        if placement.min_partition_bytes == 64:
            assert any(s.partitioned for s in trainer.placement.shards)
        for step in range(5):
            assert trainer.step(loss_of(model, step)) == step + 1
            local_opt.zero_grad()
            loss_of(reference, step).backward()
            local_opt.step()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(p, q), f"{name} differs at step {step}"
        assert trainer.stats.local_step == 5 and trainer.should_stop() is False


def test_second_worker_receives_the_chiefs_variables_and_updates(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=2)
    chief_model, other_model = make_model(seed=0), make_model(seed=1)
    with psframe.Trainer(chief_model, cluster, task_index=0) as chief:
        with psframe.Trainer(other_model, cluster, task_index=1) as other:
            # The non-chief's own initial values were replaced by the chief's.
            for p, q in zip(chief_model.parameters(), other_model.parameters()):
                assert torch.equal(p, q)
            chief.step(loss_of(chief_model, 0))
            other.step(loss_of(other_model, 1))
            assert other.global_step == 2
            chief.pull()
            for p, q in zip(chief_model.parameters(), other_model.parameters()):
                assert torch.equal(p, q)


def test_a_ps_task_given_no_variable_is_ready_and_training_goes_on(local_cluster):
    cluster = local_cluster(num_ps=3, num_workers=2)
    model, local = torch.nn.Linear(4, 1, bias=False), torch.nn.Linear(4, 1, bias=False)
    local.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with (
        psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1)) as chief,
        psframe.Trainer(torch.nn.Linear(4, 1, bias=False), cluster, task_index=1) as other,
    ):
        assert {s.ps_task for s in chief.placement.shards} == {0}  # ps 1 and 2 hold nothing
        for _ in range(3):
            chief.step(torch.nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            torch.nn.functional.mse_loss(local(x), y).backward()
            opt.step()
        assert other.global_step == 0 and torch.equal(model.weight, local.weight)


def test_explicit_device_strings_win(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = make_model()
    devices = {"0.weight": "/job:ps/task:1", "0.bias": "/job:ps/task:1", "2.weight": "/job:ps/task:1"}
    with psframe.Trainer(model, cluster, placement=psframe.Placement(variable_devices=devices)) as trainer:
        client = PsClient(cluster, 0)
        try:
            on_ps1 = {d.name for d in control_calls.get_info(client, 1).variables}
        finally:
            client.close()
        assert set(devices) <= on_ps1
        assert trainer.placement.bytes_per_ps()[1] > trainer.placement.bytes_per_ps()[0]


@pytest.mark.service
def test_missing_ps_gives_up_within_the_deadline_naming_it():
    cluster = free_cluster(2, 1)
    started = time.monotonic()
    with pytest.raises(ConnectTimeoutError) as error:
        psframe.Trainer(make_model(), cluster, transport=psframe.Transport(connect_timeout=1.0)).connect()
    assert time.monotonic() - started < 10
    message = str(error.value)
    for i in range(2):
        assert f"/job:ps/task:{i} at {cluster.task_address('ps', i)}" in message


def test_non_chief_waits_for_the_model_and_says_so(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=2)
    with pytest.raises(ConnectTimeoutError, match="hold the model"):
        psframe.Trainer(make_model(), cluster, task_index=1, transport=psframe.Transport(connect_timeout=1.0)).connect()


def test_workers_with_another_cluster_are_refused(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    other = psframe.ClusterSpec(
        {"ps": cluster.job_tasks("ps"), "worker": cluster.job_tasks("worker") + ["127.0.0.1:1"]}
    )
    with pytest.raises(ClusterMismatchError, match="cluster"):
        psframe.Trainer(make_model(), other, transport=psframe.Transport(connect_timeout=5)).connect()


def test_a_worker_with_another_model_is_refused(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=2)
    with psframe.Trainer(make_model(hidden=16), cluster, task_index=0):
        with pytest.raises(ClusterMismatchError, match="does not match"):
            psframe.Trainer(
                make_model(hidden=8), cluster, task_index=1, transport=psframe.Transport(connect_timeout=5)
            ).connect()


def test_a_restarted_chief_takes_up_the_variables_already_there(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=2)
    first = make_model(seed=0)
    crashed = psframe.Trainer(first, cluster, transport=psframe.Transport(connect_timeout=10)).connect()
    crashed.step(loss_of(first, 0))  # then "dies": never reports that it finished
    again = make_model(seed=7)
    with psframe.Trainer(again, cluster, transport=psframe.Transport(connect_timeout=10)) as trainer:
        assert trainer.global_step == 1
        for p, q in zip(again.parameters(), first.parameters()):
            assert torch.equal(p, q)
        with pytest.raises(ClusterMismatchError, match="SGD"):
            psframe.Trainer(
                make_model(),
                cluster,
                optimizer=psframe.optim.Adam(lr=1.0),
                transport=psframe.Transport(connect_timeout=10),
            ).connect()


def test_no_training_after_every_worker_finished(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    with psframe.Trainer(make_model(), cluster, transport=psframe.Transport(connect_timeout=10)):
        pass
    with pytest.raises(psframe.errors.TrainingFinishedError, match="training is over"):
        psframe.Trainer(make_model(), cluster, transport=psframe.Transport(connect_timeout=10)).connect()


@pytest.mark.service
def test_port_in_use_is_a_clear_error():
    cluster = free_cluster(1, 1)
    host, port = cluster.task_address("ps", 0).split(":")
    with socket.socket() as taken:
        taken.bind((host, int(port)))
        taken.listen()
        with pytest.raises(PortInUseError, match=f"{host}:{port}"):
            psframe.Server(cluster, "ps", 0, serving_processes=1)
    with psframe.Server(cluster, "ps", 0, serving_processes=1):
        with pytest.raises(PortInUseError, match="/job:ps/task:0"):
            psframe.Server(cluster, "ps", 0, serving_processes=1)


def test_ping_prints_who_answers(local_cluster, capsys):
    cluster = local_cluster(num_ps=1, num_workers=1)
    with psframe.Trainer(make_model(), cluster):
        assert cli.main(["ping", f"grpc://{cluster.task_address('ps', 0)}"]) == 0
    out = capsys.readouterr().out
    assert "is /job:ps/task:0 (ready, global step 0, 4 variables" in out
    assert cluster.to_string() in out


@pytest.mark.service
def test_ping_of_nothing_fails_with_a_message(capsys):
    address = free_cluster(1, 1).task_address("ps", 0)
    assert cli.main(["ping", address, "--timeout", "0.5"]) == 1
    assert f"no psframe task answered at {address}" in capsys.readouterr().err


@pytest.mark.service
def test_server_join_returns_once_every_worker_finished():
    cluster = free_cluster(1, 2)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    try:
        assert server.join(timeout=0.2) is False
        for i in range(2):
            with psframe.Trainer(make_model(), cluster, task_index=i):
                pass
        assert server.join(timeout=10) is True
    finally:
        server.stop(grace=0.1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_worker_matches_local_sgd_exactly(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = make_model(), make_model().cuda()
    local_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with psframe.Trainer(
        model, cluster, device="cuda", optimizer=psframe.optim.SGD(lr=0.1), gpu_memory_fraction=0.5
    ) as trainer:
        assert next(model.parameters()).is_cuda
        for step in range(3):
            x, y = batch(step)
            trainer.step(torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()))
            local_opt.zero_grad()
            torch.nn.functional.cross_entropy(reference(x.cuda()), y.cuda()).backward()
            local_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            # The ps applies the update on the CPU: equal up to CPU/GPU rounding.
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.service
def test_a_ps_stops_waiting_for_workers_silent_after_others_finished():
    cluster = free_cluster(1, 2)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1, worker_timeout=0.5)
    try:
        with psframe.Trainer(make_model(), cluster, task_index=0):
            pass
        # Worker 1 never came: once worker 0 finished, its silence ends training.
        assert server.join(timeout=20) is True
        assert server.service.check_training_over()
    finally:
        server.stop(grace=0.1)


@pytest.mark.service
def test_a_ps_waits_for_a_worker_that_is_still_calling():
    cluster = free_cluster(1, 2)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1, worker_timeout=2.0)
    try:
        with psframe.Trainer(make_model(), cluster, task_index=0):
            pass
        with psframe.Trainer(make_model(), cluster, task_index=1) as trainer:
            assert server.join(timeout=0.2) is False  # worker 1 is alive: no exit yet
            for step in range(3):
                time.sleep(0.2)
                trainer.step(loss_of(trainer.model, step))
            assert server.join(timeout=0.1) is False
        assert server.join(timeout=10) is True
    finally:
        server.stop(grace=0.1)


@pytest.mark.service
def test_a_connect_that_cannot_succeed_ends_within_connect_timeout_whatever_it_waited_for():
    """One deadline for the whole connect: worker 1 waits for the ps task to come up (it starts
    after 2 s of the 3), then for a model the chief never creates; it gives up within its 3 s
    plus a second, not 3 s for each wait."""
    cluster = free_cluster(1, 2)
    servers: list[psframe.Server] = []
    late = threading.Timer(2.0, lambda: servers.append(psframe.Server(cluster, "ps", 0, serving_processes=1)))
    late.start()
    trainer = psframe.Trainer(make_model(), cluster, task_index=1, transport=psframe.Transport(connect_timeout=3.0))
    started = time.monotonic()
    try:
        with pytest.raises(ConnectTimeoutError, match="to hold the model"):
            trainer.connect()
        took = time.monotonic() - started
    finally:
        late.join(10)
        for server in servers:
            server.stop(grace=0.1)
    assert servers, "the ps task never started"
    assert took <= 3.0 + 1.0, f"connect_timeout=3 s, yet the connect gave up after {took:.1f}s"
