"""psframe.ray: a psframe cluster as Ray actors, on a local Ray instance bound to loopback.

This file holds the engines tier's tests of the subject; `tests/unit/test_ray.py` holds the other
tiers'.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

import psframe
from psframe.ray import RayRunError, run
from tests.conftest import ROOT
from tests.support import ray_tasks

NUM_CPUS = 4


RAY_START_ATTEMPTS = 3
RAY_LOGS_TO_SHOW = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err", "dashboard_agent.log")


def start_local_ray(ray, temp_dir: str) -> None:
    ray.init(
        num_cpus=NUM_CPUS,
        include_dashboard=False,
        object_store_memory=100 * 1024 * 1024,
        _temp_dir=temp_dir,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'examples'}", "OMP_NUM_THREADS": "1"}},
    )


def tail_of_ray_logs(temp_dir: str, lines: int = 15) -> str:
    """The last lines of the logs that say why a local Ray node did not come up."""
    logs = Path(temp_dir) / "session_latest" / "logs"
    parts = []
    for name in RAY_LOGS_TO_SHOW:
        path = logs / name
        if path.is_file():
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {name}\n" + "\n".join(text))
    return "\n".join(parts) or f"(no Ray logs under {logs})"


def kill_daemons_of(temp_dir: str) -> None:
    """Kill the daemons a failed start left: ray.init raised before it kept the node, so
    ray.shutdown() does not know them. They are this run's: their command lines name its directory."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if temp_dir.encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone already, or not ours to read


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module: 4 logical CPUs, a small object store, every daemon on loopback.

    Ray gives its raylet a fixed 30 s to register with its GCS; on a loaded machine that can run out,
    so a start that times out is tried again in a fresh directory, and the last failure shows the logs.
    """
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")}
    # Read when ray is imported: Ray then takes 127.0.0.1 as the node's address (its default on
    # macOS and Windows) and its daemons listen there instead of on every interface.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        ray = pytest.importorskip("ray")
        temp_dir = start_with_retries(ray)
        try:
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_with_retries(ray) -> str:
    """Start a local Ray, trying again after a failed start; returns its directory."""
    failures = []
    for attempt in range(RAY_START_ATTEMPTS):
        temp_dir = tempfile.mkdtemp(prefix="psray-")  # short: Ray's socket paths live under it
        try:
            start_local_ray(ray, temp_dir)
            return temp_dir
        except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception when its node does not come up
            failures.append(f"attempt {attempt + 1}: {error}\n{tail_of_ray_logs(temp_dir)}")
            ray.shutdown()
            kill_daemons_of(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)
    pytest.fail("a local Ray did not start:\n" + "\n".join(failures))


def wait_until_released(ray, timeout: float = 30.0) -> None:
    """Every CPU is free again: the run's actors were stopped and its placement group removed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) == NUM_CPUS:
            return
        time.sleep(0.2)
    pytest.fail(f"the run left resources taken: {ray.available_resources()}")


# ---------------------------------------------------------------- no Ray needed


# ---------------------------------------------------------------- on a local Ray


@pytest.mark.ray
def test_a_cluster_of_actors_trains_and_returns_the_chiefs_result(local_ray, caplog):
    caplog.set_level(logging.INFO, logger="psframe.ray")
    result = run(
        ray_tasks.train_tiny,
        {"steps": 40},
        num_ps=2,
        num_workers=2,
        host="127.0.0.1",
        startup_timeout=120,
        timeout=120,
        ps_grace=30,
    )
    assert result["is_chief"] and (result["job_name"], result["task_index"]) == ("worker", 0)
    assert result["global_step"] >= 40
    assert result["malloc_tuned"] == result["malloc_tunable"]
    cluster = psframe.ClusterSpec.from_string(result["cluster"])
    assert (cluster.num_ps, cluster.num_workers) == (2, 2)
    addresses = cluster.job_tasks("ps") + cluster.job_tasks("worker")
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert result["address"] == cluster.task_address("worker", 0)
    assert "psframe cluster on Ray: " + result["cluster"] in caplog.text
    assert "after every worker returned" not in caplog.text  # the ps tasks ended on their own
    wait_until_released(local_ray)


@pytest.mark.ray
@pytest.mark.parametrize(
    "how, match",
    [
        ("raise", r"/job:worker/task:1 failed: ValueError: worker 1 cannot go on; stopping every task"),
        ("exit", r"/job:worker/task:1's Ray actor died before it could finish \(\w+Error: .*\); stopping every task"),
    ],
)
def test_a_task_that_fails_or_dies_ends_the_run_with_its_name(local_ray, how, match):
    start = time.monotonic()
    with pytest.raises(RayRunError, match=match) as info:
        run(
            ray_tasks.fail,
            {"task": 1, "how": how, "others_sleep": 120},
            num_ps=1,
            num_workers=2,
            host="127.0.0.1",
            timeout=100,
        )
    assert time.monotonic() - start < 60  # not the others' 120 s, nor the timeout
    assert isinstance(info.value.__cause__, local_ray.exceptions.RayError)
    wait_until_released(local_ray)


@pytest.mark.ray
def test_a_ps_task_still_running_after_ps_grace_is_stopped(local_ray, caplog):
    start = time.monotonic()
    assert (
        run(ray_tasks.ps_lingers, {"ps_sleep": 120}, num_ps=1, num_workers=2, host="127.0.0.1", ps_grace=2, timeout=100)
        == "worker 0 done"
    )
    assert time.monotonic() - start < 60
    assert "/job:ps/task:0 still running 2 s after every worker returned; stopping them" in caplog.text
    wait_until_released(local_ray)


@pytest.mark.ray
def test_the_timeout_stops_every_task(local_ray):
    start = time.monotonic()
    with pytest.raises(
        RayRunError, match=r"/job:ps/task:0, /job:worker/task:0 did not finish before the deadline; stopping every task"
    ):
        run(ray_tasks.sleep, {"seconds": 120}, num_ps=1, num_workers=1, host="127.0.0.1", timeout=3)
    assert time.monotonic() - start < 60
    wait_until_released(local_ray)


@pytest.mark.ray
def test_resources_the_cluster_lacks_fail_at_the_startup_timeout(local_ray):
    with pytest.raises(RayRunError, match=r"Ray could not place 3 tasks \(SPREAD, bundles .*'CPU': 64\.0.* within 2 s"):
        run(
            ray_tasks.sleep,
            {"seconds": 0},
            num_ps=1,
            num_workers=2,
            resources_per_worker={"CPU": 64},
            host="127.0.0.1",
            startup_timeout=2,
        )
    wait_until_released(local_ray)


@pytest.mark.ray
@pytest.mark.mnist
def test_ray_mnist_example_reaches_97_percent(local_ray, mnist_dir, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ray_mnist
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert (
        ray_mnist.main(
            [f"--data_dir={mnist_dir}", "--host=127.0.0.1", "--num_ps=1", "--num_workers=2", "--timeout=300"]
        )
        == 0
    )
    result = ray_mnist.json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["test_accuracy"] >= 0.97, result
    assert result["global_step"] >= 6000
    assert (result["num_ps"], result["num_workers"]) == (1, 2)
    wait_until_released(local_ray)
