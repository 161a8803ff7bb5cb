"""The failures a newcomer meets first, on each entry point: one line saying what to do, and an exit code.

No ps task ever comes up, a port in use, a malformed ``--ps_hosts``, a task
index out of range, two tasks given different clusters, Ctrl-C: each ends the
process with exactly one line on stderr besides its log records, no traceback,
and the exit code ``docs/guides/failures.md`` lists (1, or 130 after Ctrl-C).
The entry points: ``psframe server`` (and ``ping``, ``status``, ``shutdown``
where the failure applies) and a training script run by hand or under
``psframe launch`` (``examples/mlp_mnist_dist.py``, ``examples/ctr_dist.py``,
through :func:`psframe.flags.run`).

In-process calls (``cli.main``, the examples' ``main`` through ``flags.run``)
are unit or service tier; child processes are cluster tier, on free loopback
ports, every wait bounded, and every process started here killed by PID (a
launch by the session it leads) at the end.

This file holds the unit tier's tests of the subject; `tests/service/test_first_failures.py`,
`tests/cluster/test_first_failures.py` hold the other tiers'.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from psframe import cli, flags
from psframe.cli import server as server_command
from psframe.errors import ClusterSpecError, ConnectTimeoutError, PsframeError
from tests.conftest import ROOT

EXAMPLES = ROOT / "examples"
MNIST = EXAMPLES / "mlp_mnist_dist.py"
CTR = EXAMPLES / "ctr_dist.py"
# ctr_dist.py's data, small enough to make in a moment.
CTR_FLAGS = ["--train_samples=2000", "--test_samples=200", "--hash_buckets=1000", "--batch_size=16"]
# A log record, as the examples and psframe's command format them: "2026-11-26 02:30:52,957 INFO ...".
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
INTERRUPTED = "interrupted by Ctrl-C (SIGINT); stopped"
WAIT_S = 90.0  # bounds every wait on a child; no test relies on it
SAME_CLUSTER = (
    "give every task the same cluster (the same --ps_hosts and --worker_hosts, or --cluster_spec, in the same order)"
)


def the_line(stderr: str) -> str:
    """The one line a failure printed on stderr: no traceback, nothing else besides log records."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    assert len(lines) == 1, stderr
    return lines[0]


def hosts(ps: int, worker: int | str) -> list[str]:
    return [
        f"--ps_hosts=127.0.0.1:{ps}",
        f"--worker_hosts={worker}" if isinstance(worker, str) else f"--worker_hosts=127.0.0.1:{worker}",
    ]


def example(name: str):
    """An example's module, imported in this process (its ``main`` takes argv)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def run_example(capsys, name: str, argv: list[str]) -> tuple[int, str]:
    """An example's ``main`` run as its ``__main__`` runs it; the exit code and stderr."""
    module = example(name)
    capsys.readouterr()
    code = flags.run(lambda: module.main(argv), prog=f"{name}.py")
    return code, capsys.readouterr().err


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def ctr_or_mnist_flags(script: Path, data_dir: Path) -> list[str]:
    return CTR_FLAGS if script == CTR else [f"--data_dir={data_dir}", "--batch_size=4"]


@pytest.fixture
def tiny_mnist(tmp_path: Path) -> Path:
    """An MNIST folder of 32 blank training images (the examples' IDX files), read in a moment."""
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    count = 32
    for prefix in ("train", "t10k"):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">4I", 2051, count, 28, 28) + bytes(count * 784))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">2I", 2049, count) + bytes(range(10)) * 3 + bytes(2)
        )
    return tmp_path / "mnist"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ---- psframe.flags.run, the scripts' one supported way


def test_run_turns_a_psframe_error_into_one_line_and_exit_code_1(capsys):
    def main() -> int:
        raise ConnectTimeoutError("/job:worker/task:0 waited 1.0s for /job:ps/task:0; is it started?")

    assert flags.run(main, prog="train.py") == flags.EXIT_FAILURE == 1
    assert the_line(capsys.readouterr().err) == (
        "train.py: error: /job:worker/task:0 waited 1.0s for /job:ps/task:0; is it started?"
    )


def test_run_turns_ctrl_c_into_one_line_and_exit_code_130(capsys):
    def main() -> int:
        raise KeyboardInterrupt

    assert flags.run(main, prog="train.py") == flags.EXIT_INTERRUPTED == 130
    assert the_line(capsys.readouterr().err) == f"train.py: {INTERRUPTED}"


def test_run_names_the_script_and_keeps_a_message_on_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/train.py", "--job_name=ps"])

    def main() -> int:
        raise PsframeError("first part\n  second part\n")

    assert flags.run(main) == 1
    assert the_line(capsys.readouterr().err) == "train.py: error: first part second part"


def test_run_reports_the_expected_classes_it_is_given(capsys):
    def main() -> int:
        raise FileNotFoundError("MNIST files not found in data/; fetch them with scripts/fetch_mnist.py")

    assert flags.run(main, expected=(FileNotFoundError,), prog="train.py") == 1
    assert the_line(capsys.readouterr().err).startswith("train.py: error: MNIST files not found")
    with pytest.raises(FileNotFoundError):  # not expected: a bug, with its traceback
        flags.run(main, prog="train.py")


def test_run_lets_a_bug_and_sys_exit_through_and_returns_main_s_code(capsys):
    def bug() -> int:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        flags.run(bug)
    with pytest.raises(SystemExit):
        flags.run(lambda: sys.exit(2))
    assert flags.run(lambda: None) == 0
    assert flags.run(lambda: 3) == 3
    assert capsys.readouterr().err == ""


# ---- a malformed --ps_hosts


@pytest.mark.parametrize("command", ["server", "status", "shutdown"])
def test_a_malformed_ps_hosts_is_one_line_from_psframe(capsys, command):
    argv = [command, "--ps_hosts=localhost", "--worker_hosts=127.0.0.1:2224"]
    if command == "server":
        argv += ["--job_name=ps", "--task_index=0"]
    code, err = run_cli(capsys, *argv)
    assert code == 1
    assert the_line(err) == (
        f"psframe {command}: error: --ps_hosts='localhost': task address 'localhost' has no port; "
        f"expected 'host:port' such as 'localhost:2222'"
    )


@pytest.mark.parametrize("name", ["mlp_mnist_dist", "ctr_dist"])
def test_a_malformed_ps_hosts_is_one_line_from_a_script(capsys, name):
    code, err = run_example(
        capsys, name, ["--ps_hosts=h0:2222,h0", "--worker_hosts=h1:2224", "--job_name=ps", "--task_index=0"]
    )
    assert code == 1
    assert the_line(err) == (
        f"{name}.py: error: --ps_hosts='h0:2222,h0': task address 'h0' has no port; "
        f"expected 'host:port' such as 'h0:2222'"
    )


# ---- a task index out of range


def test_a_task_index_out_of_range_is_one_line_from_psframe_server(capsys):
    code, err = run_cli(capsys, "server", *hosts(2222, 2224), "--job_name=ps", "--task_index=1")
    assert code == 1
    assert the_line(err) == (
        "psframe server: error: task_index 1 is out of range for job 'ps' with 1 task (expected 0..0): "
        "give --task_index from 0 to 0, or add this task's address to --ps_hosts"
    )


@pytest.mark.parametrize("name", ["mlp_mnist_dist", "ctr_dist"])
def test_a_task_index_out_of_range_is_one_line_from_a_script(capsys, name):
    argv = ["--cluster_spec=ps|h0:2222,worker|h1:2224;h1:2225", "--job_name=worker", "--task_index=2"]
    code, err = run_example(capsys, name, argv)
    assert code == 1
    assert the_line(err) == (
        f"{name}.py: error: task_index 2 is out of range for job 'worker' with 2 tasks (expected 0..1): "
        f"give --task_index from 0 to 1, or add this task's address to --cluster_spec"
    )


def test_the_flag_errors_stay_cluster_spec_errors():
    parser = argparse.ArgumentParser()
    flags.add_cluster_flags(parser)
    with pytest.raises(ClusterSpecError, match=r"add this task's address to --worker_hosts"):
        flags.cluster_from_flags(parser.parse_args([*hosts(2222, 2224), "--job_name=worker", "--task_index=1"]))


# ---- Ctrl-C, in process (the child processes below send a real SIGINT)


def test_ctrl_c_is_one_line_and_130_from_psframe_server_in_process(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(server_command, "cluster_from_flags", interrupted)
    code, err = run_cli(capsys, "server", *hosts(2222, 2224), "--job_name=ps", "--task_index=0")
    assert code == 130
    assert the_line(err) == f"psframe server: {INTERRUPTED}"


# ---- a port in use, no ps task, different clusters: psframe's commands in process (gRPC)


# ---- child processes: the scripts as users start them, and psframe server


class Child:
    """One process started here, its stdout and stderr in files of their own."""

    def __init__(self, tmp_path: Path, name: str, argv: list[str], new_session: bool = False) -> None:
        self.name = name
        self.out_path, self.err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=new_session
            )
        self.new_session = new_session

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, done: Callable[[str], bool], what: str) -> None:
        """Wait until ``done(stdout + stderr)`` (or fail, showing both)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if done(self.out + self.err):
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"{self.name} did not {what}:\n{self.out[-3000:]}\n{self.err[-3000:]}")

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the process, or to its whole session, as a terminal sends it."""
        if self.new_session:
            os.killpg(self.popen.pid, signal.SIGINT)
        else:
            self.popen.send_signal(signal.SIGINT)

    def finish(self) -> int:
        try:
            return self.popen.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still runs {WAIT_S}s on:\n{self.out[-3000:]}\n{self.err[-3000:]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            if self.new_session:
                os.killpg(self.popen.pid, signal.SIGKILL)
            else:
                self.popen.kill()
        self.popen.wait(timeout=10)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(name: str, argv: list[str], new_session: bool = False) -> Child:
        child = Child(tmp_path, name, argv, new_session)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


def script(path: Path, *argv: str) -> list[str]:
    return [sys.executable, str(path), *argv]
