"""The user's own gradient clipping sees embedding tables' rows: ``clip_grad_norm_`` and
``clip_grad_value_`` over ``model.parameters()`` train a model with tables as one process trains
the same model with dense embeddings; what cannot act on a table's rows fails loudly."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.errors import InvalidGradientError
from psframe.worker.model.row_gradient import RowGradient

ROWS, BAG_ROWS, DIM = 29, 17, 4
TABLES = ("emb.weight", "bag.weight")


class Model(torch.nn.Module):
    """Two tables (looked up three times in a step: the Embedding twice) and a dense head."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=sparse)
        self.bag = torch.nn.EmbeddingBag(BAG_ROWS, DIM, mode="sum", sparse=sparse)
        self.head = torch.nn.Linear(3 * DIM, 1)

    def forward(self, ids, other_ids, bag_ids, offsets):
        looked_up = [self.emb(ids).mean(1), self.emb(other_ids).mean(1), self.bag(bag_ids, offsets)]
        return self.head(torch.cat(looked_up, 1)).squeeze(1)


def loss_of(model: Model, step: int) -> torch.Tensor:
    """A batch with repeated ids (also between the two lookups of one table), large targets so
    that the gradients are large enough to clip."""
    g = torch.Generator().manual_seed(7 + step)
    ids = (torch.rand(6, 3, generator=g) ** 2 * ROWS).long()
    other_ids = (torch.rand(6, 2, generator=g) ** 2 * ROWS).long()
    bag_ids = torch.randint(0, BAG_ROWS, (12,), generator=g)
    target = 20 * torch.rand(6, generator=g)
    return F.mse_loss(model(ids, other_ids, bag_ids, torch.arange(0, 12, 2)), target)


def clip_norm(model, foreach=None):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach)


def clip_value(model, foreach=None):
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.05, foreach=foreach)


def clip_inf_norm(model, foreach=None):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type="inf", foreach=foreach)


def two_halves_averaged(model, step):
    """Gradient accumulation: a second backward adds to the first; the sum halved, then clipped."""
    loss_of(model, step + 100).backward()
    for param in model.parameters():
        param.grad /= 2
    return clip_norm(model)


def compare(local_cluster, clip, steps=4, **trainer_args):
    """``steps`` steps of backward, ``clip(model, step)``, step: the tables' rows and every norm
    equal one process's with dense embeddings (the same clipping, torch.optim.SGD)."""
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = Model(sparse=True), Model(sparse=False)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.05), **trainer_args) as trainer:
        assert {s.variable for s in trainer.placement.shards if s.table} == set(TABLES)
        for step in range(steps):
            optimizer.zero_grad()
            loss_of(model, step).backward()
            loss_of(reference, step).backward()
            assert isinstance(model.emb.weight.grad, RowGradient)
            ours, theirs = clip(model, step), clip(reference, step)
            if ours is not None:
                torch.testing.assert_close(ours, theirs)
            trainer.step()
            optimizer.step()
        with torch.no_grad():  # every row into the local weights
            model.emb(torch.arange(ROWS).unsqueeze(0))
            model.bag(torch.arange(BAG_ROWS), torch.tensor([0]))
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("clip", [clip_norm, clip_value, clip_inf_norm], ids=["norm", "value", "inf-norm"])
def test_clipping_with_tables_is_one_process_clipping_dense_embeddings(local_cluster, clip, foreach):
    compare(local_cluster, lambda model, step: clip(model, foreach))


def test_clipping_moves_the_rows_pushed(local_cluster):
    """Without the rows in the norm and the scaling, these runs differ (the test can fail)."""
    cluster = local_cluster(num_ps=1, num_workers=1)
    model, reference = Model(sparse=True), Model(sparse=False)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.05)):
        loss_of(model, 0).backward()
        loss_of(reference, 0).backward()
        dense_only = torch.nn.utils.clip_grad_norm_([reference.head.weight, reference.head.bias], 0.5)
        assert not torch.allclose(clip_norm(model), dense_only)


def test_accumulated_gradients_are_scaled_and_clipped_as_one_process(local_cluster):
    compare(local_cluster, two_halves_averaged)


def test_gradients_set_to_none_are_dropped_with_the_tables_rows(local_cluster):
    """``zero_grad()`` between two backwards (a bad micro-batch skipped) drops the first's rows."""

    def drop_then_again(model, step):
        model.zero_grad()
        loss_of(model, step + 100).backward()
        return clip_norm(model)

    compare(local_cluster, drop_then_again, steps=3)


def test_clipping_in_sync_training(local_cluster):
    compare(
        local_cluster,
        lambda model, step: clip_norm(model),
        steps=3,
        sync=psframe.SyncReplicas(replicas_to_aggregate=1),
    )


def test_what_cannot_act_on_the_rows_alone_fails_loudly_and_changes_nothing(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = Model(sparse=True)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.05)) as trainer:
        loss_of(model, 0).backward()
        grad = model.emb.weight.grad
        before = grad.to_sparse().to_dense().clone()
        for act in (
            lambda: grad.add_(1.0),
            lambda: grad.clamp_(min=0.01),  # would move the rows not looked up too
            lambda: grad.norm(dim=1),
            lambda: grad.sum(),
            lambda: grad.mul_(torch.ones(ROWS, DIM)),
            lambda: torch.ones(ROWS, DIM).mul_(grad),
            lambda: torch._foreach_mul_([torch.ones(ROWS, DIM)], [grad]),
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=-1.0),
        ):
            with pytest.raises(InvalidGradientError, match="emb.weight"):
                act()
        assert torch.equal(grad.to_sparse().to_dense(), before)
        assert "rows=" in repr(grad) and "emb.weight" in repr(grad)
        trainer.step()  # the rows as they were
        assert model.emb.weight.grad is None


def test_a_model_holding_table_gradients_copies_and_saves_as_the_users(local_cluster):
    """A copy holds the sparse gradient ``nn.Embedding(sparse=True)`` has in one process."""
    cluster = local_cluster(num_ps=1, num_workers=1)
    model, alone = Model(sparse=True), Model(sparse=True)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.05)) as trainer:
        loss_of(model, 0).backward()
        loss_of(alone, 0).backward()
        copied = copy.deepcopy(model)
        torch.save(model, io.BytesIO())
        alone_copied = copy.deepcopy(alone)
        for name in ("emb", "bag"):
            # A copied parameter has no gradient, in one process as here.
            assert getattr(copied, name).weight.grad is None is getattr(alone_copied, name).weight.grad
            ours, theirs = copy.deepcopy(getattr(model, name).weight.grad), getattr(alone, name).weight.grad
            assert ours.is_sparse
            torch.testing.assert_close(ours.to_dense(), theirs.to_dense())
        trainer.step()


def test_a_step_whose_gradients_a_hook_dropped_pushes_no_rows(local_cluster):
    """``NanGuardHook(fail_on_nan=False)`` sets every grad to None: the tables' rows go too."""
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = Model(sparse=True)
    hooks = [psframe.hooks.NanGuardHook(fail_on_nan=False)]
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.05), hooks=hooks) as trainer:
        before = trainer.global_step
        trainer.step(loss_of(model, 0) * float("nan"))
        assert trainer.global_step == before and trainer.stats.skipped_steps == 1
        trainer.pull()
        with torch.no_grad():
            model.emb(torch.arange(ROWS).unsqueeze(0))
        assert torch.isfinite(model.emb.weight).all() and torch.equal(model.emb.weight, Model(sparse=True).emb.weight)
