"""In-graph replication: one worker process drives several replicas (``Trainer(replica_devices=...)``).

Oracles: synchronous training pushes the replicas' mean gradient once (the
values equal one SGD step on it, bit for bit); asynchronous training pushes
each replica's gradient as a step of its own (two global steps, each
applied in turn); every replica holds the ps tasks' values after a step.

This file holds the cluster tier's tests of the subject; `tests/service/test_in_graph.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest


@pytest.mark.cluster
def test_the_in_graph_benchmark_runs_each_way(capsys):
    from benchmarks.children import forked_children
    from benchmarks.experiments import in_graph

    with forked_children():  # its ps task and workers forked from one process that imported psframe once
        assert in_graph.main(["--runs", "1", "--steps", "40", "--batch", "20"]) == 0
    rows = capsys.readouterr().out.splitlines()[-3:]
    assert [row.split()[0] for row in rows] == ["one", "between-graph", "in-graph"]
    assert all(float(row.split()[-1]) > 0 for row in rows)  # CPU ms a global step
