"""A server on port 0 reports its port; a cluster's ps tasks serving in this process.

In-process gRPC on ports the OS picked: ``psframe.Server`` given port 0,
``psframe.local_cluster`` (a Trainer against it matches local torch exactly,
and its servers are stopped on leaving ``with`` and at interpreter exit), and
the ``security=`` argument of ``Server`` and ``Trainer``.

This file holds the service tier's tests of the subject; `tests/unit/test_local_cluster.py`,
`tests/cluster/test_local_cluster.py` hold the other tiers'.
"""

from __future__ import annotations

import socket

import pytest
import torch

import psframe
from psframe.config.security import generate_token
from psframe.launch import pick_free_ports
from psframe.worker.client.control_calls import ping
from tests.service.test_trainer import loss_of, make_model

DEADLINE_S = 20.0
TRANSPORT = psframe.Transport(connect_timeout=DEADLINE_S)


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(DEADLINE_S)
        return sock.connect_ex(("127.0.0.1", port)) != 0


# ---- port 0


@pytest.mark.service
def test_a_server_on_port_0_binds_a_free_port_and_reports_it():
    with psframe.Server({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]}, "ps", 0, serving_processes=1) as server:
        assert server.port > 0
        assert server.address == f"127.0.0.1:{server.port}" and server.target == f"grpc://{server.address}"
        assert server.cluster.task_address("ps", 0) == server.address
        info = ping(server.target, timeout=DEADLINE_S)
        # The task answers with the real address, and the cluster holding it.
        assert info.address == server.address and info.cluster_spec == server.cluster.to_string()
        assert info.cluster_fingerprint == server.cluster.fingerprint
    assert refuses_connections(server.port)


@pytest.mark.service
def test_a_worker_task_on_port_0_and_a_fixed_bind_address_use_the_port_bound():
    with psframe.Server({"ps": ["127.0.0.1:1"], "worker": ["localhost:0"]}, "worker", 0) as worker:
        assert worker.address == f"localhost:{worker.port}"
        assert ping(worker.target, timeout=DEADLINE_S).job_name == "worker"
    cluster = psframe.ClusterSpec({"ps": ["h0:0"], "worker": ["h1:2224"]})
    with psframe.Server(cluster, "ps", 0, bind_address="127.0.0.1:0", serving_processes=1) as server:
        assert server.address == f"h0:{server.port}"  # the cluster's host, the port bound


# ---- local_cluster


@pytest.mark.service
@pytest.mark.parametrize(
    "num_ps, placement",
    [(1, psframe.Placement()), (2, psframe.Placement(min_partition_bytes=64, max_shard_bytes=160))],
    ids=["one_ps", "two_ps_partitioned"],
)
def test_a_trainer_against_a_local_cluster_matches_local_torch_optim_exactly(num_ps, placement):
    optimizer = psframe.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)
    model, reference = make_model(), make_model()
    local_opt = torch.optim.SGD(reference.parameters(), **optimizer.kwargs)
    with psframe.local_cluster(num_ps=num_ps, num_workers=1) as local:
        assert local.cluster.num_ps == num_ps and local.cluster.num_workers == 1
        assert local.ps_targets == [f"grpc://{a}" for a in local.cluster.job_tasks("ps")]
        with psframe.Trainer(model, local.cluster, optimizer=optimizer, placement=placement, transport=TRANSPORT) as t:
            if num_ps > 1:
                assert {s.ps_task for s in t.placement.shards} == set(range(num_ps))
            for step in range(5):
                assert t.step(loss_of(model, step)) == step + 1
                local_opt.zero_grad()
                loss_of(reference, step).backward()
                local_opt.step()
                for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                    assert torch.equal(p, q), f"{name} differs at step {step}"
    ports = [s.port for s in local.ps_servers]
    assert all(server.join(timeout=0.0) for server in local.ps_servers)  # stopped on leaving `with`
    assert all(refuses_connections(port) for port in ports)
    local.stop()  # again: nothing to do


@pytest.mark.service
def test_a_local_cluster_ends_when_its_workers_finish():
    with psframe.local_cluster(num_ps=1, num_workers=2) as local:
        chief_model, other_model = make_model(seed=0), make_model(seed=1)
        with (
            psframe.Trainer(chief_model, local.cluster, 0, transport=TRANSPORT) as chief,
            psframe.Trainer(other_model, local.cluster, 1, transport=TRANSPORT) as other,
        ):
            chief.step(loss_of(chief_model, 0))
            assert other.step(loss_of(other_model, 1)) == 2
        assert local.join(timeout=DEADLINE_S)  # every worker finished: the ps task stopped on its own


@pytest.mark.service
def test_a_local_cluster_starts_again_if_a_picked_port_was_taken(monkeypatch):
    import psframe.local

    picked = []

    def pick_taken_first(count: int, host: str) -> list[int]:
        ports = pick_free_ports(count, host)
        if not picked:
            ports[0] = taken.getsockname()[1]  # ps task 1's port, taken before it binds
        picked.append(ports)
        return ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(psframe.local, "pick_free_ports", pick_taken_first)
        with psframe.local_cluster(num_ps=2, num_workers=1) as local:
            assert len(picked) == 2
            assert local.cluster.task_address("ps", 1) == f"127.0.0.1:{picked[1][0]}"
            assert ping(local.ps_targets[1], timeout=DEADLINE_S).task_index == 1


@pytest.mark.service
def test_a_local_cluster_passes_server_options_to_every_ps_task():
    token = generate_token()
    with psframe.local_cluster(num_ps=2, security=psframe.Security(auth_token=token), worker_timeout=5.0) as local:
        assert all(s.security.auth_token == token for s in local.ps_servers)
        with pytest.raises(psframe.PsframeError, match="unauthenticated"):
            ping(local.ps_targets[1], timeout=DEADLINE_S, security=psframe.Security())
        assert (
            ping(local.ps_targets[1], timeout=DEADLINE_S, security=psframe.Security(auth_token=token)).job_name == "ps"
        )


# ---- security=


@pytest.mark.service
def test_server_and_trainer_take_security_whole(monkeypatch):
    token = generate_token()
    monkeypatch.setenv("PSFRAME_AUTH_TOKEN", generate_token())  # a given Security is used as given
    security = psframe.Security(auth_token=token)
    with psframe.local_cluster(num_ps=1, num_workers=1, security=security) as local:
        assert local.ps_servers[0].security is security
        trainer = psframe.Trainer(make_model(), local.cluster, security=security, transport=TRANSPORT)
        assert trainer.security is security
        with trainer:
            assert trainer.step(loss_of(trainer.model, 0)) == 1
    # Without security=, the environment's settings, as before.
    assert psframe.Trainer(make_model(), local.cluster).security.auth_token != token
