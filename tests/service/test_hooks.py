"""Hooks around the trainer's steps, and checkpoints taken through the trainer.

Everything runs in-process against real ps servers on free loopback ports
(``local_cluster``), or, where the hooks alone are the subject, against ps
services reached without gRPC (``in_process_cluster``, the unit tier); every
wait has a deadline (connect/rpc timeouts below).

This file holds the service tier's tests of the subject; `tests/unit/test_hooks.py` holds the other
tiers'.
"""

from __future__ import annotations

import logging
import math
import re
import uuid

import fsspec
import pytest
import torch

import psframe
from psframe import checkpoint
from psframe.checkpoint import files as checkpoint_io
from psframe.errors import CheckpointError, NanLossError
from psframe.hooks import Hook, LoggingHook, NanGuardHook, StopAtStepHook, TensorBoardHook
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from psframe.worker.trainer import TrainerState
from tests.conftest import assert_params_equal, params

TRANSPORT = psframe.Transport(connect_timeout=20.0, rpc_timeout=30.0)


def make_model(seed: int = 0, hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


def trainer(model, cluster, task_index=0, **kwargs) -> psframe.Trainer:
    return psframe.Trainer(model, cluster, task_index=task_index, **{"transport": TRANSPORT, **kwargs})


class Recorder(Hook):
    """Records every call with what the trainer showed at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin(self, trainer):
        self.calls.append(("begin", trainer.state, trainer.global_step, trainer.stats.local_step))

    def before_step(self, trainer):
        self.calls.append(("before", trainer.global_step, trainer.stats.local_step))

    def after_step(self, trainer, global_step, loss):
        self.calls.append(("after", global_step, trainer.global_step, trainer.stats.local_step, loss))

    def end(self, trainer):
        self.calls.append(("end", trainer.state, trainer.global_step, trainer.stats.local_step))


# ---- the Hook protocol


def test_end_is_called_when_the_body_raises_and_the_error_propagates(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    recorder = Recorder()
    t = trainer(model, cluster, hooks=[recorder])
    with pytest.raises(RuntimeError, match="boom in the training loop"):
        with t:
            t.step(loss_of(model, 0))
            raise RuntimeError("boom in the training loop")
    assert [c[0] for c in recorder.calls] == ["begin", "before", "after", "end"]
    assert recorder.calls[-1] == ("end", TrainerState.RUNNING, 1, 1)
    assert t.state is TrainerState.CLOSED
    t.close()
    assert [c[0] for c in recorder.calls].count("end") == 1
    # The worker still reported that it finished.
    with PsClient(cluster, 0) as client:
        assert list(control_calls.get_info(client, 0).finished_workers) == [0]


def test_end_is_called_when_a_hook_raises_in_after_step(local_cluster):
    class Fails(Hook):
        def after_step(self, trainer, global_step, loss):
            if global_step == 2:
                raise ValueError(f"bad at {global_step}")

    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    recorder = Recorder()
    t = trainer(model, cluster, hooks=[Fails(), recorder])
    with pytest.raises(ValueError, match="bad at 2"):
        with t:
            for step in range(5):
                t.step(loss_of(model, step))
    assert [c[0] for c in recorder.calls] == ["begin", "before", "after", "before", "end"]
    assert recorder.calls[-1] == ("end", TrainerState.RUNNING, 2, 2)


# ---- StopAtStepHook


def run_until_stop(t: psframe.Trainer, model, max_steps: int = 50) -> list[bool]:
    """Step until should_stop(); returns should_stop() after each step."""
    seen = []
    for step in range(max_steps):
        t.step(loss_of(model, step))
        seen.append(t.should_stop())
        if t.should_stop():
            break
    return seen


def test_stop_at_step_counts_num_steps_from_the_step_at_begin(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=2)
    chief_model, model = make_model(0), make_model(1)
    with trainer(chief_model, cluster, 0) as chief:
        for step in range(3):
            chief.step(loss_of(chief_model, step))
        hook = StopAtStepHook(num_steps=4)
        with trainer(model, cluster, 1, hooks=[hook]) as t:
            assert t.global_step == 3 and hook.last_step == 7
            seen = run_until_stop(t, model)
            assert seen == [False, False, False, True]
            assert t.global_step == 7 and t.stats.local_step == 4
        # Already past last_step at begin: asks to stop before any step.
        late = StopAtStepHook(last_step=2)
        with trainer(make_model(2), cluster, 1, hooks=[late]) as t:
            assert t.global_step == 7
            assert t.should_stop() is True


# ---- NanGuardHook


def nan_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    return loss_of(model, step) * float("nan")


def test_nan_loss_raises_naming_the_global_step(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    recorder = Recorder()
    t = trainer(model, cluster, hooks=[NanGuardHook(), recorder])
    with pytest.raises(NanLossError, match=r"worker 0: loss is nan at global step 2; its gradients were not sent$"):
        with t:
            t.step(loss_of(model, 0))
            t.step(loss_of(model, 1))
            before = [p.detach().clone() for p in model.parameters()]
            t.step(nan_loss(model, 2))
    assert isinstance(NanLossError("x"), FloatingPointError)
    assert recorder.calls[-1][0] == "end" and t.state is TrainerState.CLOSED
    # Nothing reached the ps: its variables are still those of global step 2.
    client = PsClient(cluster, 0)
    try:
        info = control_calls.get_info(client, 0)
    finally:
        client.close()
    assert info.global_step == 2
    assert all(torch.isfinite(p).all() for p in before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_guard_without_fail_requests_a_stop_and_logs_an_error(local_cluster, caplog, bad):
    caplog.set_level(logging.INFO, logger="psframe")
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    with trainer(model, cluster, hooks=[NanGuardHook(fail_on_nan=False)]) as t:
        t.step(loss_of(model, 0))
        assert t.should_stop() is False
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        t.step(loss_of(model, 1) * bad)
        assert t.should_stop() is True
        assert t.global_step == 1  # the step went through as a pull: nothing applied
        assert all(torch.isfinite(p).all() for p in model.parameters())
    errors = [r for r in caplog.records if r.name == "psframe.hooks" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        f"worker 0: loss is {bad} at global step 1; its gradients were not sent; stopping"
    ]


def test_nan_guard_ignores_finite_losses_and_no_loss(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    with trainer(model, cluster, hooks=[NanGuardHook()]) as t:
        t.step(loss_of(model, 0))
        loss_of(model, 1).backward()
        t.step()  # gradients computed by the caller: loss is None
        assert t.global_step == 2 and t.should_stop() is False


# ---- LoggingHook


def test_logging_hook_logs_every_second_local_step(local_cluster, caplog):
    caplog.set_level(logging.INFO, logger="psframe.hooks")
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    losses = []
    with trainer(model, cluster, hooks=[LoggingHook(every_n_steps=2)]) as t:
        for step in range(5):
            loss = loss_of(model, step)
            losses.append(loss.item())
            t.step(loss)
    messages = [r.getMessage() for r in caplog.records if r.name == "psframe.hooks"]
    assert len(messages) == 2, messages
    for message, local in zip(messages, (2, 4)):
        match = re.fullmatch(
            r"worker 0: global step (\d+), local step (\d+), loss (\S+), ([0-9.]+) global steps/s", message
        )
        assert match, message
        assert int(match.group(1)) == local and int(match.group(2)) == local
        assert match.group(3) == f"{losses[local - 1]:.4f}"
        assert float(match.group(4)) > 0


def test_logging_hook_uses_the_given_logger_and_rejects_bad_n(local_cluster, caplog):
    mine = logging.getLogger("tests.hooks.mine")
    caplog.set_level(logging.INFO, logger="tests.hooks.mine")
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    with trainer(model, cluster, hooks=[LoggingHook(every_n_steps=3, logger=mine)]) as t:
        for step in range(7):
            t.step(loss_of(model, step))
    got = [r.getMessage() for r in caplog.records if r.name == "tests.hooks.mine"]
    assert [m.split(",")[0] for m in got] == ["worker 0: global step 3", "worker 0: global step 6"]
    with pytest.raises(ValueError):
        LoggingHook(every_n_steps=0)


# ---- TensorBoardHook


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = accumulator_module.EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_hook_writes_loss_and_rate_on_the_chief(local_cluster, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch.utils.tensorboard")
    cluster = local_cluster(num_ps=1, num_workers=2)
    chief_dir, other_dir = tmp_path / "chief", tmp_path / "other"
    model = make_model(0)
    losses = []
    other_model = make_model(1)
    with trainer(model, cluster, 0, hooks=[TensorBoardHook(str(chief_dir), every_n_steps=1)]) as t:
        for step in range(4):
            if step == 2:  # the other worker's step makes the chief's global steps 1, 2, 4, 5
                with trainer(other_model, cluster, 1, hooks=[TensorBoardHook(str(other_dir), every_n_steps=1)]) as o:
                    assert o.step(loss_of(other_model, 9)) == 3
            loss = loss_of(model, step)
            losses.append(loss.item())
            t.step(loss)
        assert t.global_step == 5 and t.stats.local_step == 4
    assert not other_dir.exists() or not any(other_dir.rglob("events.out.tfevents.*"))
    assert list(chief_dir.glob("events.out.tfevents.*"))
    scalars = read_scalars(chief_dir)
    assert sorted(scalars) == ["global_steps_per_sec", "loss"]
    assert [s for s, _ in scalars["loss"]] == [1, 2, 4, 5]  # by global step
    # Stored as float32: the losses are float32 values, so they come back exactly.
    assert [v for _, v in scalars["loss"]] == losses
    rates = scalars["global_steps_per_sec"]
    assert [s for s, _ in rates] == [1, 2, 4, 5]
    assert all(math.isfinite(v) and v > 0 for _, v in rates)
    # How far ahead of the other worker each step found the chief: 1 at its second step (the
    # other had none yet), then none once the other finished.
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(chief_dir), size_guidance={"histograms": 0})  # keep them all
    events.Reload()
    ahead = [(e.step, e.histogram_value.max) for e in events.Histograms("steps_ahead")]
    assert ahead == [(1, 0.0), (2, 1.0), (4, 0.0), (5, 0.0)]


def test_tensorboard_hook_every_n_steps(local_cluster, tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch.utils.tensorboard")
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    losses = []
    with trainer(model, cluster, hooks=[TensorBoardHook(str(tmp_path), every_n_steps=2)]) as t:
        for step in range(5):
            loss = loss_of(model, step)
            losses.append(loss.item())
            t.step(loss)
    scalars = read_scalars(tmp_path)
    assert scalars["loss"] == [(2, losses[1]), (4, losses[3])]
    assert [s for s, _ in scalars["global_steps_per_sec"]] == [2, 4]
    with pytest.raises(ValueError):
        TensorBoardHook(str(tmp_path), every_n_steps=0)


# ---- checkpoints through the trainer


class CheckpointWatcher(Hook):
    """Before each step, which checkpoints are committed (and so what the last step saved)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[list[int]] = []

    def before_step(self, trainer):
        self.seen.append([m.step for m in checkpoint_io.list_checkpoints(self.url)])


@pytest.fixture(params=["memory", "local"])
def checkpoint_url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://psframe-test-{uuid.uuid4().hex}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_trainer_checkpoints_every_n_steps_keeps_the_newest_and_loads_back(local_cluster, checkpoint_url):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = make_model(hidden=8)
    watcher = CheckpointWatcher(checkpoint_url)
    t = trainer(
        model,
        cluster,
        hooks=[watcher],
        checkpointing=psframe.Checkpointing(checkpoint_url, save_steps=3, keep=2),
        placement=psframe.Placement(min_partition_bytes=64),
    )
    assert any(s.partitioned for s in t.placement.shards)
    with t:
        for step in range(10):
            t.step(loss_of(model, step))
    assert t.global_step == 10
    # Seen before steps 1..10: a checkpoint appears after global steps 3, 6 and 9.
    assert watcher.seen == [[], [], [], [3], [3], [3], [3, 6], [3, 6], [3, 6], [6, 9]]
    manifests = checkpoint_io.list_checkpoints(checkpoint_url)
    assert [m.step for m in manifests] == [9, 10]  # the final one at close; 3 and 6 pruned
    assert all(m.num_shards == 2 for m in manifests)
    assert [r.global_step for r in manifests[-1].shards] == [10, 10]
    fs, root = fsspec.core.url_to_fs(checkpoint_url)
    assert not fs.exists(f"{root}/ckpt-{3:012d}") and not fs.exists(f"{root}/ckpt-{6:012d}")

    final = params(model)
    loaded = checkpoint.load(checkpoint_url)
    assert_params_equal(loaded, final)
    assert_params_equal(checkpoint.load(checkpoint_url, step=10), final)
    at_9 = checkpoint.load(checkpoint_url, step=9)
    assert not torch.equal(at_9["0.weight"], final["0.weight"])

    fresh = make_model(seed=42, hidden=8)
    assert not torch.equal(fresh[0].weight, final["0.weight"])
    result = fresh.load_state_dict(loaded, strict=False)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert_params_equal(params(fresh), final)

    for pruned in (3, 6, 7):
        with pytest.raises(CheckpointError, match=f"step {pruned}"):
            checkpoint.load(checkpoint_url, step=pruned)


def test_save_checkpoint_without_a_checkpoint_dir_is_an_error(local_cluster, tmp_path):
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = make_model()
    with trainer(model, cluster) as t:
        t.step(loss_of(model, 0))
        with pytest.raises(CheckpointError, match=re.escape("needs Trainer(checkpointing=psframe.Checkpointing(dir))")):
            t.save_checkpoint()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        checkpoint.load(str(tmp_path / "empty"))


def test_save_checkpoint_returns_the_manifest_and_close_at_the_same_step_saves_nothing_new(local_cluster, tmp_path):
    cluster = local_cluster(num_ps=2, num_workers=1)
    url = str(tmp_path / "ckpt")
    model = make_model()
    with trainer(model, cluster, checkpointing=psframe.Checkpointing(url, save_steps=100)) as t:
        for step in range(2):
            t.step(loss_of(model, step))
        manifest = t.save_checkpoint()
        assert manifest.step == 2 and manifest.num_shards == 2
        assert [m.step for m in checkpoint_io.list_checkpoints(url)] == [2]
        t.step(loss_of(model, 2))
    assert [m.step for m in checkpoint_io.list_checkpoints(url)] == [2, 3]
    assert_params_equal(checkpoint.load(url), params(model))


def test_a_manual_save_at_the_last_step_does_not_break_close(local_cluster, tmp_path):
    cluster = local_cluster(num_ps=1, num_workers=1)
    url = str(tmp_path / "ckpt")
    model = make_model()
    with trainer(model, cluster, checkpointing=psframe.Checkpointing(url)) as t:
        for step in range(2):
            t.step(loss_of(model, step))
        t.save_checkpoint()
    assert [m.step for m in checkpoint_io.list_checkpoints(url)] == [2]


def test_restore_onto_more_ps_tasks_repartitions_and_keeps_adam_state(local_cluster, tmp_path):
    url = str(tmp_path / "ckpt")
    adam = psframe.optim.Adam(lr=0.05)
    options = {
        "optimizer": adam,
        "checkpointing": psframe.Checkpointing(url),
        "placement": psframe.Placement(min_partition_bytes=64),
    }

    # The uninterrupted reference: one process, torch.optim.Adam, 5 steps.
    reference = make_model(seed=0)
    local_opt = torch.optim.Adam(reference.parameters(), lr=0.05)

    def reference_step(step):
        local_opt.zero_grad()
        loss_of(reference, step).backward()
        local_opt.step()

    # Run 1: two ps tasks, 4 steps; the checkpoint is saved at close.
    cluster2 = local_cluster(num_ps=2, num_workers=1)
    model2 = make_model(seed=0)
    with trainer(model2, cluster2, **options) as t2:
        assert any(s.partitioned for s in t2.placement.shards)
        for step in range(4):
            t2.step(loss_of(model2, step))
            reference_step(step)
        assert_params_equal(params(model2), params(reference))
    saved = checkpoint_io.list_checkpoints(url)
    assert [(m.step, m.num_shards) for m in saved] == [(4, 2)]
    at_4 = params(model2)

    # Run 2: a new cluster of three ps tasks, a chief with another random init.
    cluster3 = local_cluster(num_ps=3, num_workers=1)
    model3 = make_model(seed=123)
    assert not torch.equal(model3[0].weight, at_4["0.weight"])
    with trainer(model3, cluster3, **options) as t3:
        shards = {s.variable: [] for s in t3.placement.shards}
        for s in t3.placement.shards:
            shards[s.variable].append(s.ps_task)
        assert sorted(shards["0.weight"]) == [0, 1, 2]  # now cut in three
        assert t3.global_step == 4
        assert_params_equal(params(model3), at_4)
        with PsClient(cluster3, 0) as client:
            infos = [control_calls.get_info(client, k) for k in range(3)]
        assert [i.global_step for i in infos] == [4, 4, 4]
        assert [i.restored_step for i in infos] == [4, 4, 4]

        assert t3.step(loss_of(model3, 4)) == 5
        reference_step(4)
        for name, value in params(reference).items():
            torch.testing.assert_close(params(model3)[name], value, rtol=1e-6, atol=1e-7)
    # Sanity: had the Adam moments and step count been lost, the step would differ.
    fresh = make_model(seed=0)
    fresh.load_state_dict(at_4)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    loss_of(fresh, 4).backward()
    fresh_opt.step()
    assert not torch.allclose(params(fresh)["0.weight"], params(reference)["0.weight"], atol=1e-4)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(local_cluster, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="psframe")
    url = str(tmp_path / "ckpt")
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = make_model()
    with trainer(model, cluster, checkpointing=psframe.Checkpointing(url, save_steps=3)) as t:
        for step in range(3):
            t.step(loss_of(model, step))
        at_3 = params(model)
        for step in range(3, 5):
            t.step(loss_of(model, step))
    manifests = checkpoint_io.list_checkpoints(url)
    assert [m.step for m in manifests] == [3, 5]
    shard_file = tmp_path / "ckpt" / f"ckpt-{5:012d}" / manifests[-1].shards[1].file
    data = bytearray(shard_file.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    shard_file.write_bytes(bytes(data))

    caplog.clear()
    cluster2 = local_cluster(num_ps=2, num_workers=1)
    restored = make_model(seed=9)
    with trainer(restored, cluster2, checkpointing=psframe.Checkpointing(url, save_steps=100)) as t2:
        assert t2.global_step == 3
        assert_params_equal(params(restored), at_3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(shard_file.name) in m and "ckpt-000000000005" in m for m in warnings), warnings
    assert_params_equal(checkpoint.load(url, step=3), at_3)
