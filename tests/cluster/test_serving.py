"""A ps task served from several processes on its one port (psframe.ps.serving.serving_processes).

Whichever process a worker's connection lands on, the task behaves as one:
exact arithmetic over every push, one global step, exact sync rounds, one
status; its serving processes stop with it, and one that dies stops it.
Real processes on loopback ports the OS picks; every wait has a deadline.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

import psframe
from psframe.cluster.placement import Shard
from psframe.errors import PsframeError
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from psframe.worker.plan.step_plan import Request, Slot
from tests.conftest import free_cluster
from tests.service.test_sync import connect_all, data, grads_of, linear_model, run_workers

pytestmark = pytest.mark.cluster

DEADLINE_S = 60.0
LR = 0.5  # a power of two: with integer gradients every update is exact, in any order


@pytest.fixture
def multi_ps():
    """Factory: a cluster whose ps task 0 serves from ``processes`` processes; stopped at the end."""
    servers: list[psframe.Server] = []

    def make(num_workers: int, processes: int = 3) -> tuple[psframe.ClusterSpec, psframe.Server]:
        cluster = free_cluster(1, num_workers)
        servers.append(psframe.Server(cluster, "ps", 0, serving_processes=processes))
        return cluster, servers[-1]

    yield make
    for server in servers:
        server.stop(grace=0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: list[int], timeout: float = DEADLINE_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _connections_by_process(server: psframe.Server) -> dict[int, int]:
    """Established TCP connections on the task's port, by serving process (owner included)."""
    port = int(server.address.rsplit(":", 1)[1])
    counts = {}
    for pid in (os.getpid(), *server._serving.pids):
        connections = psutil.Process(pid).net_connections(kind="tcp")
        counts[pid] = sum(1 for c in connections if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)
    return counts


class Workers:
    """``num_workers`` workers' clients, each on a connection of its own, pushing to one variable ``w``."""

    def __init__(self, cluster: psframe.ClusterSpec, start: torch.Tensor) -> None:
        self.start = start
        self.slot = Slot(Shard("w", "w", 0, 0, start.numel(), tuple(start.shape), start.nbytes), start)
        self.clients = {i: PsClient(cluster, i, rpc_timeout=DEADLINE_S) for i in range(cluster.num_workers)}
        for client in self.clients.values():
            control_calls.wait_for_ps(client, DEADLINE_S)

    def create(self, optimizer, checkpoint_dir: str | None = None) -> bool:
        return control_calls.create(
            self.clients[0], 0, [self.slot], [("w", self.start)], optimizer, None, checkpoint_dir
        )

    def push(self, grad_of, pushes: int) -> None:
        """Every worker pushes ``grad_of(worker)`` ``pushes`` times, all at once."""
        request = Request(0, (self.slot,), (self.slot,), True)
        run_workers(
            {
                i: (
                    lambda i=i, client=client: [
                        client.push_pull([(request, [("w", grad_of(i))])], step=0) for _ in range(pushes)
                    ]
                )
                for i, client in self.clients.items()
            }
        )

    def value(self) -> torch.Tensor:
        (reply,) = self.clients[0].push_pull([(Request(0, (), (self.slot,), False), [])], step=0, compress=False)
        return reply.values[0].clone()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def local_steps(optimizer, start: torch.Tensor, grad: torch.Tensor, steps: int) -> torch.Tensor:
    reference = start.clone().requires_grad_(True)
    local = optimizer.build([reference])
    for _ in range(steps):
        reference.grad = grad.clone()
        local.step()
    return reference.detach()


def test_every_push_through_any_serving_process_is_applied_exactly_once(multi_ps):
    # 12 workers' connections spread over 3 processes: that none reaches a
    # serving process has odds of 3**-12.
    num_workers, pushes = 12, 20
    cluster, server = multi_ps(num_workers)
    workers = Workers(cluster, torch.zeros(64))
    try:
        by_process = _connections_by_process(server)
        assert sum(by_process.values()) == num_workers
        assert sum(by_process[pid] for pid in server._serving.pids) > 0, by_process
        assert workers.create(psframe.optim.SGD(lr=LR))
        workers.push(lambda i: torch.full((64,), float(i + 1)), pushes)
        # Over each worker's connection.
        infos = [control_calls.get_info(client, 0) for client in workers.clients.values()]
        value = workers.value()
    finally:
        workers.close()
    total = pushes * sum(range(1, num_workers + 1))
    assert torch.equal(value, torch.full((64,), -LR * total))
    assert {(info.global_step, info.applied_steps) for info in infos} == {(num_workers * pushes, num_workers * pushes)}


@pytest.mark.parametrize(
    "optimizer", [psframe.optim.SGD(lr=0.1, momentum=0.9), psframe.optim.Adam(lr=0.01)], ids=["momentum", "adam"]
)
def test_optimizer_state_is_one_across_the_serving_processes(multi_ps, optimizer):
    """Every push carries the same gradient, so N updates in any order, by any process,
    must equal N steps of one local optimizer: only if they all update one state."""
    num_workers, pushes = 12, 10
    cluster, server = multi_ps(num_workers)
    torch.manual_seed(3)
    start, grad = torch.randn(32), torch.randn(32)
    workers = Workers(cluster, start)
    try:
        assert sum(_connections_by_process(server)[pid] for pid in server._serving.pids) > 0
        workers.create(optimizer)
        workers.push(lambda i: grad, pushes)
        value = workers.value()
    finally:
        workers.close()
    assert torch.equal(value, local_steps(optimizer, start, grad, num_workers * pushes))


def test_a_restarted_task_restores_and_shares_its_optimizer_state(tmp_path):
    """Adam through 3 processes, a checkpoint, the task stopped and started again from
    it: N + M updates with one gradient equal N + M local steps (state restored, then shared)."""
    num_workers, pushes = 6, 5
    cluster = free_cluster(1, num_workers)
    torch.manual_seed(4)
    start, grad = torch.randn(16), torch.randn(16)
    optimizer = psframe.optim.Adam(lr=0.01)
    url = str(tmp_path / "ckpt")

    def run_pushes(create: bool) -> torch.Tensor:
        server = psframe.Server(cluster, "ps", 0, serving_processes=3, checkpoint_dir=url)
        workers = Workers(cluster, start)
        try:
            if create:
                workers.create(optimizer, url)
            workers.push(lambda i: grad, pushes)
            psframe.checkpoint.save(
                workers.clients[0], url, control_calls.get_info(workers.clients[0], 0).global_step, keep=2
            )
            return workers.value()
        finally:
            workers.close()
            server.stop(grace=0.1)

    first = run_pushes(create=True)
    second = run_pushes(create=False)  # restores from the checkpoint on its own
    assert torch.equal(first, local_steps(optimizer, start, grad, num_workers * pushes))
    assert torch.equal(second, local_steps(optimizer, start, grad, 2 * num_workers * pushes))


def test_sync_rounds_stay_exact_with_serving_processes(multi_ps):
    cluster, _ = multi_ps(2, processes=2)
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, total_num_replicas=2, timeout=30)
    batches = {i: data(10 + i, 16) for i in range(2)}
    models = {i: linear_model(seed=i) for i in range(2)}
    initial = [p.detach().clone() for p in linear_model(seed=0).parameters()]
    trainers = {
        i: psframe.Trainer(models[i], cluster, task_index=i, optimizer=psframe.optim.SGD(lr=LR), sync=sync)
        for i in range(2)
    }
    connect_all(trainers)
    expected = [grads_of(models[i], *batches[i]) for i in range(2)]
    steps = run_workers(
        {
            i: (
                lambda i=i: trainers[i].step(torch.nn.functional.cross_entropy(models[i](batches[i][0]), batches[i][1]))
            )
            for i in range(2)
        }
    )
    assert steps == {0: 1, 1: 1}
    for p, v, g0, g1 in zip(models[0].parameters(), initial, *expected):
        reference = v.clone().requires_grad_(True)
        reference.grad = (g0 + g1) / 2
        torch.optim.SGD([reference], lr=LR).step()
        assert torch.equal(p.detach(), reference.detach())
    run_workers({i: trainers[i].close for i in range(2)})


def test_the_serving_processes_stop_with_the_task(multi_ps):
    cluster, server = multi_ps(1)
    pids = server._serving.pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    with PsClient(cluster, 0, rpc_timeout=DEADLINE_S) as client:
        control_calls.wait_for_ps(client, DEADLINE_S)
        control_calls.finish(client)  # the only worker is done: the task's join returns
    assert server.join(timeout=DEADLINE_S) is True
    assert _wait_gone(pids) == []


def test_a_serving_process_that_dies_stops_the_task_naming_it(multi_ps):
    _, server = multi_ps(1)
    victim = server._serving.pids[0]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(PsframeError, match=rf"serving process 1 \(pid {victim}\) of /job:ps/task:0 exited"):
        server.join(timeout=DEADLINE_S)
    assert _wait_gone(server._serving.pids) == []


def test_serving_processes_are_checked():
    cluster = free_cluster(1, 1)
    with pytest.raises(ValueError, match="serving_processes must be an int >= 1, got 0"):
        psframe.Server(cluster, "ps", 0, serving_processes=0, start=False)
    with pytest.raises(ValueError, match="applies to ps tasks"):
        psframe.Server(cluster, "worker", 0, serving_processes=2, start=False)


def test_a_port_in_use_leaves_no_shared_memory_behind(multi_ps):
    cluster, server = multi_ps(1, processes=2)
    base = os.path.dirname(server._shared.folder)

    def mine() -> set[str]:  # the shared folders of this process's tasks
        return {name for name in os.listdir(base) if name.startswith(f"psframe-ps-{os.getpid()}-")}

    before = mine()
    with pytest.raises(psframe.errors.PortInUseError, match="another ps task served from several processes"):
        psframe.Server(cluster, "ps", 0, serving_processes=2)  # the task of multi_ps holds the port
    assert mine() == before


def _connected_clients(cluster, server, num_workers: int) -> dict[int, PsClient]:
    """A client per worker, each connected, some of them to a serving process."""
    clients = {i: PsClient(cluster, i, rpc_timeout=DEADLINE_S) for i in range(num_workers)}
    for client in clients.values():
        control_calls.wait_for_ps(client, DEADLINE_S)
    assert sum(_connections_by_process(server)[pid] for pid in server._serving.pids) > 0
    return clients


def test_table_rows_and_their_optimizer_state_are_one_across_the_serving_processes(multi_ps):
    """Every worker pushes the same rows' gradients: N pushes in any order, by any process,
    equal N lazy-momentum steps of one local optimizer, untouched rows unchanged."""
    num_workers, pushes = 12, 5
    cluster, server = multi_ps(num_workers)
    torch.manual_seed(4)
    start = torch.randn(10, 3)
    ids, grad = torch.tensor([1, 4, 7]), torch.randn(3, 3)
    table = Slot(Shard("t", "t", 0, 0, 10, (10, 3), start.nbytes, table=True), start)
    optimizer = psframe.optim.SparseSGD(lr=0.1, momentum=0.9)
    clients = _connected_clients(cluster, server, num_workers)
    try:
        assert control_calls.create(
            clients[0],
            0,
            [table],
            [],
            psframe.optim.SGD(lr=0.1),
            None,
            None,
            rows=[("t", torch.arange(10), start)],
            table_optimizer=optimizer,
        )
        run_workers(
            {
                i: (
                    lambda client=client: [client.push_pull([], 0, rows={0: [("t", ids, grad)]}) for _ in range(pushes)]
                )
                for i, client in clients.items()
            }
        )
        (value,) = clients[0].pull_rows({0: [("t", torch.arange(10))]}, 0)[0]
        value = value.clone()
    finally:
        for client in clients.values():
            client.close()
    reference = start.clone().requires_grad_(True)
    local = optimizer.build([reference])
    for _ in range(num_workers * pushes):
        reference.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad, (10, 3))
        local.step()
    assert torch.equal(value, reference.detach())


def test_a_dynamic_table_is_served_by_the_owner_whichever_process_a_worker_reaches(multi_ps):
    """Its rows grow in the owner's memory: the serving processes forward, and N pushes
    in any order are N steps of one optimizer over the rows made on first touch."""
    from psframe.tables.dynamic_rows import DynamicRows
    from psframe.tables.spec import DynamicTableSpec, RowInitializer

    num_workers, pushes = 6, 4
    cluster, server = multi_ps(num_workers)
    spec = DynamicTableSpec(RowInitializer(std=0.5, seed=3))
    part = Slot(Shard("t/part_0", "t", 0, 0, 0, (0, 3), 0, table=True, dynamic=spec), torch.empty(0, 3))
    ids, grad = torch.tensor([-9, 2**50, 17]), torch.randn(3, 3)
    optimizer = psframe.optim.SparseSGD(lr=0.1, momentum=0.9)
    clients = _connected_clients(cluster, server, num_workers)
    try:
        assert control_calls.create(
            clients[0], 0, [part], [], psframe.optim.SGD(lr=0.1), None, None, table_optimizer=optimizer
        )
        run_workers(
            {
                i: (
                    lambda client=client: [
                        client.push_pull([], 0, rows={0: [("t/part_0", ids, grad)]}) for _ in range(pushes)
                    ]
                )
                for i, client in clients.items()
            }
        )
        (value,) = clients[1].pull_rows({0: [("t/part_0", ids)]}, 0)[0]
        value = value.clone()
    finally:
        for client in clients.values():
            client.close()
    reference = DynamicRows("t", (3,), torch.float32, spec, optimizer)
    for _ in range(num_workers * pushes):
        reference.apply(ids, grad)
    assert torch.equal(value, reference.read(ids))


def test_the_default_number_of_serving_processes_follows_the_cores():
    from psframe.ps.serving.serving_processes import default_serving_processes

    assert [default_serving_processes(c) for c in (1, 2, 7, 8, 16, 32, 64, 256)] == [1, 1, 1, 2, 4, 8, 8, 8]
    assert default_serving_processes() == default_serving_processes(len(os.sched_getaffinity(0)))
    cluster = free_cluster(1, 1)
    worker = psframe.Server(cluster, "worker", 0, start=False)  # a worker task never gets more
    try:
        assert worker._serving is None
    finally:
        worker.stop(grace=0)
