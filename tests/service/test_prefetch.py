"""Trainer.prefetch: the next batch's rows travel behind a step's messages, and training is
the same as when every lookup pulls its own rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.errors import RowIdError, WireFormatError
from psframe.worker.client import control_calls
from tests.service.test_tables import ROWS, Recommender, batch, local_step, pull_every_row

STEPS = 6
DIM = 4


class Clicks(torch.nn.Module):
    """A fixed table of items and a dynamic table of users, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = torch.nn.Embedding(200, DIM, sparse=True)
        self.users = psframe.DynamicEmbedding(DIM, initializer=psframe.RowInitializer(std=0.1, seed=3))
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.items(items).mean(1), self.users(users).mean(1)], 1)).squeeze(1)


def click_batch(step: int):
    """Power-law ids: a few in every batch, most rare."""
    g = torch.Generator().manual_seed(step)
    items = (torch.rand(16, 4, generator=g) ** 4 * 200).long()
    users = (torch.rand(16, 2, generator=g) ** 4 * 500).long() * 7919
    return items, users, torch.rand(16, generator=g)


def counting_pulls(trainer: psframe.Trainer) -> list[int]:
    """Record the rows of every pull a lookup makes (not the prefetches, which ride on steps)."""
    pulled: list[int] = []
    pull_rows = trainer._session.client.pull_rows

    def counting(wanted, step, create=True):
        pulled.append(sum(int(ids.numel()) for pulls in wanted.values() for _, ids in pulls))
        return pull_rows(wanted, step, create)

    trainer._session.client.pull_rows = counting
    return pulled


def reference_optimizers(reference: Recommender, optimizer: type[torch.optim.Optimizer]):
    """The one-process reference's optimizers (lr 0.1): the dense head's, and the tables'."""
    head = optimizer([reference.head.weight, reference.head.bias], lr=0.1)
    return head, optimizer([reference.emb.weight, reference.bag.weight], lr=0.1)


def prefetching_step(trainer: psframe.Trainer, model: Recommender, step: int) -> None:
    """Step ``step`` of the Recommender, with the next step's lookups prefetched."""
    ids, bag_ids, offsets, target = batch(step)
    loss = F.mse_loss(model(ids, bag_ids, offsets), target)
    next_ids, next_bag_ids, _, _ = batch(step + 1)
    trainer.prefetch(model.emb, next_ids)
    trainer.prefetch(model.bag, next_bag_ids)
    trainer.step(loss)


@pytest.mark.parametrize("partition", ["mod", "range"])
def test_prefetched_lookups_pull_nothing_and_train_as_one_process(local_cluster, partition):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = Recommender(), Recommender()
    dense_opt, table_opt = reference_optimizers(reference, torch.optim.Adagrad)
    with psframe.Trainer(
        model, cluster, optimizer=psframe.optim.Adagrad(lr=0.1), placement=psframe.Placement(table_partition=partition)
    ) as trainer:
        pulled = counting_pulls(trainer)
        for step in range(STEPS):
            prefetching_step(trainer, model, step)
            local_step(reference, dense_opt, table_opt, step)
        assert len(pulled) == 2  # the first step's two lookups; every later one was prefetched
        pull_every_row(model)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs"


def test_a_lookup_of_other_ids_pulls_its_own_rows(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = Recommender(), Recommender()
    dense_opt, table_opt = reference_optimizers(reference, torch.optim.SGD)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1)) as trainer:
        pulled = counting_pulls(trainer)
        for step in range(3):
            ids, bag_ids, offsets, target = batch(step)
            loss = F.mse_loss(model(ids, bag_ids, offsets), target)
            trainer.prefetch(model.emb, batch(step + 7)[0])  # not what the next step looks up
            trainer.step(loss)
            local_step(reference, dense_opt, table_opt, step)
        assert len(pulled) == 6  # both tables pulled at every step
        pull_every_row(model)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs"


def test_n_sync_workers_with_prefetch_equal_the_same_run_without(local_cluster):
    from tests.service.test_sync import connect_all, run_workers

    num_workers = 2
    results = {}
    for prefetch in (False, True):
        cluster = local_cluster(num_ps=2, num_workers=num_workers)
        models = {i: Recommender() for i in range(num_workers)}
        trainers = {
            i: psframe.Trainer(
                models[i],
                cluster,
                task_index=i,
                optimizer=psframe.optim.Adagrad(lr=0.2),
                sync=psframe.SyncReplicas(timeout=30),
            )
            for i in range(num_workers)
        }
        connect_all(trainers)

        def train(i, prefetch=prefetch, models=models, trainers=trainers):
            for step in range(STEPS):
                ids, bag_ids, offsets, target = batch(step * num_workers + i)
                loss = F.mse_loss(models[i](ids, bag_ids, offsets), target)
                if prefetch:
                    next_ids, next_bag_ids, _, _ = batch((step + 1) * num_workers + i)
                    trainers[i].prefetch(models[i].emb, next_ids)
                    trainers[i].prefetch(models[i].bag, next_bag_ids)
                trainers[i].step(loss)
            return trainers[i].global_step

        assert run_workers({i: (lambda i=i: train(i)) for i in range(num_workers)}) == dict.fromkeys(
            range(num_workers), STEPS
        )
        pull_every_row(models[0])
        results[prefetch] = {name: p.detach().clone() for name, p in models[0].named_parameters()}
        run_workers({i: trainers[i].close for i in range(num_workers)})
    for name, value in results[False].items():
        assert torch.equal(results[True][name], value), f"{name} differs"


def test_bad_prefetches_are_refused_and_nothing_is_sent(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Recommender()
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1)) as trainer:
        with pytest.raises(TypeError, match="Linear is not an embedding table of the model"):
            trainer.prefetch(model.head, torch.tensor([0]))
        with pytest.raises(TypeError, match="tensor of ids"):
            trainer.prefetch(model.emb, [0, 1])
        for bad in (ROWS, -1):
            with pytest.raises(RowIdError, match=f"id {bad} .*'emb.weight'"):
                trainer.prefetch(model.emb, torch.tensor([0, bad]))
        assert not trainer._prefetcher  # nothing pending: the next step sends no pull
        before = [control_calls.get_info(trainer._session.client, k).applied_steps for k in range(2)]
        trainer.pull()
        assert [control_calls.get_info(trainer._session.client, k).applied_steps for k in range(2)] == before


def test_a_prefetch_behind_a_request_sent_again_goes_again_behind_it(local_cluster):
    """A ps task that cannot map a request's region answers it with nothing applied, and the
    worker sends it again, behind the prefetch that followed it: the rows that prefetch read
    predate the push, so it is sent again behind the push, and no lookup has to pull. (Synchronous
    training, where the pulls follow the step in a message of their own; one ps task, and the
    head's weight and bias in two messages, so that the one that carries no rows lies in a region.)"""
    cluster = local_cluster(num_ps=1, num_workers=1)
    model, reference = Recommender(), Recommender()
    dense_opt, table_opt = reference_optimizers(reference, torch.optim.Adagrad)
    with psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.Adagrad(lr=0.1),
        sync=psframe.SyncReplicas(timeout=30),
        placement=psframe.Placement(max_shard_bytes=model.head.weight.nbytes),
        transport=psframe.Transport(same_host_memory=True),
    ) as trainer:
        pulled = counting_pulls(trainer)
        streams = trainer._session.client._streams
        for step in range(STEPS):
            if step == 3:
                assert any(p.in_region for p in streams.encoder.prepared.values())
                # New streams, as if another process of the task answered: the regions the
                # requests lie in were unlinked once taken, so the ps task cannot map them.
                for stream in streams._streams.values():
                    stream.close()
                streams._streams.clear()
            prefetching_step(trainer, model, step)
            local_step(reference, dense_opt, table_opt, step)
        assert len(pulled) == 2  # the first step's lookups; the prefetch sent again behind the push
        pull_every_row(model)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs"


def test_asynchronous_prefetches_ride_in_the_message_that_ends_the_step(local_cluster):
    """Async: each ps task gets one message a step (its rows' gradients, its dense request, the
    next rows' pull), and training is still exactly one process's."""
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = Recommender(), Recommender()
    dense_opt, table_opt = reference_optimizers(reference, torch.optim.Adagrad)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.Adagrad(lr=0.1)) as trainer:
        pulled = counting_pulls(trainer)
        streams = trainer._session.client._streams
        sent: list[int] = []
        exchange = streams.exchange

        def counting_exchange(operations, *args, **kwargs):
            sent.append(len(operations))
            return exchange(operations, *args, **kwargs)

        streams.exchange = counting_exchange
        for step in range(STEPS):
            prefetching_step(trainer, model, step)
            local_step(reference, dense_opt, table_opt, step)
        assert len(pulled) == 2  # the first step's two lookups
        steps = sent[2:]  # after the first step's two lookups: one message per ps task per step
        assert steps == [2] * STEPS, sent
        # Rows pulled count the prefetched ones: every step's distinct ids, and the next's.
        distinct = sum(torch.unique(batch(step)[k]).numel() for step in range(STEPS + 1) for k in (0, 1))
        assert trainer.stats.rows_pulled == distinct
        pull_every_row(model)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs"


def test_a_dynamic_table_s_prefetched_lookups_pull_nothing_and_train_as_without(local_cluster):
    def run(prefetch: bool):
        model = Clicks()
        with psframe.Trainer(
            model,
            local_cluster(num_ps=2),
            optimizer=psframe.optim.SGD(lr=0.1),
            table_optimizer=psframe.optim.Adagrad(lr=0.1),
        ) as trainer:
            pulled = counting_pulls(trainer)
            for step in range(STEPS):
                items, users, target = click_batch(step)
                loss = F.mse_loss(model(items, users), target)
                if prefetch:
                    next_items, next_users, _ = click_batch(step + 1)
                    trainer.prefetch(model.items, next_items)
                    trainer.prefetch(model.users, next_users)
                trainer.step(loss)
            model.eval()
            with torch.no_grad():
                rows = model.users(torch.arange(500) * 7919), model.items(torch.arange(200))
            return [p.detach().clone() for p in model.parameters()], rows, len(pulled)

    plain, plain_rows, plain_pulls = run(False)
    prefetched, prefetched_rows, pulls = run(True)
    assert plain_pulls == 2 * STEPS + 2 and pulls == 2 + 2  # the first step's lookups, and the evaluation's
    assert all(torch.equal(a, b) for a, b in zip(prefetched, plain))
    assert all(torch.equal(a, b) for a, b in zip(prefetched_rows, plain_rows))


def test_a_synchronous_push_that_asks_for_rows_is_refused_naming_the_table(local_cluster):
    """A round's replies are one encoding for every member: a synchronous push that also asks
    for rows is refused with the table's name, and nothing is applied."""
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = Recommender()
    with psframe.Trainer(
        model, cluster, optimizer=psframe.optim.SGD(lr=0.1), sync=psframe.SyncReplicas(timeout=30)
    ) as trainer:
        ids, bag_ids, offsets, target = batch(0)
        F.mse_loss(model(ids, bag_ids, offsets), target).backward()
        requests = [(r, trainer._session.replica.gradients(r)) for r in trainer._session.replica.plan.step]
        rows = trainer._session.replica.tables.gradients(every_table=True)
        part = rows[0][0][0]
        with pytest.raises(WireFormatError, match=f"synchronous push asked for rows of '{part}'"):
            trainer._session.client.push_pull_and_prefetch(
                requests, trainer.global_step, {0: [(part, torch.tensor([0]))]}, rows=rows, pulls_with_pushes=True
            )
        info = control_calls.get_info(trainer._session.client, 0)
        assert (info.applied_steps, info.global_step) == (0, 0)
