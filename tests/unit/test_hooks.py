"""Hooks around the trainer's steps, and checkpoints taken through the trainer.

Everything runs in-process against real ps servers on free loopback ports
(``local_cluster``), or, where the hooks alone are the subject, against ps
services reached without gRPC (``in_process_cluster``, the unit tier); every
wait has a deadline (connect/rpc timeouts below).

This file holds the unit tier's tests of the subject; `tests/service/test_hooks.py` holds the other
tiers'.
"""

from __future__ import annotations

import pytest

from psframe.hooks import StopAtStepHook
from psframe.worker.trainer import TrainerState
from tests.service.test_hooks import Recorder, loss_of, make_model, run_until_stop, trainer


def test_hook_calls_in_order_with_global_step_and_loss(in_process_cluster):
    # Two workers stepping in turn (async): the non-chief joins at global step 3,
    # and the chief's steps in between show up in the non-chief's global step.
    cluster = in_process_cluster(num_ps=2, num_workers=2).cluster
    chief_model, model = make_model(0), make_model(1)
    recorder = Recorder()
    with trainer(chief_model, cluster, 0) as chief:
        for step in range(3):
            chief.step(loss_of(chief_model, step))
        assert chief.global_step == 3
        other = trainer(model, cluster, 1, hooks=[recorder])
        assert recorder.calls == []
        with other:
            assert recorder.calls == [("begin", TrainerState.RUNNING, 3, 0)]
            losses = []
            for step in range(3):
                loss = loss_of(model, 10 + step)
                losses.append(loss)
                returned = other.step(loss)
                assert returned == other.global_step
                chief.step(loss_of(chief_model, 20 + step))  # advances the global step behind its back
            assert recorder.calls[-1][0] == "after"
        assert other.state is TrainerState.CLOSED
        expected = [
            ("begin", TrainerState.RUNNING, 3, 0),
            # before_step sees the step this worker last heard of; after_step the new one.
            ("before", 3, 0),
            ("after", 4, 4, 1, losses[0]),
            ("before", 4, 1),
            ("after", 6, 6, 2, losses[1]),
            ("before", 6, 2),
            ("after", 8, 8, 3, losses[2]),
            ("end", TrainerState.RUNNING, 8, 3),
        ]
        assert len(recorder.calls) == len(expected)
        for got, want in zip(recorder.calls, expected):
            assert got[:4] == want[:4] if got[0] == "after" else got == want
            if got[0] == "after":
                assert got[4] is want[4]  # the very loss tensor given to step()
        other.close()  # idempotent: end is not called again
        assert [c[0] for c in recorder.calls].count("end") == 1


@pytest.mark.parametrize("last_step", [1, 4, 7])
def test_stop_at_last_step_stops_exactly_there(in_process_cluster, last_step):
    cluster = in_process_cluster(num_ps=1, num_workers=1).cluster
    model = make_model()
    hook = StopAtStepHook(last_step=last_step)
    with trainer(model, cluster, hooks=[hook]) as t:
        assert t.should_stop() is False
        seen = run_until_stop(t, model)
        assert seen == [False] * (last_step - 1) + [True]
        assert t.global_step == last_step and t.stats.local_step == last_step
        assert hook.last_step == last_step


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"last_step": 3, "num_steps": 3},
        {"last_step": -1},
        {"num_steps": -5},
        {"last_step": 2.5},
        {"num_steps": "3"},
        {"last_step": True},
        {"last_step": None, "num_steps": None},
    ],
    ids=["neither", "both", "negative_last", "negative_num", "float", "str", "bool", "both_none"],
)
def test_stop_at_step_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        StopAtStepHook(**kwargs)
