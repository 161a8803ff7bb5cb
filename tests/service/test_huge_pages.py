"""Large tensors of a ps task and of a worker's tables are advised onto transparent huge pages.

What the advice leaves is read from ``/proc/self/smaps``: the mapping that
holds a tensor says ``THPeligible: 1`` once it is advised (in the kernel's
``madvise`` mode, a mapping is eligible only then). Whether the kernel then
found free huge pages is its business, so no test counts them.

This file holds the service tier's tests of the subject; `tests/unit/test_huge_pages.py`,
`tests/cluster/test_huge_pages.py` hold the other tiers'.
"""

from __future__ import annotations

import torch

import psframe
from tests.unit.test_huge_pages import ROWS, eligible, fresh_settings, needs_madvise_mode  # noqa: F401


@needs_madvise_mode
def test_a_worker_keeps_a_large_tables_local_weight_on_huge_pages(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(ROWS, 64, mode="sum", sparse=True), torch.nn.Linear(64, 1))
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.Adagrad(lr=0.1)) as trainer:
        assert eligible(model[0].weight)
        trainer.step(model(torch.tensor([[1, 2], [3, ROWS - 1]])).sum())
