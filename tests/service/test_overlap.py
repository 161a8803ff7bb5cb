"""Sending a step's messages during backward (psframe.worker.model.overlap) changes nothing but when they go.

Oracle: the same training with ``overlap_backward`` on and off gives the same
parameters bit for bit, asynchronous (one worker, 2 ps tasks, several
messages per ps task) and synchronous (2 workers); and messages did go
before backward ended. Where overlap must not apply (a hook acting before
the push, embedding tables, gradients computed by the caller) nothing goes early.
"""

from __future__ import annotations

import torch

import psframe
from psframe.hooks import NanGuardHook
from tests.conftest import assert_params_equal, params
from tests.service.test_sync import connect_all, run_workers

STEPS = 6
# Small messages: each ps task gets several requests a step, as a large model does.
MAX_SHARD_BYTES = 4096
PLACEMENT = psframe.Placement(max_shard_bytes=MAX_SHARD_BYTES, min_partition_bytes=8192)
TRANSPORT = psframe.Transport(connect_timeout=30.0)


def _model(seed: int = 0, vocab: int | None = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    ]
    return torch.nn.Sequential(*layers)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def _train_async(local_cluster, overlap: bool, **trainer_args) -> tuple[dict, psframe.Trainer]:
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = _model()
    trainer = psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.Adam(lr=0.01),
        overlap_backward=overlap,
        placement=PLACEMENT,
        transport=TRANSPORT,
        **trainer_args,
    )
    with trainer:
        for step in range(STEPS):
            x, y = _batch(step)
            trainer.step(torch.nn.functional.cross_entropy(model(x), y))
        trainer.pull()
    return params(model), trainer


def test_async_with_overlap_equals_without(local_cluster):
    with_overlap, trainer = _train_async(local_cluster, overlap=True)
    without, plain = _train_async(local_cluster, overlap=False)
    assert_params_equal(with_overlap, without)
    assert trainer.stats.sent_during_backward > 0  # requests did go while backward ran
    assert plain.stats.sent_during_backward == 0
    assert len(trainer._session.replica.plan.step) > 2 * 2  # several messages per ps task


def test_sync_with_overlap_equals_without(local_cluster):
    def train(overlap: bool) -> tuple[list[dict], int]:
        cluster = local_cluster(num_ps=2, num_workers=2)
        models = {i: _model(seed=0) for i in range(2)}
        trainers = {
            i: psframe.Trainer(
                models[i],
                cluster,
                task_index=i,
                optimizer=psframe.optim.SGD(lr=0.1),
                sync=psframe.SyncReplicas(2, 2, timeout=30.0),
                overlap_backward=overlap,
                placement=PLACEMENT,
                transport=TRANSPORT,
            )
            for i in range(2)
        }
        connect_all(trainers)
        try:
            for step in range(STEPS):

                def one(i: int, step: int = step) -> None:
                    x, y = _batch(100 * i + step)
                    trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))

                run_workers({i: (lambda i=i: one(i)) for i in range(2)})
            for trainer in trainers.values():
                trainer.pull()
            return [params(models[i]) for i in range(2)], sum(t.stats.sent_during_backward for t in trainers.values())
        finally:
            for trainer in trainers.values():
                trainer.close()

    with_overlap, early = train(True)
    without, none = train(False)
    for a, b in zip(with_overlap, without):
        assert_params_equal(a, b)
    assert early > 0 and none == 0


def test_nothing_goes_early_where_overlap_must_not_apply(local_cluster):
    _, guarded = _train_async(local_cluster, overlap=True, hooks=[NanGuardHook()])
    assert guarded._overlap is None and guarded.stats.sent_during_backward == 0
