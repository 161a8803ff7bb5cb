"""The driver side of psframe on Spark: :func:`run` starts a cluster in one barrier stage.

One call goes through these states::

    SUBMITTED -> every task gathered -> main_fun in each task -> chief returned -> run returns its result
              -> a task failed       -> Spark kills the stage's other tasks and runs the stage again
                                        (spark.stage.maxConsecutiveAttempts in all) -> SparkJobError
              -> timeout expired     -> the job is cancelled -> SparkJobError

The barrier stage writes its output through a shuffle (it is a shuffle map
stage), because Spark retries a failed barrier shuffle map stage whole but
never a failed barrier result stage.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

from psframe.errors import SparkJobError
from psframe.spark.node import NodeContext, run_node, task_of_partition

_LOCAL_MASTER = re.compile(r"^local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?$")
# "barrier task ShuffleMapTask(<stage>, <partition>) finished unsuccessfully"
_FAILED_TASK = re.compile(r"barrier task \w*Task\(\d+, (\d+)\)")
_JAVA_FRAME = re.compile(r"^\s+at [\w$.<>/]+\(.*\)\s*$|^\s*\.\.\. \d+ more\s*$")
_MAX_REASON_LINES = 60


def _check_count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def local_slots(master: str, task_cpus: int = 1) -> int | None:
    """How many barrier tasks a local master runs at once (None: not a local master)."""
    match = _LOCAL_MASTER.match(master.strip())
    if match is None:
        return None
    threads = match.group(1)
    cores = 1 if threads is None else (os.cpu_count() or 1) if threads == "*" else int(threads)
    return cores // max(1, task_cpus)


def _task_names(num_ps: int, num_workers: int) -> str:
    return ", ".join(f"{p}={''.join(map(str, task_of_partition(p, num_ps)))}" for p in range(num_ps + num_workers))


def explain_failure(error: BaseException, num_ps: int, num_workers: int) -> str:
    """Spark's reason for a failed job without its Java stack frames, naming the psframe task
    of each barrier task it mentions."""
    java = getattr(error, "java_exception", None)
    text = str(java.toString()) if java is not None else str(error)
    lines = [line for line in text.splitlines() if line.strip() and not _JAVA_FRAME.match(line)]
    if len(lines) > _MAX_REASON_LINES:
        lines = lines[:_MAX_REASON_LINES] + [f"... ({len(lines) - _MAX_REASON_LINES} more lines)"]
    partitions = sorted({int(p) for p in _FAILED_TASK.findall(text)})
    named = [
        f"partition {p} is {''.join(map(str, task_of_partition(p, num_ps)))}"
        for p in partitions
        if p < num_ps + num_workers
    ]
    where = f" ({'; '.join(named)})" if named else ""
    if "Python worker exited unexpectedly" in text:
        lines.append(
            "(the task's Python process died: killed by a signal, out of memory, or exited; "
            "the executor's log says more)"
        )
    return f"the Spark job of the psframe cluster failed{where}:\n" + "\n".join(lines)


def _assign_to_workers(input_data: Any, num_ps: int, num_workers: int):
    """An RDD of ``num_ps + num_workers`` partitions: empty ones for the ps tasks, then each
    worker's share of ``input_data``'s records, dealt round robin within each input partition."""
    rdd = getattr(input_data, "rdd", input_data)  # a DataFrame gives its rows
    total = num_ps + num_workers

    def keyed(index: int, records):
        for j, record in enumerate(records):
            yield num_ps + (index + j) % num_workers, record

    return rdd.mapPartitionsWithIndex(keyed).partitionBy(total, lambda key: key).values()


def run(
    sc: Any,
    main_fun: Callable[[Any, NodeContext], Any],
    args: Any = None,
    num_ps: int = 1,
    num_workers: int = 2,
    *,
    input_data: Any = None,
    host: str | None = None,
    timeout: float | None = None,
) -> Any:
    """Run a psframe cluster as one Spark barrier stage and return the chief's result.

    Spark starts ``num_ps + num_workers`` tasks at once; each picks a free port
    on its host, they exchange addresses, and each calls ``main_fun(args, ctx)``
    with a :class:`NodeContext` naming its task (ps tasks first). A ps task's
    ``main_fun`` typically serves until training is over::

        def main_fun(args, ctx):
            if ctx.job_name == "ps":
                psframe.Server(ctx.cluster, "ps", ctx.task_index,
                               checkpoint_dir=args.checkpoint_dir).join()
                return None
            trainer = psframe.Trainer(model, ctx.cluster, task_index=ctx.task_index,
                                      checkpointing=psframe.Checkpointing(args.checkpoint_dir), ...)
            ...
            return {"global_step": trainer.global_step}     # the chief's comes back

        result = psframe.spark.run(spark.sparkContext, main_fun, args, num_ps=1, num_workers=2)

    Input comes either from Spark (``input_data``: each worker's ``ctx.input``
    iterates over its share of the records, TensorFlowOnSpark's
    ``InputMode.SPARK``) or from files each worker reads itself
    (``ctx.shard(paths)`` gives its share of a list; fsspec reads any URL).

    When a task fails (an exception in ``main_fun``, a crashed or killed
    process), Spark kills the other tasks of the stage and starts all of them
    again, up to ``spark.stage.maxConsecutiveAttempts`` (4 by default) times
    in all: give the ps tasks a ``checkpoint_dir`` and the trainer the same
    folder (``checkpointing=psframe.Checkpointing(dir)``) so that a new
    attempt resumes from the latest checkpoint instead of step 0. The
    address exchange waits at most ``spark.barrier.sync.timeout``; psframe's
    own waits have their deadlines (``psframe.Transport(connect_timeout=...)``...).

    Only Spark's public API is used, so any master works (local, standalone,
    YARN, Kubernetes), given ``num_ps + num_workers`` task slots at once
    (a barrier stage starts all its tasks together; Spark refuses it under
    dynamic allocation) and psframe installed where the executors run Python.

    Args:
        sc: a ``SparkContext`` (or a ``SparkSession``).
        main_fun: ``main_fun(args, ctx)``, run in every task; it and ``args``
            are pickled to the executors. The chief's return value must pickle.
        args: anything picklable, passed through (e.g. an ``argparse.Namespace``).
        num_ps: ps tasks (>= 1).
        num_workers: worker tasks (>= 1); worker 0 is the chief.
        input_data: an RDD or DataFrame whose records are dealt to the
            workers (through a shuffle), or None.
        host: the address every task serves on (e.g. ``"127.0.0.1"`` when all
            run on this machine); None: each task's executor host as Spark knows it.
        timeout: seconds after which the Spark job is cancelled; None: no limit.

    Returns:
        What ``main_fun`` returned in the chief (worker 0).

    Raises:
        ValueError: bad counts, or more tasks than a local master's slots.
        SparkJobError: the job failed (the message has Spark's reason and the
            failing task's Python traceback) or timed out.
    """
    sc = getattr(sc, "sparkContext", sc)
    _check_count("num_ps", num_ps, 1)
    _check_count("num_workers", num_workers, 1)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    total = num_ps + num_workers
    slots = local_slots(sc.master, int(sc.getConf().get("spark.task.cpus", "1")))
    if slots is not None and slots < total:
        # Spark would retry the slot check for minutes before failing.
        raise ValueError(
            f"a cluster of {num_ps} ps + {num_workers} workers needs {total} task slots at once; "
            f"master {sc.master!r} has {slots}: use local[{total}] or more"
        )
    if input_data is None:
        nodes = sc.parallelize(range(total), total)
    else:
        nodes = _assign_to_workers(input_data, num_ps, num_workers)
    body = functools.partial(run_node, main_fun, args, num_ps, host, input_data is not None)
    results = nodes.barrier().mapPartitions(body).partitionBy(1).values()

    tag = f"psframe-{uuid.uuid4().hex}"
    done, timed_out = threading.Event(), threading.Event()

    def watchdog() -> None:
        if done.wait(timeout):
            return
        timed_out.set()
        while not done.is_set():  # again, in case the job was not submitted yet
            sc.cancelJobsWithTag(tag)
            done.wait(1.0)

    sc.addJobTag(tag)
    if timeout is not None:
        threading.Thread(target=watchdog, name="psframe-spark-timeout", daemon=True).start()
    try:
        collected = results.collect()
    except Exception as e:
        if timed_out.is_set():
            raise SparkJobError(
                f"the psframe cluster ({num_ps} ps + {num_workers} workers) did not finish "
                f"within {timeout}s; its Spark job was cancelled"
            ) from e
        raise SparkJobError(explain_failure(e, num_ps, num_workers)) from e
    finally:
        done.set()
        sc.removeJobTag(tag)
    if len(collected) != 1:
        raise SparkJobError(
            f"expected the chief's result from the Spark job, got {len(collected)} results "
            f"(tasks by partition: {_task_names(num_ps, num_workers)})"
        )
    return collected[0]


__all__ = ["SparkJobError", "run"]
