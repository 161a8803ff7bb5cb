"""A live re-layout: ps tasks added and drained while workers train (:mod:`psframe.ps.elastic.relayout`).

Unit tests of the parts (which clusters may follow which, the shard record on
the wire), then ps tasks in this process with workers in threads: a ps task is
added (asked from outside, as ``psframe reshard`` does) and later drained, and
the values equal the known-gradient arithmetic exactly: every step applied
once, the optimizer state moved with its rows.

This file holds the cluster tier's tests of the subject; `tests/unit/test_relayout.py`,
`tests/service/test_relayout.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest


@pytest.mark.cluster
def test_the_pause_experiment_runs_and_prints_each_size(capsys):
    from benchmarks.children import forked_children
    from benchmarks.experiments import relayout_pause

    with forked_children():  # every ps task forked from one process that imported psframe once
        for size, model in (
            ("1", ["--model", "dense"]),
            ("2", ["--model", "dense", "--dense_parts", "4"]),  # partitioned (above 1 MiB): 4 fixed parts
            ("1", ["--model", "table", "--table_parts", "4"]),
        ):
            assert relayout_pause.main(["--sizes", size, "--runs", "1", *model]) == 0
            row = capsys.readouterr().out.splitlines()[-1].split()
            assert row[0] == f"{size}MB" and all(float(cell.rstrip("x")) > 0 for cell in row[1:]), row
