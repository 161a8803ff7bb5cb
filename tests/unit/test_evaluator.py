"""The evaluator beside training: each committed checkpoint evaluated once, in order, from files alone.

Oracles: the metrics of a checkpoint computed by hand from ``psframe.checkpoint.load``,
and, for dynamic tables, those a live cluster gives at the same global step. The
evaluator never touches the training job: the process test trains twice, once with an
evaluator killed mid-way beside it, and compares the final checkpoints bit for bit.

This file holds the unit tier's tests of the subject; `tests/service/test_evaluator.py`,
`tests/cluster/test_evaluator.py` hold the other tiers'.
"""

from __future__ import annotations

import argparse
import json
import logging
import re

import fsspec
import pytest
import torch

import psframe
from psframe import cli, flags
from psframe.checkpoint import files as checkpoint_files
from psframe.checkpoint.shard import OptimizerData, ShardData, VariableData
from psframe.errors import ClusterMismatchError, ClusterSpecError
from psframe.tables.row_math import initial_rows
from psframe.worker.model_state import load_model_state
from tests.conftest import ROOT
from tests.support.evaluator_jobs import linear, linear_data, linear_model, mse

EXAMPLE = ROOT / "examples" / "ctr_dist.py"
FAST = {"poll_seconds": 0.02, "timeout": 0.3}  # an empty folder ends the evaluator at once


def commit(url: str, step: int, model: torch.nn.Module) -> checkpoint_files.Manifest:
    """Commit a one-shard checkpoint of ``model``'s parameters at ``step``, as a ps task and the chief would."""
    variables = [
        VariableData(
            name=name,
            variable=name,
            dtype=str(p.dtype).removeprefix("torch."),
            shape=tuple(p.shape),
            full_shape=tuple(p.shape),
            row_start=0,
            part_index=0,
            num_parts=1,
            value=p.detach().clone(),
        )
        for name, p in model.named_parameters()
    ]
    shard = ShardData(
        global_step=step, ps_task=0, num_shards=1, optimizer=OptimizerData("SGD"), sync=None, variables=variables
    )
    return checkpoint_files.write_manifest(url, step, [checkpoint_files.write_shard(url, step, shard)])


def model_of_step(step: int) -> torch.nn.Module:
    """The parameters training has at ``step``: different at every step."""
    torch.manual_seed(1000 + step)
    return torch.nn.Linear(4, 1)


def metric_from_load(url: str, step: int) -> dict[str, float]:
    """The oracle: a fresh model loaded by hand from the checkpoint of ``step``."""
    model = linear_model()
    model.load_state_dict(psframe.checkpoint.load(url, step=step), strict=False)
    with torch.no_grad():
        return mse(model, linear_data())


def evaluator(url: str, **settings) -> psframe.Evaluator:
    model, evaluate_fn = linear()
    return psframe.Evaluator(model, evaluate_fn, url, **{**FAST, **settings})


# ---- the iterator


def test_each_committed_checkpoint_comes_once_in_step_order_as_training_commits_them(url):
    for step in (10, 20):
        commit(url, step, model_of_step(step))
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(f"{root}/ckpt-000000000025")  # a save in progress: no manifest, not a checkpoint
    seen = []
    for manifest in psframe.checkpoints_iterator(url, max_step=40, **FAST):
        seen.append(manifest.step)
        if manifest.step == 10:  # training goes on while the evaluator works
            commit(url, 15, model_of_step(15))
            commit(url, 30, model_of_step(30))
        if manifest.step == 30:
            commit(url, 40, model_of_step(40))
            commit(url, 50, model_of_step(50))  # past max_step: never reached
        assert len(seen) < 10
    assert seen == [10, 15, 20, 30, 40]


def test_latest_only_goes_to_the_newest_checkpoint_each_time_skipping_those_in_between(url):
    for step in (10, 20):
        commit(url, step, model_of_step(step))
    seen = []
    for manifest in psframe.checkpoints_iterator(url, max_step=60, latest_only=True, **FAST):
        seen.append(manifest.step)
        if manifest.step == 20:  # committed while step 20 is evaluated: only the newest is taken
            for step in (30, 40, 50):
                commit(url, step, model_of_step(step))
        if manifest.step == 50:
            commit(url, 60, model_of_step(60))
        assert len(seen) < 10
    assert seen == [20, 50, 60]
    with pytest.raises(TypeError, match="latest_only must be a bool, got str"):
        psframe.checkpoints_iterator(url, latest_only="yes")
    with pytest.raises(TypeError, match="latest_only must be a bool, got int"):
        evaluator(url, latest_only=1)


def test_it_ends_by_its_deadline_or_when_asked_when_no_checkpoint_comes(url):
    assert list(psframe.checkpoints_iterator(url, **FAST)) == []
    asked = []

    def stop() -> bool:
        asked.append(1)
        return True

    assert list(psframe.checkpoints_iterator(url, poll_seconds=0.02, timeout=600, stop=stop)) == []
    assert asked == [1]
    assert evaluator(url).run() == {}


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"poll_seconds": 0}, "poll_seconds must be a finite number of seconds > 0, got 0"),
        ({"timeout": float("inf")}, "timeout must be a finite number of seconds > 0, got inf"),
        ({"max_step": -1}, r"max_step must be an int >= 0 or None, got -1"),
    ],
)
def test_settings_out_of_range_are_refused_at_once(url, settings, message):
    with pytest.raises(ValueError, match=message):
        psframe.checkpoints_iterator(url, **settings)
    with pytest.raises(ValueError, match=message):
        evaluator(url, **settings)
    with pytest.raises(TypeError, match="evaluate_fn must be callable, got int"):
        psframe.Evaluator(linear_model(), 3, url)  # type: ignore[arg-type]


# ---- the evaluator


def test_each_metric_is_the_one_computed_from_checkpoint_load_and_goes_to_tensorboard(url, tmp_path, caplog):
    for step in (5, 10, 15):
        commit(url, step, model_of_step(step))
    with caplog.at_level(logging.INFO, logger="psframe.evaluator"):
        history = evaluator(url, max_step=15, log_dir=str(tmp_path / "runs")).run()
    assert list(history) == [5, 10, 15]
    for step, metrics in history.items():
        assert metrics == metric_from_load(url, step)
    assert len({m["mse"] for m in history.values()}) == 3  # every checkpoint's own parameters
    assert f"evaluator: checkpoint step 10: mse={history[10]['mse']:.6g}" in caplog.text
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    scalars = events.Scalars("mse")
    assert [s.step for s in scalars] == [5, 10, 15]
    assert [s.value for s in scalars] == pytest.approx([m["mse"] for m in history.values()], rel=1e-6)


def test_a_damaged_or_pruned_checkpoint_is_skipped_with_a_warning_and_the_next_is_tried(url, caplog):
    manifests = {step: commit(url, step, model_of_step(step)) for step in (1, 2, 3, 4)}
    fs, _ = fsspec.core.url_to_fs(url)
    damaged = f"{manifests[2].folder}/{manifests[2].shards[0].file}"
    fs.pipe_file(damaged, b"not a shard")
    model, evaluate_fn = linear()
    calls = []

    def evaluate_and_prune(m: torch.nn.Module) -> dict[str, float]:
        calls.append(1)
        if len(calls) == 1:  # while step 1 is evaluated, training prunes step 3's shard away
            fs.rm(f"{manifests[3].folder}/{manifests[3].shards[0].file}")
        return evaluate_fn(m)

    runner = psframe.Evaluator(model, evaluate_and_prune, url, max_step=4, **FAST)
    with caplog.at_level(logging.WARNING, logger="psframe.evaluator"):
        history = runner.run()
    assert list(history) == [1, 4] and runner.skipped == [2, 3]
    assert history[4] == metric_from_load(url, 4)
    assert "skipping checkpoint" in caplog.text and "ckpt-000000000002" in caplog.text
    assert "ckpt-000000000003" in caplog.text


def test_a_checkpoint_pruned_between_its_listing_and_its_load_is_skipped(url, caplog):
    listed = commit(url, 1, model_of_step(1))
    commit(url, 2, model_of_step(2))
    commit(url, 3, model_of_step(3))
    assert checkpoint_files.prune(url, keep=1) == [1, 2]
    runner = evaluator(url)
    with caplog.at_level(logging.WARNING, logger="psframe.evaluator"):
        assert runner.evaluate(listed) is None
    assert runner.skipped == [1] and runner.history == {}
    assert "no committed checkpoint of step 1" in caplog.text


def test_stop_ends_the_run_after_the_checkpoint_at_hand(url):
    for step in (1, 2, 3):
        commit(url, step, model_of_step(step))
    model, evaluate_fn = linear()

    def evaluate_then_stop(m: torch.nn.Module) -> dict[str, float]:
        runner.stop()  # as another thread would
        return evaluate_fn(m)

    runner = psframe.Evaluator(model, evaluate_then_stop, url, timeout=600)
    assert list(runner.run()) == [1]


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_what_differs(url):
    commit(url, 1, torch.nn.Linear(3, 1))
    with pytest.raises(ClusterMismatchError, match=r"weight is \(1, 3\) in the checkpoint, \(1, 4\) in the model"):
        evaluator(url).run()


def test_metrics_must_be_names_and_numbers(url):
    commit(url, 1, model_of_step(1))
    runner = psframe.Evaluator(linear_model(), lambda m: {"mse": [1.0, 2.0]}, url, **FAST)
    with pytest.raises(TypeError, match="metric 'mse' must be a number"):
        runner.run()
    runner = psframe.Evaluator(linear_model(), lambda m: 0.5, url, **FAST)
    with pytest.raises(TypeError, match="must return a dict of metric names to numbers, got float"):
        runner.run()


class Clicks(torch.nn.Module):
    """A dynamic table and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = psframe.DynamicEmbedding(3, initializer=psframe.RowInitializer(std=0.5, seed=4))
        self.head = torch.nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids).mean(1)).squeeze(1)


def test_a_dynamic_table_looks_its_rows_up_in_the_checkpoint_and_others_get_their_initial_row():
    model = Clicks()
    held = torch.tensor([-(2**40), 7, 2**50])
    rows = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    state = {"users.ids": held, "users.rows": rows, **{k: v + 1 for k, v in model.state_dict().items()}}
    load_model_state(model, state)
    assert torch.equal(model.head.bias, state["head.bias"])
    model.eval()
    ids = torch.tensor([7, 8, 2**50, -(2**40)])
    with torch.no_grad():
        looked_up = model.users(ids)
    assert torch.equal(looked_up[[0, 2, 3]], rows[[1, 2, 0]])
    assert torch.equal(
        looked_up[1], initial_rows(model.users.spec.initializer, torch.tensor([8]), (3,), torch.float32)[0]
    )
    with pytest.raises(ClusterMismatchError, match=r"users.rows \(a dynamic table's\) is not in the checkpoint"):
        load_model_state(Clicks(), {k: v for k, v in state.items() if k != "users.rows"})
    with pytest.raises(ClusterMismatchError, match=r"the rows of users are \(2,\) wide in the checkpoint, \(3,\)"):
        load_model_state(Clicks(), {**state, "users.rows": rows[:, :2]})


# ---- TF_CONFIG's evaluator, and the command


def test_tf_config_s_evaluator_is_this_task_only_for_a_program_that_asks():
    parser = argparse.ArgumentParser()
    flags.add_cluster_flags(parser, evaluator=True)
    cluster = {"ps": ["h0:2222"], "worker": ["h1:2224"], "evaluator": ["h2:2226"]}
    environ = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})}
    spec, job_name, task_index = flags.cluster_from_flags(parser.parse_args([]), environ, evaluator=True)
    assert (spec.to_string(), job_name, task_index) == ("ps|h0:2222,worker|h1:2224", "evaluator", 0)
    with pytest.raises(ClusterSpecError, match=r"cluster_from_flags\(args, evaluator=True\)"):
        flags.cluster_from_flags(parser.parse_args([]), environ)
    by_flag = parser.parse_args(["--ps_hosts=h0:2222", "--worker_hosts=h1:2224", "--job_name=evaluator"])
    assert flags.cluster_from_flags(by_flag, {}, evaluator=True)[1:] == ("evaluator", 0)
    plain = argparse.ArgumentParser()
    flags.add_cluster_flags(plain)
    with pytest.raises(SystemExit):
        plain.parse_args(["--job_name=evaluator"])


def test_psframe_evaluate_prints_each_checkpoint_s_metrics(url, capsys):
    for step in (2, 4):
        commit(url, step, model_of_step(step))
    factory = str(ROOT / "tests" / "support" / "evaluator_jobs.py") + ":linear"
    code = cli.main(["evaluate", f"--checkpoint_dir={url}", "--max_step=4", "--poll_seconds=0.02", factory, "--", "-x"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines == [{"global_step": s, **metric_from_load(url, s), "args": 1.0} for s in (2, 4)]


@pytest.mark.parametrize(
    "factory,message",
    [
        ("tests.support.evaluator_jobs:linear", "evaluated no checkpoint: none came in"),
        ("tests/no_such_file.py:make", "the factory's file 'tests/no_such_file.py' is not a file"),
        ("tests.no_such_module:make", "the factory's module 'tests.no_such_module' cannot be found"),
        ("tests.support.evaluator_jobs:missing", "tests.support.evaluator_jobs has no function 'missing'"),
        ("tests.support.evaluator_jobs:not_a_pair", r"must return \(model, evaluate_fn\)"),
        ("linear", "the factory must be path/to/file.py:function or package.module:function"),
    ],
)
def test_psframe_evaluate_fails_in_one_line(url, capsys, monkeypatch, factory, message):
    monkeypatch.chdir(ROOT)
    code = cli.main(["evaluate", f"--checkpoint_dir={url}", "--timeout=0.2", "--poll_seconds=0.02", factory])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("psframe evaluate: error: ")
    assert re.search(message, err[-1]), err[-1]


# ---- beside a cluster
