"""A push is applied exactly once: sent again after a lost reply, it is answered, not applied twice.

Units (no network): the ledger, the ps service's answers to a push sent
again (asynchronous, on both its paths, and synchronous), the in-order rule
for pushes refused for their shared region, the worker's numbering, the
ledger in a checkpoint. Then a real worker and ps task with a TCP proxy
between them that swallows the replies of a step and then drops the
connection: the worker reconnects, sends the step again, and the oracle is
exact (SGD with a known gradient) with the ps's count of applied steps equal
to the worker's acknowledged steps.

This file holds the cluster tier's tests of the subject; `tests/unit/test_exactly_once.py`,
`tests/service/test_exactly_once.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.launch import pick_free_ports
from tests.unit.test_exactly_once import LoseRepliesAt, ReplySwallowingProxy


@pytest.mark.cluster
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_steps_whose_replies_were_lost_are_applied_exactly_once(sync):
    ps_port, worker_port = pick_free_ports(2)
    proxy = ReplySwallowingProxy(("127.0.0.1", ps_port))
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{proxy.port}"], "worker": [f"127.0.0.1:{worker_port}"]})
    server = psframe.Server(cluster, "ps", 0, bind_address=f"127.0.0.1:{ps_port}", serving_processes=1)
    try:
        model = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        steps, lost = 12, {3, 7, 8}
        trainer = psframe.Trainer(
            model,
            cluster,
            optimizer=psframe.optim.SGD(lr=0.25),
            sync=psframe.SyncReplicas(1, 1, timeout=30.0) if sync else None,
            hooks=[LoseRepliesAt(proxy, lost)],
            transport=psframe.Transport(connect_timeout=30.0, same_host_memory=False),
        )
        x = torch.ones(1, 4)
        with trainer:
            for _ in range(steps):
                trainer.step(model(x).sum())  # the gradient is 1 everywhere, every step
            assert trainer.stats.recoveries == len(lost)
            assert trainer.stats.pushed_steps == steps
            info = server.service.info()
            assert info.workers[0].applied_steps == steps  # each step once, however often sent
            assert info.global_step == steps
            trainer.pull()
            assert model.weight.detach().tolist() == [[-0.25 * steps] * 4]  # exact: powers of two
    finally:
        server.stop(grace=0.1)
        proxy.close()
