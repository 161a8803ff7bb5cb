"""psframe.Placement, Checkpointing, Transport: checked when made, and what the Trainer does with them."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import psframe
from psframe.worker.hooks import CheckpointSaverHook

CLUSTER = {"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3"]}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: psframe.Placement(strategy="random"), "strategy must be one of"),
        (lambda: psframe.Placement(table_partition="hash"), "table_partition must be one of"),
        (lambda: psframe.Placement(max_shard_bytes=0), "max_shard_bytes must be an int >= 1"),
        (lambda: psframe.Placement(min_partition_bytes=-1), "min_partition_bytes must be an int >= 0"),
        (lambda: psframe.Placement(variable_devices={"w": 1}), "variable_devices maps"),
        (lambda: psframe.Checkpointing(""), "needs a folder or URL"),
        (lambda: psframe.Checkpointing("d", save_steps=10, save_secs=5.0), "not both"),
        (lambda: psframe.Checkpointing("d", save_steps=0), "save_steps must be an int >= 1"),
        (lambda: psframe.Checkpointing("d", save_secs=float("inf")), "save_secs must be a finite"),
        (lambda: psframe.Checkpointing("d", keep=0), "keep must be an int >= 1"),
        (lambda: psframe.Transport(rpc_timeout=0), "rpc_timeout must be a finite number"),
        (lambda: psframe.Transport(connect_timeout=True), "connect_timeout must be a finite number"),
        (lambda: psframe.Transport(wire_dtype="int8"), "wire_dtype must be one of"),
    ],
)
def test_groups_refuse_bad_values_naming_them(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_groups_are_frozen_and_normalised():
    transport = psframe.Transport(wire_dtype=torch.bfloat16)
    assert transport.wire_dtype == "bfloat16"
    assert psframe.Transport(wire_dtype="float32").wire_dtype is None  # as stored
    with pytest.raises(AttributeError):
        transport.rpc_timeout = 1.0  # type: ignore[misc]
    assert psframe.Checkpointing("d").interval == (None, 600.0)
    assert psframe.Checkpointing("d", save_steps=7).interval == (7, None)


def test_trainer_takes_the_groups():
    trainer = psframe.Trainer(
        model(),
        CLUSTER,
        placement=psframe.Placement(strategy="round_robin", max_shard_bytes=1024),
        checkpointing=psframe.Checkpointing("memory://run", save_steps=3, keep=2),
        transport=psframe.Transport(connect_timeout=7.0, rpc_timeout=9.0, wire_dtype="float16", same_host_memory=False),
    )
    assert trainer.checkpoint_dir == "memory://run" and trainer.keep_checkpoints == 2
    saver = [h for h in trainer.hooks if isinstance(h, CheckpointSaverHook)]
    assert [(h.save_steps, h.save_secs) for h in saver] == [(3, None)]
    assert (trainer.connect_timeout, trainer.rpc_timeout) == (7.0, 9.0)
    assert trainer.wire_dtype == torch.float16 and trainer.shared_memory is False
    # 64 x 32 float32 is 8 KiB: parts of at most 1 KiB, dealt out in turn.
    assert max(s.nbytes for s in trainer.placement.shards) <= 1024
    assert {s.ps_task for s in trainer.placement.shards} == {0, 1}


def _placement_and_settings(trainer: psframe.Trainer):
    return (
        [(s.name, s.ps_task) for s in trainer.placement.shards],
        trainer.checkpoint_dir,
        trainer.keep_checkpoints,
        trainer.rpc_timeout,
        trainer.connect_timeout,
        trainer.wire_dtype,
        trainer.shared_memory,
    )


def test_a_placement_strategy_given_as_a_string_is_refused_naming_the_group():
    with pytest.raises(TypeError, match=r"Trainer\(placement=...\) must be a psframe.Placement, got str"):
        psframe.Trainer(model(), CLUSTER, placement="round_robin")


def test_an_unknown_keyword_argument_is_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'rpc_timout'"):
        psframe.Trainer(model(), CLUSTER, rpc_timout=5.0)


def test_an_unknown_keyword_argument_of_the_server_is_refused_before_it_binds():
    with pytest.raises(TypeError, match="unexpected keyword argument 'auth_tokn'"):
        psframe.Server(CLUSTER, "ps", 0, auth_tokn="x" * 32)


def test_a_group_of_the_wrong_kind_is_refused():
    with pytest.raises(TypeError, match=r"Trainer\(transport=...\) must be a psframe.Transport, got dict"):
        psframe.Trainer(model(), CLUSTER, transport={"rpc_timeout": 5.0})  # type: ignore[arg-type]


def test_the_groups_alone_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        psframe.Trainer(model(), CLUSTER, transport=psframe.Transport(rpc_timeout=5.0))


def test_the_trainer_s_settings_and_counters_are_read_only():
    trainer = psframe.Trainer(model(), CLUSTER)
    names = [name for name, value in inspect.getmembers(psframe.Trainer) if isinstance(value, property)]
    assert {"global_step", "stats", "state", "sync", "hooks", "model", "checkpoint_dir"} <= set(names)
    for name in names:
        if name.startswith("_"):
            continue
        with pytest.raises(AttributeError):
            setattr(trainer, name, getattr(trainer, name))
