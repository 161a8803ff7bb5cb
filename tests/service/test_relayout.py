"""A live re-layout: ps tasks added and drained while workers train (:mod:`psframe.ps.elastic.relayout`).

Unit tests of the parts (which clusters may follow which, the shard record on
the wire), then ps tasks in this process with workers in threads: a ps task is
added (asked from outside, as ``psframe reshard`` does) and later drained, and
the values equal the known-gradient arithmetic exactly: every step applied
once, the optimizer state moved with its rows.

This file holds the service tier's tests of the subject; `tests/unit/test_relayout.py`,
`tests/cluster/test_relayout.py` hold the other tiers'.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import psframe
from psframe.worker.client import control_calls, relayout_calls
from psframe.worker.client.ps_client import PsClient
from tests.conftest import free_cluster
from tests.service.test_sync import run_workers

DEADLINE_S = 60.0
LR = 0.5
GRAD = 0.25  # every step's gradient of every element: exact in float32, as are the updates


def with_ps(cluster: psframe.ClusterSpec, ps: list[str]) -> psframe.ClusterSpec:
    return psframe.ClusterSpec({"ps": ps, "worker": cluster.job_tasks("worker")})


def clusters(num_ps: int, num_workers: int) -> tuple[psframe.ClusterSpec, psframe.ClusterSpec]:
    """A cluster on loopback, and the same with one ps task more: every port picked at once (distinct)."""
    grown = free_cluster(num_ps + 1, num_workers)
    return with_ps(grown, grown.job_tasks("ps")[:num_ps]), grown


# ---- the parts, no network


# ---- ps tasks in this process, workers in threads


class Known(torch.nn.Module):
    """A loss whose gradient is GRAD for every element, whatever the values: the oracle is arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(48, 8))
        self.b = torch.nn.Parameter(torch.ones(8))

    def loss(self) -> torch.Tensor:
        return GRAD * (self.w.sum() + self.b.sum())


@pytest.fixture
def ps_tasks():
    """Factory: ps task ``k`` of ``cluster`` in this process; every one started is stopped at the end."""
    servers: list[psframe.Server] = []

    def start(cluster: psframe.ClusterSpec, k: int) -> psframe.Server:
        servers.append(psframe.Server(cluster, "ps", k, serving_processes=1))
        return servers[-1]

    yield start
    for server in servers:
        server.stop(grace=0.1)


def trainer(cluster: psframe.ClusterSpec, index: int, optimizer, dense_parts=None, **options) -> psframe.Trainer:
    return psframe.Trainer(
        Known(),
        cluster,
        task_index=index,
        optimizer=optimizer,
        placement=psframe.Placement(min_partition_bytes=256, max_shard_bytes=512, dense_parts=dense_parts),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
        **options,
    )


def assemble(servers: list[psframe.Server]) -> dict[str, torch.Tensor]:
    """Each variable whole, from the parts the ps tasks in this process hold now: runs of rows,
    or every ``row_stride``-th row (an embedding table split by id modulo the ps tasks)."""
    whole: dict[str, torch.Tensor] = {}
    for server in servers:
        service = server.service
        for d in service._variable_defs:
            (value,) = service.store.read([d.name])
            into = whole.setdefault(d.variable, torch.full(tuple(d.full_shape), float("nan")))
            stride = max(1, d.row_stride)
            into[d.row_start : d.row_start + stride * d.shape[0] : stride] = value.reshape(tuple(d.shape))
    assert all(not v.isnan().any() for v in whole.values()), "a row is held nowhere"
    return whole


def train_until(done: threading.Event, make) -> psframe.Trainer:
    """A worker that trains (``make()``'s trainer, on ``model.loss()``) until ``done`` is set."""
    deadline = time.monotonic() + DEADLINE_S
    with make() as t:
        while not done.is_set():
            assert time.monotonic() < deadline, "the chief never finished"
            t.step(t.model.loss())
    return t


@pytest.mark.service
@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "SGD, overlap_backward", "Adam, dense_parts"])
def test_a_ps_task_added_then_drained_while_two_workers_train_keeps_every_step_once(ps_tasks, optimizer):
    cluster, grown = clusters(2, 2)
    first = [ps_tasks(cluster, k) for k in range(2)]
    spec = psframe.optim.Adam(lr=0.01) if optimizer.startswith("Adam") else psframe.optim.SGD(lr=LR)
    overlap = optimizer.endswith("overlap_backward")  # requests sent during backward, to the new layout
    # Six fixed parts of w: a re-layout moves some whole (a task added takes its share), none cut anew.
    dense_parts = 6 if optimizer.endswith("dense_parts") else None
    steps_each = 40
    paused: list[float] = []
    chief_done = threading.Event()

    def chief() -> psframe.Trainer:
        with trainer(cluster, 0, spec, dense_parts, overlap_backward=overlap) as t:
            for _ in range(steps_each):
                if t.stats.local_step == 10:  # asked from outside, as psframe reshard does: taken at a poll
                    third = ps_tasks(grown, 2)
                    with PsClient(cluster, 0, job_name="tool") as tool:
                        relayout_calls.ask_reshard(tool, grown)
                    deadline = time.monotonic() + DEADLINE_S
                    while t.stats.relayouts == 0:
                        assert time.monotonic() < deadline, "the chief never took the re-layout"
                        t.step(t.model.loss())
                    assert third.service.store.ready
                if t.stats.local_step >= 30 and t.stats.relayouts == 1:  # the last ps task drained
                    paused.append(t.reshard(cluster))
                t.step(t.model.loss())
            chief_done.set()
            return t

    def other() -> psframe.Trainer:
        deadline = time.monotonic() + DEADLINE_S
        with trainer(cluster, 1, spec, dense_parts, overlap_backward=overlap) as t:
            while not chief_done.is_set():  # trains on throughout both re-layouts
                assert time.monotonic() < deadline, "the chief never finished"
                t.step(t.model.loss())
                time.sleep(0.005)
            return t

    done = run_workers({0: chief, 1: other})
    assert done[0].stats.relayouts == 2 and done[1].stats.relayouts >= 1  # a worker behind may skip a layout
    answered = sum(t.stats.pushed_steps for t in done.values())
    assert answered == sum(t.stats.local_step for t in done.values())  # every step answered as applied
    with PsClient(cluster, 0, job_name="tool") as tool:
        infos = [control_calls.get_info(tool, k) for k in range(2)]
    values = {v.name: v for v in infos[0].variables}
    assert values  # ps 0 holds parts again
    held = assemble(first)
    w, b = held["w"], held["b"]
    applied = infos[0].global_step  # every part holds exactly these updates: none half applied, none twice
    assert applied == answered
    if not optimizer.startswith("Adam"):
        assert torch.equal(w, torch.full_like(w, -LR * GRAD * applied))
        assert torch.equal(b, torch.full_like(b, 1.0 - LR * GRAD * applied))
    else:  # Adam's moments and step count moved with their rows: as one Adam over every step
        ref = Known()
        adam = torch.optim.Adam(ref.parameters(), lr=0.01)
        for _ in range(applied):
            adam.zero_grad()
            ref.loss().backward()
            adam.step()
        torch.testing.assert_close(w, ref.w.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, ref.b.detach(), rtol=1e-5, atol=1e-6)
    stages = done[0].stats.relayout_pauses
    assert all(p > 0 for p in stages) and paused == [pytest.approx(sum(stages))]
    if not dense_parts:  # the parts of w (512 bytes each, a stage's most) moved one per stage: a cut each
        assert len(stages) > 1
    else:  # the drain gave back the two parts (256 bytes each) the task added had taken, whole, in one stage
        assert done[0].stats.relayout_parts_moved == (2,)
        assert sorted(d.name for d in first[0].service._variable_defs + first[1].service._variable_defs) == sorted(
            ["b", *(f"w/part_{k}" for k in range(6))]
        )
    # A cut per stage, counted by ps 0 (with dense parts: the add's one stage, the drain's).
    assert first[0].service.relayout.version == 2 if dense_parts else first[0].service.relayout.version > 2


@pytest.mark.service
def test_the_chief_asks_ps_0_of_re_layouts_only_once_its_replies_say_one_is_asked(ps_tasks, monkeypatch):
    """No re-layout asked: the chief's steps make no status call (ps 0's step replies say so);
    one asked is taken, and once it is done the calls stop again."""
    cluster, grown = clusters(2, 1)
    first = [ps_tasks(cluster, k) for k in range(2)]
    asked_status = []
    status = relayout_calls.layout_status

    def counted(client: PsClient) -> relayout_calls.LayoutStatus:
        asked_status.append(client.name)
        return status(client)

    with trainer(cluster, 0, psframe.optim.SGD(lr=LR)) as t:
        monkeypatch.setattr(relayout_calls, "layout_status", counted)  # the chief's calls from here on
        for _ in range(30):
            t.step(t.model.loss())
        assert asked_status == []
        ps_tasks(grown, 2)
        with PsClient(cluster, 0, job_name="tool") as tool:
            relayout_calls.ask_reshard(tool, grown)
        deadline = time.monotonic() + DEADLINE_S
        while t.stats.relayouts == 0:
            assert time.monotonic() < deadline, "the chief never took the re-layout"
            t.step(t.model.loss())
        assert asked_status  # told by ps 0's replies, the chief asked for the re-layout and took it
        taken = len(asked_status)
        for _ in range(30):
            t.step(t.model.loss())
        assert len(asked_status) == taken
    assert first[0].service.relayout.version > 0 and not first[0].service.relayout.pending


@pytest.mark.service
def test_a_worker_started_with_the_ps_tasks_of_before_follows_the_re_layouts(ps_tasks):
    cluster, grown = clusters(2, 2)
    first = [ps_tasks(cluster, k) for k in range(2)]
    ps_tasks(grown, 2)
    moved, stepped, chief_done = threading.Event(), threading.Event(), threading.Event()
    spec = psframe.optim.SGD(lr=LR)

    def chief() -> psframe.Trainer:
        with trainer(cluster, 0, spec) as t:
            for _ in range(20):
                t.step(t.model.loss())
            t.reshard(grown)
            moved.set()
            deadline = time.monotonic() + DEADLINE_S
            while not stepped.is_set():  # the late worker trains on the grown layout meanwhile
                assert time.monotonic() < deadline, "the late worker never stepped"
                t.step(t.model.loss())
            t.reshard(cluster)
            for _ in range(20):
                t.step(t.model.loss())
        chief_done.set()
        return t

    def late() -> psframe.Trainer:
        assert moved.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        with trainer(cluster, 1, spec) as t:  # the flags of before the re-layout
            while not chief_done.is_set():
                assert time.monotonic() < deadline, "the chief never finished"
                t.step(t.model.loss())
                if t.stats.local_step == 5:
                    stepped.set()
        return t

    done = run_workers({0: chief, 1: late})
    assert done[1].stats.relayouts == 2  # it followed ps 0 to the grown layout at connect, then the drain
    assert first[0].service.store.global_step == sum(t.stats.pushed_steps for t in done.values())
    held = assemble(first)
    assert torch.equal(held["w"], torch.full_like(held["w"], -LR * GRAD * first[0].service.store.global_step))


@pytest.mark.service
def test_sync_rounds_go_on_across_a_ps_task_added_and_drained(ps_tasks):
    cluster, grown = clusters(2, 2)
    first = [ps_tasks(cluster, k) for k in range(2)]
    ps_tasks(grown, 2)
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, total_num_replicas=2, timeout=DEADLINE_S)
    steps = 30

    def work(index: int) -> psframe.Trainer:
        t = psframe.Trainer(
            Known(),
            cluster,
            task_index=index,
            optimizer=psframe.optim.SGD(lr=LR),
            sync=sync,
            placement=psframe.Placement(min_partition_bytes=256, max_shard_bytes=512),
            transport=psframe.Transport(connect_timeout=DEADLINE_S),
        )
        with t:
            while t.stats.local_step < steps:
                if index == 0 and t.stats.local_step == 10:
                    t.reshard(grown)  # the round under way is given up and sent again on the new layout
                if index == 0 and t.stats.local_step == 20:
                    t.reshard(cluster)
                t.step(t.model.loss())
        return t

    done = run_workers({0: lambda: work(0), 1: lambda: work(1)})
    assert done[0].stats.relayouts == 2 and done[1].stats.relayouts >= 1
    rounds = first[0].service.store.global_step
    assert rounds == steps and all(t.stats.dropped_steps == 0 for t in done.values())  # every round, both workers
    held = assemble(first)
    assert torch.equal(held["w"], torch.full_like(held["w"], -LR * GRAD * rounds))  # each round: the mean, GRAD
    assert torch.equal(held["b"], torch.full_like(held["b"], 1.0 - LR * GRAD * rounds))


@pytest.mark.service
def test_psframe_reshard_asks_ps_0_and_waits_until_the_new_layout_holds_the_model(ps_tasks, capsys):
    from psframe import cli

    cluster, grown = clusters(1, 1)
    first = ps_tasks(cluster, 0)
    added = ps_tasks(grown, 1)
    flags = [f"--ps_hosts={','.join(cluster.job_tasks('ps'))}", f"--worker_hosts={cluster.job_tasks('worker')[0]}"]
    stop = threading.Event()

    def chief() -> psframe.Trainer:
        deadline = time.monotonic() + DEADLINE_S
        with trainer(cluster, 0, psframe.optim.SGD(lr=LR)) as t:
            while not stop.is_set():
                assert time.monotonic() < deadline, "the command never returned"
                t.step(t.model.loss())
        return t

    def command() -> int:
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not first.service.store.ready:  # the chief has made the model
                assert time.monotonic() < deadline, "the chief never made the model"
                time.sleep(0.01)
            assert cli.main(["reshard", *flags, "--new_ps_hosts=127.0.0.1:1", "--timeout=5"]) == 1  # not a re-layout
            return cli.main(["reshard", *flags, f"--new_ps_hosts={','.join(grown.job_tasks('ps'))}", "--timeout=60"])
        finally:
            stop.set()

    done = run_workers({0: chief, 1: command})
    assert done[1] == 0 and done[0].stats.relayouts == 1
    out = capsys.readouterr()
    assert "must begin with the old one" in out.err
    assert "hold the model: re-laid out" in out.out
    assert added.service.store.ready and first.service.relayout.relayouts == 1
    cli.main(["status", *flags])  # with the flags of before: says where the ps tasks went
    assert f"re-layouts: 1; the ps tasks are (or move to) {','.join(grown.job_tasks('ps'))}" in capsys.readouterr().out
    held = assemble([first, added])
    assert torch.equal(held["w"], torch.full_like(held["w"], -LR * GRAD * first.service.store.global_step))


class Tabled(torch.nn.Module):
    """An embedding table (split among the ps tasks by id modulo their number) and a dense weight;
    every step looks up every row once, so every row gets GRAD, as ``w`` does."""

    ROWS = 40

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(self.ROWS, 4, sparse=True)
        self.w = torch.nn.Parameter(torch.zeros(6, 4))

    def loss(self) -> torch.Tensor:
        return GRAD * (self.emb(torch.arange(self.ROWS)).sum() + self.w.sum())


def assert_as_one_adagrad(
    held: dict[str, torch.Tensor], reference: torch.nn.Module, start: dict[str, torch.Tensor], steps: int
) -> None:
    """``held`` (``emb.weight`` and ``w``) is what one process's Adagrad (lr 0.1) makes of ``reference``
    from ``start`` in ``steps`` steps of its loss: the rows and their sums of squares moved exactly."""
    reference.load_state_dict({"emb.weight": start["emb.weight"], "w": start["w"]})
    reference.emb.sparse = False
    adagrad = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for _ in range(steps):
        adagrad.zero_grad()
        reference.loss().backward()
        adagrad.step()
    torch.testing.assert_close(held["emb.weight"], reference.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(held["w"], reference.w.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.service
@pytest.mark.parametrize("table_parts", [None, 6], ids=["a part per ps task", "six parts"])
def test_embedding_rows_move_with_their_optimizer_state_and_a_step_in_flight_is_cut_anew(ps_tasks, table_parts):
    cluster, grown = clusters(2, 2)
    first = [ps_tasks(cluster, k) for k in range(2)]
    ps_tasks(grown, 2)
    torch.manual_seed(7)
    initial = Tabled()
    start = {name: p.detach().clone() for name, p in initial.named_parameters()}
    chief_done = threading.Event()

    def make(index: int, model: Tabled) -> psframe.Trainer:
        return psframe.Trainer(
            model,
            cluster,
            task_index=index,
            optimizer=psframe.optim.Adagrad(lr=0.1),
            table_optimizer=psframe.optim.Adagrad(lr=0.1),
            # Six parts of about 112 bytes, copied ahead of their cut: those count against stages of
            # COPY_AHEAD_FACTOR x 16 bytes, one part a stage.
            placement=psframe.Placement(table_parts=table_parts, max_shard_bytes=16),
            transport=psframe.Transport(connect_timeout=DEADLINE_S),
        )

    stages: list[int] = []

    def chief() -> psframe.Trainer:
        with make(0, initial) as t:
            while t.stats.local_step < 60:
                if t.stats.local_step == 15:
                    t.reshard(grown)
                    stages.append(len(t.stats.relayout_pauses))
                if t.stats.local_step == 40:
                    t.reshard(cluster)
                    stages.append(len(t.stats.relayout_pauses))
                t.step(t.model.loss())
        chief_done.set()
        return t

    done = run_workers({0: chief, 1: lambda: train_until(chief_done, lambda: make(1, Tabled()))})
    steps = first[0].service.store.global_step
    assert steps == sum(t.stats.pushed_steps for t in done.values()) and done[1].stats.relayouts >= 1
    # One process: Adagrad over `steps` steps of the same gradients; the table's rows and their
    # sums of squares moved among the ps tasks twice, split by id modulo 2, then 3, then 2.
    assert_as_one_adagrad(assemble(first), Tabled(), start, steps)
    parts = {d.name for server in first for d in server.service._variable_defs if d.variable == "emb.weight"}
    if table_parts is None:  # cut anew each time: 2 parts, then 3, then 2, each move in one stage
        assert len(parts) == 2
    else:  # the same six parts throughout, moved one a stage: those whose task k % P changes
        assert len(parts) == 6 and min(stages) > 1


class Sampled(torch.nn.Module):
    """An embedding table of which each step looks up a different 25 of its 60 rows (seeded by the
    step), and a dense weight: some rows of a part change between two steps, others do not."""

    ROWS = 60

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(self.ROWS, 4, sparse=True)
        self.w = torch.nn.Parameter(torch.zeros(6, 4))
        self.calls = 0

    def loss(self) -> torch.Tensor:
        ids = torch.randperm(self.ROWS, generator=torch.Generator().manual_seed(self.calls))[:25]
        self.calls += 1
        return GRAD * (self.emb(ids).sum() + self.w.sum())


@pytest.mark.service
def test_table_parts_copied_ahead_while_training_take_only_their_rows_changed_since_at_the_cut(ps_tasks):
    cluster, grown = clusters(2, 1)
    first = [ps_tasks(cluster, k) for k in range(2)]
    third = ps_tasks(grown, 2)
    torch.manual_seed(3)
    model = Sampled()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    with psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.Adagrad(lr=0.1),
        table_optimizer=psframe.optim.Adagrad(lr=0.1),
        # Six table parts of 160 bytes, copied ahead: against COPY_AHEAD_FACTOR x 16 bytes, one part a stage.
        placement=psframe.Placement(table_parts=6, max_shard_bytes=16),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
    ) as t:
        for _ in range(5):
            t.step(t.model.loss())
        with PsClient(cluster, 0, job_name="tool") as tool:
            # Taken at the chief's polls: each stage readied at a step, cut at a later one.
            relayout_calls.ask_reshard(tool, grown)
        deadline = time.monotonic() + DEADLINE_S
        while t.stats.relayouts == 0:
            assert time.monotonic() < deadline, "the chief never took the re-layout"
            t.step(t.model.loss())
        for _ in range(5):
            t.step(t.model.loss())
        steps = t.stats.local_step
    assert len(t.stats.relayout_pauses) > 1
    servers = [*first, third]
    assert third.service.relayout_parts_copied_ahead >= 1  # it took its parts as copies made ahead
    # A step changed 25 of the 60 rows between a copy and its cut: those crossed at the cut, not the rest.
    changed = sum(s.service.relayout_rows_changed_since_copy for s in servers)
    copied = sum(s.service.relayout_parts_copied_ahead for s in servers)
    assert 0 < changed < copied * 10  # a part holds 10 rows
    assert first[0].service.store.global_step == steps
    assert_as_one_adagrad(assemble(servers), Sampled(), start, steps)


@pytest.mark.service
def test_checkpoints_before_during_and_after_a_re_layout_restore_onto_either_layout(tmp_path):
    from psframe import checkpoint
    from psframe.ps import recovery
    from psframe.wire import messages
    from psframe.worker.model.replica import Replica
    from psframe.worker.model.staging import HostStaging

    folder = str(tmp_path / "ckpt")
    their_folder = str(tmp_path / "command")  # the command's checkpoints, beside the chief's
    cluster, grown = clusters(2, 1)
    servers = [psframe.Server(cluster, "ps", k, serving_processes=1, checkpoint_dir=folder) for k in range(2)]
    servers.append(psframe.Server(grown, "ps", 2, serving_processes=1, checkpoint_dir=folder))
    during: list[int] = []
    stop = threading.Event()

    def tool_saves() -> int:  # a command saving while re-layouts are taken: committed whole, or refused
        deadline = time.monotonic() + DEADLINE_S
        tries = 0
        while not stop.is_set() and time.monotonic() < deadline:
            tries += 1
            for layout in (cluster, grown):
                try:
                    with PsClient(layout, 0, job_name="tool", rpc_timeout=10.0) as tool:
                        step = control_calls.get_info(tool, 0).global_step
                        if step and step not in during:
                            during.append(checkpoint.save(tool, their_folder, step, keep=100).step)
                except psframe.errors.PsframeError:
                    pass  # mid-move, or the other layout: refused with nothing committed
            time.sleep(0.02)
        return tries

    def chief() -> list[checkpoint.Manifest]:
        made = []
        try:
            with psframe.Trainer(
                Known(),
                cluster,
                optimizer=psframe.optim.Adam(lr=0.01),
                placement=psframe.Placement(min_partition_bytes=256, max_shard_bytes=512),
                checkpointing=psframe.Checkpointing(folder, save_steps=10**6, keep=100),
                transport=psframe.Transport(connect_timeout=DEADLINE_S),
            ) as t:
                for move_to in (grown, cluster, None):
                    for _ in range(12):
                        t.step(t.model.loss())
                    made.append(t.save_delta())  # after a re-layout, a delta cannot follow: saved whole
                    if move_to is not None:
                        t.reshard(move_to)
        finally:
            stop.set()
        return made

    try:
        done = run_workers({0: chief, 1: tool_saves})
    finally:
        for server in servers:
            server.stop(grace=0.1)
    before, after, back = done[0]
    assert [len(m.shards) for m in (before, after, back)] == [2, 3, 2]
    assert after.parent is None and back.parent is None  # whole checkpoints across the layouts

    def place(num_ps: int):
        replica = Replica(
            Known(),
            num_ps,
            HostStaging(torch.device("cpu")),
            sync=False,
            variable_devices={},
            min_partition_bytes=256,
            max_shard_bytes=512,
        )
        return [messages.variable_defs(s for s in replica.slots if s.shard.ps_task == k) for k in range(num_ps)]

    # Every checkpoint committed, the chief's and the command's (whichever layout it caught), is
    # one cut: every part holds the same steps; and it restores onto either layout, Adam state too.
    saved = [(folder, m.step) for m in (before, after, back)] + [(their_folder, step) for step in during]
    for where, step in saved:
        whole = checkpoint.load(where, step)
        chain = checkpoint.read(where, step)
        shards = chain.read_shards()
        reference = Known()
        adam = torch.optim.Adam(reference.parameters(), lr=0.01)
        for _ in range(min(s.global_step for s in shards)):
            adam.zero_grad()
            reference.loss().backward()
            adam.step()
        torch.testing.assert_close(whole["w"], reference.w.detach(), rtol=1e-5, atol=1e-6)
        for num_ps in (2, 3):
            defs = place(num_ps)
            parts = [recovery.restore_from_shards(shards, defs[k], psframe.optim.Adam(lr=0.01)) for k in range(num_ps)]
            for d in (d for k in range(num_ps) for d in defs[k]):
                restored = next(p for p in parts if d.name in p.values)
                rows = whole[d.variable][d.row_start : d.row_start + d.shape[0]]
                assert torch.equal(restored.values[d.name].reshape(rows.shape), rows)
                assert restored.states[d.name]  # the optimizer state came along
    assert during  # the command saved between the moves too (a save under way at a cut is refused)


class Dynamic(torch.nn.Module):
    """A dynamic table whose rows start at 1.0 (made on first lookup, on whichever ps task holds the
    id) and a dense weight; every step looks up the same ids, so each row gets GRAD a step."""

    IDS = torch.tensor([3, 17, 42, 1001, 99999, 123456789])

    def __init__(self) -> None:
        super().__init__()
        self.emb = psframe.DynamicEmbedding(4, initializer=psframe.RowInitializer("constant", value=1.0))
        self.w = torch.nn.Parameter(torch.zeros(6, 4))

    def loss(self) -> torch.Tensor:
        return GRAD * (self.emb(self.IDS).sum() + self.w.sum())


@pytest.mark.service
@pytest.mark.parametrize("table_parts", [None, 4], ids=["a part per ps task", "four parts"])
def test_dynamic_table_rows_move_to_the_part_their_id_falls_in(ps_tasks, table_parts):
    cluster, grown = clusters(2, 2)
    first = [ps_tasks(cluster, k) for k in range(2)]
    third = ps_tasks(grown, 2)
    chief_done = threading.Event()

    def make(index: int) -> psframe.Trainer:
        return psframe.Trainer(
            Dynamic(),
            cluster,
            task_index=index,
            optimizer=psframe.optim.SGD(lr=LR),
            table_optimizer=psframe.optim.SGD(lr=LR),
            placement=psframe.Placement(table_parts=table_parts),
            transport=psframe.Transport(connect_timeout=DEADLINE_S),
        )

    def chief() -> psframe.Trainer:
        with make(0) as t:
            while t.stats.local_step < 40:
                if t.stats.local_step == 10:
                    t.reshard(grown)
                    held = sum(
                        len(third.service.store.export_dynamic()[n]["ids"]) for n in third.service.store.dynamic_tables
                    )
                    assert held > 0  # the ids of part 2 (of 3, or of 4: 42 and 1001) moved to the task added
                if t.stats.local_step == 25:
                    t.reshard(cluster)
                t.step(t.model.loss())
        chief_done.set()
        return t

    done = run_workers({0: chief, 1: lambda: train_until(chief_done, lambda: make(1))})
    steps = first[0].service.store.global_step
    assert steps == sum(t.stats.pushed_steps for t in done.values()) and done[1].stats.relayouts >= 1
    rows: dict[int, torch.Tensor] = {}
    for server in first:
        for held in server.service.store.export_dynamic().values():
            rows.update(zip(held["ids"].tolist(), held["rows"]))
    assert sorted(rows) == Dynamic.IDS.tolist()  # each id on one ps task, none lost
    for value in rows.values():
        assert torch.equal(value, torch.full_like(value, 1.0 - LR * GRAD * steps))


@pytest.mark.service
def test_data_read_in_ranges_is_consumed_once_across_re_layouts_and_no_lease_is_lost(ps_tasks):
    cluster, grown = clusters(2, 2)
    first = [ps_tasks(cluster, k) for k in range(2)]
    ps_tasks(grown, 2)
    data = psframe.DataRanges("train", 480, batch_size=4, range_size=16, shuffle=False)
    seen: dict[int, list[int]] = {0: [], 1: []}

    def work(index: int) -> psframe.Trainer:
        with trainer(cluster, index, psframe.optim.SGD(lr=LR)) as t:
            for batch in t.read(data):
                if index == 0 and t.stats.local_step == 10:
                    t.reshard(grown)
                if index == 0 and t.stats.local_step == 40:
                    t.reshard(cluster)
                t.step(t.model.loss())
                seen[index].extend(batch.tolist())
        return t

    done = run_workers({0: lambda: work(0), 1: lambda: work(1)})
    # No range taken back.
    assert done[0].stats.relayouts == 2 and all(t.stats.dropped_steps == 0 for t in done.values())
    assert sorted(seen[0] + seen[1]) == list(range(480))  # every example once, across the moves
    steps = first[0].service.store.global_step
    assert steps == 120 and first[0].service.data.counts()["train"] == (480, 480)
    held = assemble(first)
    assert torch.equal(held["w"], torch.full_like(held["w"], -LR * GRAD * steps))


@pytest.mark.service
def test_a_chief_started_again_finishes_a_re_layout_its_run_before_had_begun(ps_tasks):
    cluster, grown = clusters(2, 1)
    first = [ps_tasks(cluster, k) for k in range(2)]
    added = ps_tasks(grown, 2)
    lost = trainer(cluster, 0, psframe.optim.SGD(lr=LR)).connect()
    for _ in range(10):
        lost.step(lost.model.loss())
    with PsClient(cluster, 0, job_name="tool") as tool:  # the cut taken, as a chief lost right after it
        relayout_calls.ask_reshard(tool, grown)
        relayout_calls.move(tool, grown)
    lost._session.client.close()  # that chief is gone
    with PsClient(grown, 0) as chief:  # a chief that would make the model anew meanwhile: refused
        control_calls.wait_for_ps(chief, DEADLINE_S)  # and learns the layout the ps tasks are at
        with pytest.raises(psframe.errors.LayoutChangedError, match="in the middle of a re-layout"):
            control_calls.create(chief, 0, [], [], psframe.optim.SGD(lr=LR), None, None)
    again = trainer(cluster, 0, psframe.optim.SGD(lr=LR))  # started again with the flags of before
    with again:
        assert again.stats.relayouts == 1 and again.cluster == grown and added.service.store.ready
        for _ in range(10):
            again.step(again.model.loss())
    held = assemble(first + [added])
    assert first[0].service.store.global_step == 20  # the 10 steps of before the cut, and 10 after
    assert torch.equal(held["w"], torch.full_like(held["w"], -LR * GRAD * 20))


@pytest.mark.service
@pytest.mark.parametrize("direction", ["add", "drain"])
def test_a_chief_lost_between_two_stages_is_followed_by_one_that_takes_the_rest(ps_tasks, tmp_path, direction):
    from psframe import checkpoint
    from psframe.ps import recovery
    from psframe.wire import messages
    from psframe.worker.model.replica import Replica
    from psframe.worker.model.staging import HostStaging

    cluster, grown = clusters(2, 1)
    origin, target = (cluster, grown) if direction == "add" else (grown, cluster)
    servers = [ps_tasks(origin if k < origin.num_ps else grown, k) for k in range(3)]
    folder = str(tmp_path / "ckpt")
    options = {"checkpointing": psframe.Checkpointing(folder, save_steps=10**6)}
    lost = trainer(origin, 0, psframe.optim.SGD(lr=LR), **options).connect()
    for _ in range(5):
        lost.step(lost.model.loss())
    with PsClient(origin, 0, job_name="tool") as tool:
        relayout_calls.ask_reshard(tool, target)
        # Asked from outside, the chief takes one stage a step (of 512 bytes at most): w/part_2 and b apart.
        deadline = time.monotonic() + DEADLINE_S
        while not relayout_calls.layout_status(tool).moving:
            assert time.monotonic() < deadline, "the chief never took the first stage"
            lost.step(lost.model.loss())
        status = relayout_calls.layout_status(tool)
    assert status.stage is not None and (status.stage.stage, status.stage.stages) == (1, 2)
    mid_move = lost.save_checkpoint()  # between the two stages: the parts on the tasks of either side
    lost._session.client.close()  # that chief is gone
    again = trainer(origin, 0, psframe.optim.SGD(lr=LR), **options)  # started again with the flags of before
    with again:
        assert again.stats.relayouts == 0 and again.placement == lost.placement  # it follows ps 0 to stage 1
        # It readies stage 2 at its first step (its tasks copy ahead while it trains), and cuts it at one after.
        deadline = time.monotonic() + DEADLINE_S
        while again.stats.relayouts == 0:
            assert time.monotonic() < deadline, "the chief never took stage 2"
            again.step(again.model.loss())
        assert again.stats.relayouts == 1 and again.cluster == target
        for _ in range(5):
            again.step(again.model.loss())
    kept = servers[: target.num_ps]
    held = assemble(kept)
    steps = kept[0].service.store.global_step  # every step applied once, none lost at the chief's loss
    assert steps == lost.stats.local_step + again.stats.local_step
    assert torch.equal(held["w"], torch.full_like(held["w"], -LR * GRAD * steps))
    assert torch.equal(held["b"], torch.full_like(held["b"], 1.0 - LR * GRAD * steps))
    assert kept[0].service.relayout.relayouts == 1 and kept[0].service.relayout.version == 2
    # The checkpoint taken between the stages holds one cut, and restores onto the layout after.
    shards = checkpoint.read(folder, mid_move.step).read_shards()
    at_cut = shards[0].global_step
    assert len(shards) == 3 and {s.global_step for s in shards} == {at_cut} and at_cut > 5
    replica = Replica(
        Known(),
        target.num_ps,
        HostStaging(torch.device("cpu")),
        sync=False,
        variable_devices={},
        min_partition_bytes=256,
        max_shard_bytes=512,
    )
    for k in range(target.num_ps):
        defs = messages.variable_defs(s for s in replica.slots if s.shard.ps_task == k)
        restored = recovery.restore_from_shards(shards, defs, psframe.optim.SGD(lr=LR))
        for d in defs:
            expected = -LR * GRAD * at_cut + (1.0 if d.variable == "b" else 0.0)
            assert torch.equal(restored.values[d.name], torch.full(tuple(d.shape), expected))
