"""Embedding tables through the ps tasks: only the rows a batch uses travel, and the
result is one process's, optimizer by optimizer.

This file holds the unit tier's tests of the subject; `tests/service/test_tables.py` holds the other
tiers'.
"""

from __future__ import annotations

import torch

import psframe
from psframe.optim.rows_kernels import SparseSGD
from tests.service.test_tables import Recommender, loss_of, pull_every_row


def test_a_second_worker_pulls_the_rows_the_first_updated(in_process_cluster):
    cluster = in_process_cluster(num_ps=2, num_workers=2).cluster
    chief_model, other_model = Recommender(seed=0), Recommender(seed=1)
    with psframe.Trainer(chief_model, cluster, task_index=0, optimizer=psframe.optim.Adagrad(lr=0.5)) as chief:
        with psframe.Trainer(other_model, cluster, task_index=1, optimizer=psframe.optim.Adagrad(lr=0.5)) as other:
            chief.step(loss_of(chief_model, 0))
            other.pull()
            pull_every_row(chief_model)
            pull_every_row(other_model)
            for (name, p), q in zip(chief_model.named_parameters(), other_model.parameters()):
                assert torch.equal(p, q), name


def test_sparse_sgd_is_torch_sgd_when_every_row_is_touched():
    torch.manual_seed(0)
    a = torch.randn(5, 3, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    lazy = SparseSGD([a], lr=0.1, momentum=0.9, nesterov=True)
    dense = torch.optim.SGD([b], lr=0.1, momentum=0.9, nesterov=True)
    for _ in range(4):
        grad = torch.randn(5, 3)
        a.grad = grad.to_sparse(sparse_dim=1)
        b.grad = grad.clone()
        lazy.step()
        dense.step()
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_sparse_sgd_leaves_untouched_rows_and_their_momentum_alone():
    table = torch.zeros(4, 2, requires_grad=True)
    opt = SparseSGD([table], lr=1.0, momentum=0.5)
    table.grad = torch.sparse_coo_tensor([[0, 1]], torch.ones(2, 2), (4, 2))
    opt.step()
    table.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 2), (4, 2))
    opt.step()
    # Row 0 moved once (m=1), row 1 twice (m=1, then 1.5); rows 2, 3 never.
    assert torch.equal(table.detach()[:, 0], torch.tensor([-1.0, -2.5, 0.0, 0.0]))
    assert torch.equal(opt.state[table]["momentum_buffer"][:, 0], torch.tensor([1.0, 1.5, 0.0, 0.0]))


def test_mod_spreads_a_frequency_sorted_vocabulary_where_range_does_not():
    from benchmarks.suite.sparse import partition_balance

    imbalance = {
        (r["numbering"], r["partition"], r["num_ps"]): r["imbalance"]
        for r in partition_balance(rows=10**5, ps_counts=(4,), batches_drawn=4)
    }
    # Hot ids first: range puts them all on the first part; mod deals them out.
    assert imbalance[("frequency-sorted", "mod", 4)] < 1.25 < 2.5 < imbalance[("frequency-sorted", "range", 4)]
    assert imbalance[("hashed", "range", 4)] < 1.25  # hashed ids are spread either way
