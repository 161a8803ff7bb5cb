"""The operator commands, run in-process: ``psframe status``, ``shutdown`` and ``ping``.

Clusters are in-process ps servers on free loopback ports; every call has a
deadline (``--timeout``, connect/rpc timeouts) and every server is stopped.

This file holds the service tier's tests of the subject; `tests/cluster/test_cli_tools.py` holds the
other tiers'.
"""

from __future__ import annotations

import re

import pytest
import torch

import psframe
from psframe import checkpoint, cli
from psframe.checkpoint import files as checkpoint_io
from psframe.status import TaskState
from psframe.streams import StreamRecord
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from tests.conftest import assert_params_equal, free_cluster, params

TRANSPORT = psframe.Transport(connect_timeout=20.0, rpc_timeout=30.0)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    return torch.nn.functional.cross_entropy(model(x), y)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def status_table(out: str) -> dict[str, dict[str, str]]:
    """The status table by task name, each row by column name (columns located from the header).
    The table ends at the first blank line (dynamic tables' counts follow it)."""
    lines = out.split("\n\n")[0].splitlines()
    header = lines[0]
    columns = [(m.group(), m.start()) for m in re.finditer(r"\S+", header)]
    assert [c for c, _ in columns] == [
        "task",
        "address",
        "role",
        "state",
        "global_step",
        "variables",
        "bytes_held",
        "applied_steps",
        "dropped",
        "last_seen",
    ]
    rows = {}
    for line in lines[1:]:
        cells = {}
        for i, (name, start) in enumerate(columns):
            end = columns[i + 1][1] if i + 1 < len(columns) else None
            cells[name] = line[start:end].strip()
        rows[cells["task"]] = cells
    return rows


@pytest.fixture
def servers():
    """Start ps servers by hand (e.g. with a checkpoint_dir); all stopped at the end."""
    started: list[psframe.Server] = []

    def start(cluster, task_index, **kwargs) -> psframe.Server:
        server = psframe.Server(cluster, "ps", task_index, **{"serving_processes": 1, **kwargs})
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace=0.1)


# ---- status


def test_status_shows_every_task_while_training_and_after(local_cluster, capsys):
    cluster = local_cluster(num_ps=1, num_workers=1)
    spec = f"--cluster_spec={cluster.to_string()}"
    model = make_model()
    t = psframe.Trainer(model, cluster, transport=TRANSPORT).connect()
    try:
        for step in range(3):
            t.step(loss_of(model, step))
        code, out = run_cli(capsys, "status", spec, "--timeout", "5")
        assert code == 0, out
        rows = status_table(out)
        ps_address, worker_address = cluster.task_address("ps", 0), cluster.task_address("worker", 0)
        assert sorted(rows) == ["/job:ps/task:0", "/job:worker/task:0"]
        ps = rows["/job:ps/task:0"]
        assert (ps["address"], ps["role"], ps["state"]) == (ps_address, "ps", "ready")
        assert (ps["global_step"], ps["variables"], ps["applied_steps"], ps["dropped"]) == ("3", "4", "3", "0")
        n_params = sum(p.numel() for p in model.parameters())
        assert ps["bytes_held"] == f"{n_params * 4} B"  # SGD without momentum keeps no state
        worker = rows["/job:worker/task:0"]
        assert (worker["address"], worker["role"], worker["state"]) == (worker_address, "chief", "training")
        assert worker["applied_steps"] == "3"  # its steps applied (on every ps task)
        assert re.fullmatch(r"\d+\.\ds ago", worker["last_seen"]), worker["last_seen"]
    finally:
        t.close()
    code, out = run_cli(capsys, "status", spec, "--timeout", "5")
    assert code == 0, out
    rows = status_table(out)
    assert rows["/job:worker/task:0"]["state"] == "finished"
    assert rows["/job:worker/task:0"]["role"] == "chief"
    assert rows["/job:ps/task:0"]["state"] == "finished"  # every worker finished
    assert rows["/job:ps/task:0"]["global_step"] == "3"


def test_status_counts_the_rows_of_dynamic_tables(local_cluster, capsys):
    class Users(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.users = psframe.DynamicEmbedding(4, admit_after=2, admission_counters=1 << 10)
            self.head = torch.nn.Linear(4, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.users(ids)).sum()

    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Users()
    with psframe.Trainer(model, cluster, transport=TRANSPORT) as t:
        for ids in ([1, 2, 3], [1, 2, 4]):  # 1 and 2 admitted on their second lookup
            t.step(model(torch.tensor(ids)))
        code, out = run_cli(capsys, "status", f"--cluster_spec={cluster.to_string()}")
    assert code == 0, out
    header, *parts = out.split("\n\n")[1].splitlines()
    assert header.split() == [
        "dynamic",
        "table",
        "part",
        "task",
        "rows",
        "on",
        "disk",
        "admitted",
        "filtered",
        "evicted",
    ]
    cells = sorted(line.split() for line in parts)
    assert [c[:2] for c in cells] == [["users/part_0", "/job:ps/task:0"], ["users/part_1", "/job:ps/task:1"]]
    totals = [sum(int(c[i]) for c in cells) for i in range(2, 7)]
    assert totals == [2, 0, 2, 4, 0]  # rows, of them on disk, admitted; filtered: 1, 2, 3 then 4; evicted


def test_status_shows_how_far_ahead_each_step_found_its_worker(local_cluster, capsys):
    cluster = local_cluster(num_ps=1, num_workers=2)
    model = make_model()
    with psframe.Trainer(model, cluster, transport=TRANSPORT) as t:
        for step in range(3):  # worker 1 never steps: each step is one further ahead of it
            t.step(loss_of(model, step))
        code, out = run_cli(capsys, "status", f"--cluster_spec={cluster.to_string()}")
    assert code == 0, out
    header, *rows = out.split("\n\n")[1].splitlines()
    assert header.split() == ["task", "steps", "ahead:", "pushes", "most"]
    assert rows == ["/job:ps/task:0  0: 1, 1: 1, 2: 1     2"]


def test_status_with_two_workers_names_chief_and_worker(local_cluster, capsys):
    cluster = local_cluster(num_ps=2, num_workers=2)
    model = make_model()
    with psframe.Trainer(model, cluster, transport=TRANSPORT) as t:
        t.step(loss_of(model, 0))
        code, out = run_cli(capsys, "status", f"--cluster_spec={cluster.to_string()}")
    assert code == 0, out
    rows = status_table(out)
    assert sorted(rows) == ["/job:ps/task:0", "/job:ps/task:1", "/job:worker/task:0", "/job:worker/task:1"]
    assert [rows[f"/job:ps/task:{k}"]["state"] for k in (0, 1)] == ["ready", "ready"]
    assert [rows[f"/job:ps/task:{k}"]["global_step"] for k in (0, 1)] == ["1", "1"]
    held = sum(int(rows[f"/job:ps/task:{k}"]["variables"]) for k in (0, 1))
    assert held == 4
    assert (rows["/job:worker/task:0"]["role"], rows["/job:worker/task:0"]["state"]) == ("chief", "training")
    assert (
        rows["/job:worker/task:1"]["role"],
        rows["/job:worker/task:1"]["state"],
        rows["/job:worker/task:1"]["last_seen"],
    ) == ("worker", "not seen", "never")


def test_status_lists_workers_that_joined_an_elastic_cluster_and_its_membership_changes(servers, capsys):
    cluster = free_cluster(1, 1)
    servers(cluster, 0, serving_processes=1, max_workers=2)
    grown = psframe.ClusterSpec({"ps": cluster.job_tasks("ps"), "worker": [*cluster.job_tasks("worker"), "h9:1"]})
    model = make_model()
    with psframe.Trainer(model, cluster, transport=TRANSPORT) as chief:
        chief.step(loss_of(model, 0))
        with psframe.Trainer(make_model(), grown, task_index=1, transport=TRANSPORT) as joiner:
            joiner.step(loss_of(joiner.model, 1))
        code, out = run_cli(capsys, "status", f"--cluster_spec={cluster.to_string()}")  # the cluster it started as
    assert code == 0, out
    rows = status_table(out)
    assert (rows["/job:worker/task:1"]["address"], rows["/job:worker/task:1"]["state"]) == ("(joined)", "finished")
    header, *changes = out.split("\n\n")[-1].splitlines()
    assert header.split() == ["worker", "membership", "change", "at", "step", "when"]
    assert [line.split()[:3] for line in changes] == [
        ["/job:worker/task:1", "joined", "1"],
        ["/job:worker/task:1", "left", "2"],
    ]


def status_after_three_steps(local_cluster, capsys, num_workers: int, batches_of) -> list[list[str]]:
    """The last table ``psframe status`` prints (its header first, each line's words) after a
    trainer's three steps on the batches ``batches_of(trainer)`` gives."""
    cluster = local_cluster(num_ps=1, num_workers=num_workers)
    model = make_model()
    with psframe.Trainer(model, cluster, transport=TRANSPORT) as t:
        batches = batches_of(t)
        for step in range(3):
            next(batches)
            t.step(loss_of(model, step))
        code, out = run_cli(capsys, "status", f"--cluster_spec={cluster.to_string()}")
        batches.close()
    assert code == 0, out
    return [line.split() for line in out.split("\n\n")[-1].splitlines()]


def test_status_shows_how_far_data_sets_read_in_ranges_are(local_cluster, capsys):
    header, *rows = status_after_three_steps(
        local_cluster, capsys, 2, lambda t: t.read(psframe.DataRanges("train", 100, batch_size=10, range_size=40))
    )
    assert header == ["data", "set", "consumed", "of", "ranges", "out"]
    assert rows == [["train", "30", "100", "1"]]


class Listed:
    """A stream held in lists (a StreamSource of no broker): partition p's record i is at offset i + 1."""

    name, partitions = "clicks", 2

    def __init__(self, per_partition: int) -> None:
        self._records = [[str(p + 2 * i).encode() for i in range(per_partition)] for p in range(2)]

    def read(self, partition, offset, max_records, timeout):
        start = max(offset, 1)
        values = self._records[partition][start - 1 : start - 1 + max_records]
        return [StreamRecord(partition, start + i, value) for i, value in enumerate(values)]

    def close(self):
        pass


def test_status_shows_how_far_each_ps_task_is_in_each_partition_of_a_stream(local_cluster, capsys):
    # Partition 0's records 1-4, partition 1's 1-4, partition 0's 5-6.
    header, *rows = status_after_three_steps(
        local_cluster, capsys, 1, lambda t: t.stream(Listed(per_partition=6), batch_size=4)
    )
    assert header == ["stream", "ps", "task", "offsets", "reached", "readers"]
    assert rows == [["clicks", "/job:ps/task:0", "7", "5", "0", "0"]]


def test_status_marks_a_ps_that_is_not_running_down_and_exits_1(servers, capsys):
    cluster = free_cluster(2, 1)
    servers(cluster, 0)  # ps 1 is never started
    code, out = run_cli(capsys, "status", f"--cluster_spec={cluster.to_string()}", "--timeout", "3")
    assert code == 1, out
    rows = status_table(out)
    assert sorted(rows) == ["/job:ps/task:0", "/job:ps/task:1", "/job:worker/task:0"]
    assert rows["/job:ps/task:0"]["state"] == "waiting_for_model"
    down = rows["/job:ps/task:1"]
    assert (down["address"], down["role"], down["state"], down["global_step"]) == (
        cluster.task_address("ps", 1),
        "ps",
        "down",
        "",
    )
    assert rows["/job:worker/task:0"]["state"] == "not seen"


# ---- shutdown


def train_without_closing(cluster, steps: int) -> tuple[psframe.Trainer, torch.nn.Module]:
    model = make_model()
    t = psframe.Trainer(
        model, cluster, placement=psframe.Placement(min_partition_bytes=64), transport=TRANSPORT
    ).connect()
    for step in range(steps):
        t.step(loss_of(model, step))
    return t, model


def test_shutdown_saves_a_checkpoint_and_stops_every_ps(servers, tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    cluster = free_cluster(2, 1)
    ps = [servers(cluster, i, checkpoint_dir=url) for i in range(2)]
    t, model = train_without_closing(cluster, 3)
    try:
        assert any(s.partitioned for s in t.placement.shards)
        with PsClient(cluster, 0) as client:
            assert [control_calls.get_info(client, k).checkpoint_dir for k in range(2)] == [url, url]
        assert [s.join(timeout=0.3) for s in ps] == [False, False]  # a worker is still training
        expected = params(model)
        code, out = run_cli(capsys, "shutdown", f"--cluster_spec={cluster.to_string()}", "--timeout", "20")
        assert code == 0, out
        folder = f"{url}/ckpt-{3:012d}"
        assert out.splitlines() == [
            f"saved checkpoint of global step 3 in {folder}",
            f"/job:ps/task:0 at {cluster.task_address('ps', 0)} is shutting down",
            f"/job:ps/task:1 at {cluster.task_address('ps', 1)} is shutting down",
        ]
        assert [s.join(timeout=10) for s in ps] == [True, True]
        manifests = checkpoint_io.list_checkpoints(url)
        assert [(m.step, m.num_shards) for m in manifests] == [(3, 2)]
        assert [r.global_step for r in manifests[0].shards] == [3, 3]
        assert_params_equal(checkpoint.load(url), expected)
    finally:
        t.close()  # the ps tasks are gone: only logged


def test_shutdown_with_an_explicit_checkpoint_dir(local_cluster, tmp_path, capsys):
    url = str(tmp_path / "elsewhere")
    cluster = local_cluster(num_ps=1, num_workers=1)  # ps without a checkpoint_dir of their own
    t, model = train_without_closing(cluster, 2)
    try:
        expected = params(model)
        code, out = run_cli(capsys, "shutdown", f"--cluster_spec={cluster.to_string()}", f"--checkpoint_dir={url}")
        assert code == 0, out
        assert out.splitlines()[0] == f"saved checkpoint of global step 2 in {url}/ckpt-{2:012d}"
        assert_params_equal(checkpoint.load(url), expected)
    finally:
        t.close()


def test_shutdown_no_save_saves_nothing(servers, tmp_path, capsys):
    url = tmp_path / "ckpt"
    cluster = free_cluster(2, 1)
    ps = [servers(cluster, i, checkpoint_dir=str(url)) for i in range(2)]
    t, _ = train_without_closing(cluster, 2)
    try:
        code, out = run_cli(capsys, "shutdown", f"--cluster_spec={cluster.to_string()}", "--no_save")
        assert code == 0, out
        assert out.splitlines() == [
            f"/job:ps/task:{k} at {cluster.task_address('ps', k)} is shutting down" for k in range(2)
        ]
        assert [s.join(timeout=10) for s in ps] == [True, True]
        assert checkpoint_io.list_checkpoints(str(url)) == []
        assert not url.exists() or not list(url.iterdir())
    finally:
        t.close()


def test_shutdown_without_any_checkpoint_dir_only_stops(local_cluster, capsys):
    cluster = local_cluster(num_ps=1, num_workers=1)
    t, _ = train_without_closing(cluster, 1)
    try:
        code, out = run_cli(capsys, "shutdown", f"--cluster_spec={cluster.to_string()}")
        assert code == 0, out
        assert "saved" not in out
        assert out.splitlines() == [f"/job:ps/task:0 at {cluster.task_address('ps', 0)} is shutting down"]
        with PsClient(cluster, 0) as client:
            assert control_calls.get_info(client, 0).state is TaskState.FINISHED
    finally:
        t.close()


# ---- a ps restores on its own


def test_a_ps_started_with_a_checkpoint_dir_restores_before_any_chief(local_cluster, servers, tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    with psframe.Trainer(model, cluster, checkpointing=psframe.Checkpointing(url), transport=TRANSPORT) as t:
        for step in range(4):
            t.step(loss_of(model, step))
    saved = params(model)
    assert [m.step for m in checkpoint_io.list_checkpoints(url)] == [4]

    # A new cluster of the same shape (new ports): the ps alone, no chief yet.
    cluster2 = free_cluster(1, 1)
    server = servers(cluster2, 0, checkpoint_dir=url)
    address = cluster2.task_address("ps", 0)
    code, out = run_cli(capsys, "ping", address, "--timeout", "5")
    assert code == 0, out
    assert out.startswith(f"{address} is /job:ps/task:0 (ready, global step 4, 4 variables, "), out
    n_params = sum(p.numel() for p in model.parameters())
    assert f", {n_params * 4} bytes), psframe {psframe.__version__}, " in out
    assert out.rstrip().endswith(f"cluster {cluster2.to_string()}")
    with PsClient(cluster2, 0) as client:
        info = control_calls.get_info(client, 0)
    assert (info.restored_step, info.global_step, info.checkpoint_dir) == (4, 4, url)

    # A chief with another random init then finds the checkpoint's values there.
    fresh = make_model(seed=77)
    with psframe.Trainer(
        fresh, cluster2, checkpointing=psframe.Checkpointing(url, save_steps=100), transport=TRANSPORT
    ) as t2:
        assert t2.global_step == 4
        assert_params_equal(params(fresh), saved)
    assert server.join(timeout=10) is True


def test_ping_of_a_ps_with_nothing_to_restore_is_waiting(servers, tmp_path, capsys):
    cluster = free_cluster(1, 1)
    servers(cluster, 0, checkpoint_dir=str(tmp_path / "none"))
    address = cluster.task_address("ps", 0)
    code, out = run_cli(capsys, "ping", f"grpc://{address}", "--timeout", "5")
    assert code == 0, out
    assert out.startswith(f"{address} is /job:ps/task:0 (waiting_for_model, global step 0, 0 variables, "), out


# ---- the message cap
