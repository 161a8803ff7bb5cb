"""A push is applied exactly once: sent again after a lost reply, it is answered, not applied twice.

Units (no network): the ledger, the ps service's answers to a push sent
again (asynchronous, on both its paths, and synchronous), the in-order rule
for pushes refused for their shared region, the worker's numbering, the
ledger in a checkpoint. Then a real worker and ps task with a TCP proxy
between them that swallows the replies of a step and then drops the
connection: the worker reconnects, sends the step again, and the oracle is
exact (SGD with a known gradient) with the ps's count of applied steps equal
to the worker's acknowledged steps.

This file holds the service tier's tests of the subject; `tests/unit/test_exactly_once.py`,
`tests/cluster/test_exactly_once.py` hold the other tiers'.
"""

from __future__ import annotations

import torch

import psframe


def test_a_worker_started_again_numbers_its_pushes_above_its_earlier_runs(local_cluster):
    """A new process of worker 0 starts numbering at 1; the ps remembers the old run's
    numbers: the new run's pushes must still be applied, each once."""
    from psframe.cluster.placement import Shard
    from psframe.worker.client import control_calls
    from psframe.worker.client.ps_client import PsClient
    from psframe.worker.plan.step_plan import Request, Slot

    cluster = local_cluster(num_ps=1, num_workers=1)
    start = torch.zeros(4)
    slot = Slot(Shard("w", "w", 0, 0, 4, (4,), start.nbytes), start)
    push = Request(0, (slot,), (slot,), True)
    runs = []
    for run in range(2):
        with PsClient(cluster, 0, rpc_timeout=30.0) as client:
            control_calls.wait_for_ps(client, 30.0)
            if run == 0:
                control_calls.create(client, 0, [slot], [("w", start)], psframe.optim.SGD(lr=0.5), None, None)
            replies = [client.push_pull([(push, [("w", torch.ones(4))])], step=0)[0] for _ in range(3)]
            runs.append([r.duplicate for r in replies])
            last = replies[-1].values[0].clone()
    assert runs == [[False] * 3, [False] * 3]
    assert last.tolist() == [-3.0] * 4  # six pushes of 0.5 each
