"""The evaluator beside training: each committed checkpoint evaluated once, in order, from files alone.

Oracles: the metrics of a checkpoint computed by hand from ``psframe.checkpoint.load``,
and, for dynamic tables, those a live cluster gives at the same global step. The
evaluator never touches the training job: the process test trains twice, once with an
evaluator killed mid-way beside it, and compares the final checkpoints bit for bit.

This file holds the service tier's tests of the subject; `tests/unit/test_evaluator.py`,
`tests/cluster/test_evaluator.py` hold the other tiers'.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

import psframe
from psframe.hooks import StopAtStepHook
from tests.unit.test_evaluator import Clicks


def test_beside_training_it_sees_every_checkpoint_once_in_order_as_the_cluster_had_it(local_cluster, url):
    """Dynamic rows included: each checkpoint evaluates as the live cluster did at its step."""
    ids = torch.tensor([[5, 6], [7, 2**41], [-3, 5]])  # 2**41 and -3 are never trained: initial rows
    target = torch.tensor([1.0, -1.0, 0.5])

    def loss_of(m: torch.nn.Module) -> dict[str, float]:
        return {"loss": F.mse_loss(m(ids), target).item()}

    live: dict[int, dict[str, float]] = {}
    runner = psframe.Evaluator(Clicks(), loss_of, url, max_step=30, poll_seconds=0.02, timeout=120)
    failure: list[BaseException] = []
    cluster = local_cluster(num_ps=2, num_workers=1)

    def train() -> None:
        model = Clicks()
        try:
            with psframe.Trainer(
                model,
                cluster,
                optimizer=psframe.optim.Adagrad(lr=0.3),
                hooks=[StopAtStepHook(last_step=30)],
                checkpointing=psframe.Checkpointing(url, save_steps=10**6, keep=100),
            ) as trainer:
                generator = torch.Generator().manual_seed(3)
                while not trainer.should_stop():
                    batch = torch.randint(0, 8, (4, 2), generator=generator)
                    trainer.step(F.mse_loss(model(batch), torch.ones(4)))
                    if trainer.global_step % 6 == 0:
                        manifest = trainer.save_checkpoint()
                        model.eval()
                        with torch.no_grad():  # the live cluster's view at the same step
                            live[manifest.step] = loss_of(model)
                        model.train()
        except BaseException as e:
            failure.append(e)
            runner.stop()
            raise

    thread = threading.Thread(target=train, name="training", daemon=True)
    thread.start()
    history = runner.run()
    thread.join(timeout=120)
    assert not thread.is_alive() and not failure, failure
    assert list(live) == [6, 12, 18, 24, 30]
    assert history == live
