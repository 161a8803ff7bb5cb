"""psframe launch's lifecycle: what follows a task's failure (``--on_failure``, ``--max_restarts``), the
grace a task gets to stop (``--grace``), the launcher's own SIGTERM, and the cluster it leaves for
``psframe status``.

The policy's rules are unit tests; the rest are real child processes on loopback ports the OS
picks, every wait bounded, every process started here killed by PID (a launch by the session it
leads) at the end.

This file holds the cluster tier's tests of the subject; `tests/unit/test_launch_lifecycle.py` holds
the other tiers'.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psframe import cli
from psframe.launch import FailurePolicy, OnFailure, launch
from psframe.launch import record as launch_record
from tests.cluster.test_launch import PRELUDE, TIMEOUT, _lines
from tests.conftest import ROOT, psframe_command

WAIT_S = 90.0  # bounds every wait on a child; no test relies on it


@pytest.fixture(autouse=True)
def launch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's launches keep their records in a folder of its own."""
    folder = tmp_path / "launched"
    monkeypatch.setenv(launch_record.LAUNCH_DIR_ENV, str(folder))
    return folder


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return str(path)


# ---- the policy, unit


# ---- restart, continue: real children


@pytest.mark.cluster
def test_restart_starts_a_killed_task_again_and_the_job_goes_on(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        f"""
        d = {str(tmp_path)!r}
        if me == "worker1":
            first = not os.path.exists(os.path.join(d, "worker1.ran"))
            open(os.path.join(d, "worker1.ran"), "a").close()
            if first:
                os.kill(os.getpid(), signal.SIGKILL)  # lost, as to the OOM killer
            print("started again")
            open(os.path.join(d, "worker1.done"), "w").close()
        else:
            wait_for([os.path.join(d, "worker1.done")])
            print("saw worker1 done:", os.path.exists(os.path.join(d, "worker1.done")))
    """,
    )
    out = io.StringIO()
    assert launch(script, 1, 2, timeout=TIMEOUT, out=out, on_failure="restart") == 0
    text = out.getvalue()
    assert "[launch] worker1 was killed by SIGKILL (code 137); starting it again (restart 1 of 3)\n" in text
    assert "[worker1] started again\n" in text
    assert "[ps0] saw worker1 done: True\n" in text and "[worker0] saw worker1 done: True\n" in text
    assert _lines(out)[-1] == ("launch", "done: ps0=0 worker0=0 worker1=0 (restarted 1)")


@pytest.mark.cluster
def test_restart_gives_up_after_max_restarts_and_stops_the_job(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if me == "worker1":
            sys.exit(3)
        time.sleep(60)
    """,
    )
    out = io.StringIO()
    assert launch(script, 1, 2, timeout=TIMEOUT, out=out, on_failure=FailurePolicy(OnFailure.RESTART, 2)) == 3
    text = out.getvalue()
    for line in (
        "worker1 exited with code 3; starting it again (restart 1 of 2)",
        "worker1 exited with code 3; starting it again (restart 2 of 2)",
        "worker1 exited with code 3; it was started again 2 times (--max_restarts); stopping the others",
    ):
        assert f"[launch] {line}\n" in text
    assert _lines(out)[-1] == ("launch", "done: ps0=143 (stopped) worker0=143 (stopped) worker1=3 (restarted 2)")


@pytest.mark.cluster
def test_continue_leaves_a_failed_worker_out_and_the_others_go_on(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        f"""
        gone = os.path.join({str(tmp_path)!r}, "worker1.gone")
        if me == "worker1":
            open(gone, "w").close()
            sys.exit(3)
        wait_for([gone])
        print("went on")
    """,
    )
    out = io.StringIO()
    assert launch(script, 1, 2, timeout=TIMEOUT, out=out, on_failure="continue") == 0
    text = out.getvalue()
    assert "[launch] worker1 exited with code 3; the others go on without it (--on_failure=continue)\n" in text
    assert "[ps0] went on\n" in text and "[worker0] went on\n" in text
    assert _lines(out)[-1] == ("launch", "done: ps0=0 worker0=0 worker1=3 (left out)")


@pytest.mark.cluster
def test_continue_still_stops_the_job_when_the_chief_fails(tmp_path: Path) -> None:
    script = _script(tmp_path, 'if me == "worker0":\n    sys.exit(4)\ntime.sleep(60)\n')
    out = io.StringIO()
    assert launch(script, 1, 2, timeout=TIMEOUT, out=out, on_failure="continue") == 4
    assert "[launch] worker0 exited with code 4; the chief is needed to the end; stopping the others\n" in (
        out.getvalue()
    )


# ---- the grace after Ctrl-C


CATCHES_CTRL_C = """
    d = {tmp!r}
    if me == "worker0":
        try:  # Ctrl-C as a terminal sends it: to the launcher, and to this task
            os.kill(os.getppid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted: evaluating on the test set", flush=True)
            time.sleep({work})
            print("test accuracy 0.97", flush=True)
            open(os.path.join(d, "evaluated"), "w").close()
    else:
        wait_for([os.path.join(d, "evaluated")])
"""


@pytest.mark.cluster
def test_a_script_that_catches_ctrl_c_gets_the_grace_for_its_last_work(tmp_path: Path) -> None:
    # 6 s of work after Ctrl-C: more than the 5 s a task used to get, less than the default grace.
    script = _script(tmp_path, CATCHES_CTRL_C.format(tmp=str(tmp_path), work=6))
    out = io.StringIO()
    assert launch(script, 1, 1, timeout=TIMEOUT + 30, out=out) == 130
    text = out.getvalue()
    assert "[launch] interrupted; every task has 30s (--grace) to stop on its own; Ctrl-C again stops them now" in text
    assert "[worker0] test accuracy 0.97\n" in text
    assert _lines(out)[-1] == ("launch", "done: ps0=0 worker0=0")


@pytest.mark.cluster
def test_a_task_still_busy_when_the_grace_runs_out_is_stopped(tmp_path: Path) -> None:
    script = _script(tmp_path, CATCHES_CTRL_C.format(tmp=str(tmp_path), work=60))
    out = io.StringIO()
    assert launch(script, 1, 1, timeout=TIMEOUT, out=out, grace=0.5) == 130
    assert "[worker0] interrupted: evaluating on the test set\n" in out.getvalue()
    assert _lines(out)[-1] == ("launch", "done: ps0=143 (stopped) worker0=143 (stopped)")


# ---- the cluster printed and kept for psframe status; the launcher's own SIGTERM


JOB = """\
import argparse, logging, sys, time
import psframe
from psframe import flags

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
parser = argparse.ArgumentParser()
flags.add_cluster_flags(parser)
cluster, job_name, task_index = flags.cluster_from_flags(parser.parse_args())
if job_name == "ps":
    psframe.Server(cluster, "ps", task_index, serving_processes=1).join()  # no flags.run: the line is join's
else:
    time.sleep(120)  # a worker that never connects
"""


@pytest.fixture
def launched(tmp_path: Path, launch_dir: Path) -> Iterator[subprocess.Popen]:
    """``psframe launch`` of :data:`JOB` (1 ps task, 1 worker) in a session of its own, output in launch.out."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", launch_record.LAUNCH_DIR_ENV: str(launch_dir)}
    env.pop("PSFRAME_AUTH_TOKEN", None)
    argv = psframe_command("launch", "--num_ps=1", "--num_workers=1", "--timeout=300", "--grace=20", str(job))
    with open(tmp_path / "launch.out", "w") as out:
        popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        yield popen
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)  # the launch and every task it started
        popen.wait(timeout=10)


def _wait_for(path: Path, text: str, popen: subprocess.Popen) -> str:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        output = path.read_text(errors="replace")
        if text in output:
            return output
        if popen.poll() is not None:
            break
        time.sleep(0.05)
    pytest.fail(f"no {text!r} from psframe launch:\n{path.read_text(errors='replace')[-3000:]}")


@pytest.mark.cluster
def test_psframe_status_with_no_arguments_finds_the_cluster_launch_started(
    tmp_path: Path, launch_dir: Path, launched: subprocess.Popen, monkeypatch, capsys
) -> None:
    out_path = tmp_path / "launch.out"
    output = _wait_for(out_path, "serving at", launched)
    addresses = dict(re.findall(r"(ps0|worker0)=(127\.0\.0\.1:\d+)", re.search(r"\[launch\] cluster: (.*)", output)[1]))
    assert sorted(addresses) == ["ps0", "worker0"]
    token_file = launch_dir / f"{launched.pid}.token"
    assert f"--auth_token_file={token_file}" in output
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"

    # Elsewhere on this machine, with no token in the environment and no TF_CONFIG: no argument at all.
    monkeypatch.delenv("PSFRAME_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    capsys.readouterr()
    assert cli.main(["status"]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"/job:ps/task:0\s+{re.escape(addresses['ps0'])}\s+ps\s+\S", table), table
    assert f"/job:worker/task:0  {addresses['worker0']}" in table, table

    # The launcher given SIGTERM stops every task; a ps task says so in one line (without flags.run).
    launched.send_signal(signal.SIGTERM)
    assert launched.wait(timeout=WAIT_S) == 143
    output = out_path.read_text()
    assert "[launch] got SIGTERM; stopping every task\n" in output
    assert "[ps0] job.py: stopped by SIGTERM; /job:ps/task:0 saved no checkpoint (it has no checkpoint_dir)\n" in output
    assert "Traceback" not in output
    assert output.splitlines()[-1] == "[launch] done: ps0=143 (stopped) worker0=143 (stopped)"
    assert list(launch_dir.iterdir()) == []  # the record and the token file went with the launch

    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    assert "psframe status: error: no cluster given: give --ps_hosts and --worker_hosts, or --cluster_spec" in err
