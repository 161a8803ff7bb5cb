"""psframe push+pull round trips through real ps processes.

The same payloads as the raw ceiling (:mod:`benchmarks.raw_grpc`), sent the
way a worker sends them: the trainer's plan of requests
(:class:`psframe.worker.slicer.StepPlan`) through ``PsClient.push_pull``,
which encodes them, sends them to every ps task in parallel (the ps applies
SGD with lr 0, so values stay put but the update runs) and decodes the
replies, which carry the same bytes back. PushPull is whatever kind
of RPC ``psframe.proto`` declares (unary, or one long-lived bidirectional
stream per ps task); each row says which, and its ratio to the raw ceiling of
the same kind is the like-for-like one. Each layout of the payload:

- **one**: one tensor per ps task (with 2 ps, the payload split in halves);
- **many**: small float32 tensors of ``max(4 KiB, payload / 256)`` bytes
  (at most 256 of them), half on each ps task with 2 ps. At 4 KiB this is
  the same as "one", so it is not run.

Each configuration gets its own fresh ps processes (``psframe server``), so
a ps holds only the variables it is timed on (a ps optimizer visits every
variable it holds on each step); the cluster has one worker, this process.

    python -m benchmarks.transport [--quick]
"""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TypeVar

import torch

import psframe
from benchmarks.common import (
    BenchmarkError,
    Children,
    Deadline,
    KiB,
    Settings,
    gb_per_second,
    measure_rate,
    single_thread,
    table_main,
)
from psframe import optim
from psframe.cluster.placement import DEFAULT_MAX_SHARD_BYTES, Shard
from psframe.launch import pick_free_ports
from psframe.optim import OptimizerSpec
from psframe.security import Security
from psframe.wire import transport
from psframe.worker.client import PsClient
from psframe.worker.slicer import Request, Slot, StepPlan, batches

MAX_TENSORS = 256
SMALL_TENSOR_BYTES = 4 * KiB
RPC_TIMEOUT_S = 120.0
# Ps processes of several payload sizes run at once (idle but for the one timed).
MAX_PROCESSES_AT_ONCE = 12
MAX_BYTES_AT_ONCE = 8 * 1024 * 1024
Tensors = list[tuple[str, torch.Tensor]]
Step = list[tuple[Request, Tensors]]  # a step's planned requests, each with its gradients
T = TypeVar("T")


# ---------------------------------------------------------------- ps processes


class PsCluster:
    """``num_ps`` ps tasks (``python -m psframe.cli server``) and one worker (us).

    Args:
        children: where the ps processes are started (and killed at the end).
        num_ps: how many ps tasks.
        name: prefix of the children's names.
        timeout: the ps tasks give up (exit 1) after this many seconds.
        ports: the ``num_ps + 1`` ports to use (ps tasks, then the worker);
            default: picked now. Clusters started together take theirs from
            one :func:`pick_free_ports` call: ports picked apart are each free
            when picked, and the OS may hand one out twice before any process
            binds it.
        extra_flags: more flags of ``psframe server`` for every ps task
            (e.g. ``--serving_processes=2``).
        security: the worker's auth token and TLS settings (the ps tasks'
            are in ``extra_flags``); default: none.
    """

    def __init__(
        self,
        children: Children,
        num_ps: int,
        name: str,
        timeout: float,
        ports: Sequence[int] | None = None,
        extra_flags: Sequence[str] = (),
        security: Security | None = None,
    ) -> None:
        ports = pick_free_ports(num_ps + 1) if ports is None else list(ports)
        if len(ports) != num_ps + 1:
            raise ValueError(f"a cluster of {num_ps} ps tasks needs {num_ps + 1} ports, got {len(ports)}")
        self.cluster = psframe.ClusterSpec(
            {
                "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
                "worker": [f"127.0.0.1:{ports[-1]}"],
            }
        )
        self.children = children
        self.names = [f"{name}-ps{i}" for i in range(num_ps)]
        self.procs = [
            children.start(
                task,
                [
                    sys.executable,
                    "-m",
                    "psframe.cli",
                    "server",
                    f"--cluster_spec={self.cluster.to_string()}",
                    "--job_name=ps",
                    f"--task_index={i}",
                    f"--timeout={timeout:.0f}",
                    *extra_flags,
                ],
            )
            for i, task in enumerate(self.names)
        ]
        self.client: PsClient | None = None
        self.security = security

    @property
    def num_ps(self) -> int:
        return len(self.names)

    def connect(self, deadline: Deadline) -> PsClient:
        """Worker 0's client, once every ps task answers."""
        self.client = PsClient(
            self.cluster, 0, rpc_timeout=min(RPC_TIMEOUT_S, deadline.remaining(1.0)), security=self.security
        )
        try:
            self.client.wait_for_ps(deadline.remaining())
        except psframe.PsframeError as e:
            logs = "\n".join(f"--- {n}:\n{self.children.log_tail(n)}" for n in self.names)
            raise BenchmarkError(f"ps tasks did not come up: {e}\n{logs}") from e
        return self.client

    def finish(self, timeout: float = 15.0) -> list[int | None]:
        """Tell the ps tasks the worker is done and wait for them to exit (0 expected).

        Returns:
            Each ps task's exit code (None: still running; it is killed later).
        """
        return finish_clusters([self], timeout)


def finish_clusters(clusters: Sequence[PsCluster], timeout: float = 15.0) -> list[int | None]:
    """Finish the worker of every cluster, then wait (at most ``timeout`` s in
    all) for every ps task to exit; a code other than 0 is reported on stderr.

    Returns:
        The exit code of each ps task, cluster by cluster (None: still running).
    """
    for cluster in clusters:
        if cluster.client is not None:
            cluster.client.finish()
            cluster.client.close()
            cluster.client = None
    deadline = Deadline(timeout, "ps tasks exiting")
    codes = []
    for cluster in clusters:
        for name in cluster.names:
            code = cluster.children.wait_exit(name, deadline.remaining(0.0))
            if code != 0:
                print(
                    f"[bench] warning: {name} ended with {code} (expected 0); log:\n"
                    f"{cluster.children.log_tail(name, 10)}",
                    file=sys.stderr,
                )
            codes.append(code)
    return codes


def in_parallel(calls: Sequence[Callable[[], T]], deadline: Deadline) -> list[T]:
    """Run ``calls`` in threads (e.g. Init of several clusters); their results in order."""
    if not calls:
        return []
    with futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        pending = [pool.submit(call) for call in calls]
        return [f.result(timeout=deadline.remaining()) for f in pending]


def _slots(shards: Sequence[Tensors]) -> list[Slot]:
    """``shards[i]``'s tensors as whole variables held by ps task i."""
    return [
        Slot(
            Shard(name, name, ps, 0, tensor.shape[0] if tensor.dim() else 1, tuple(tensor.shape), tensor.nbytes), tensor
        )
        for ps, tensors in enumerate(shards)
        for name, tensor in tensors
    ]


def shard_requests(shards: Sequence[Tensors], max_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Step:
    """The requests of one asynchronous worker step, as the trainer plans them
    (:class:`psframe.worker.slicer.StepPlan`), each with its gradients: ``shards[i]``."""
    by_name = {name: tensor for tensors in shards for name, tensor in tensors}
    plan = StepPlan.make(_slots(shards), len(shards), max_bytes, sync=False)
    return [(request, [(s.name, by_name[s.name]) for s in request.push]) for request in plan.step]


def create_variables(client: PsClient, shards: Sequence[Tensors], optimizer: OptimizerSpec) -> None:
    """Create ``shards[i]`` on ps task i with ``optimizer`` (one Init request at a time, as the trainer does)."""
    slots = _slots(shards)
    for ps, batch in batches(slots, len(shards), DEFAULT_MAX_SHARD_BYTES):
        client.create(
            ps,
            [s for s in slots if s.shard.ps_task == ps],
            [(s.name, s.param) for s in batch],
            optimizer,
            sync=None,
            checkpoint_dir=None,
        )
    # Every ps task holds its variables once its last Init request is in.
    client.wait_for_ps(timeout=30.0, ready=True)


def push_pull(client: PsClient, requests: Step) -> list[list[torch.Tensor]]:
    """One worker step: push the gradients of ``requests``, pull the same variables back."""
    return [reply.values for reply in client.push_pull(requests, step=0)]


def push_pull_rpc_kind() -> str:
    """ "stream" if PushPull is a bidirectional streaming RPC in psframe.proto, else "unary"."""
    return "stream" if transport.METHODS["PushPull"].streaming else "unary"


# ------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One transport measurement: ``payload_bytes`` each way over ``num_ps`` ps tasks."""

    num_ps: int
    layout: str  # "one" or "many"
    payload_bytes: int

    def tensor_bytes(self) -> list[list[int]]:
        """The byte size of each tensor, per ps task."""
        if self.layout == "one":
            return [[self.payload_bytes // self.num_ps] for _ in range(self.num_ps)]
        piece = max(SMALL_TENSOR_BYTES, self.payload_bytes // MAX_TENSORS)
        count = self.payload_bytes // piece
        per_ps = count // self.num_ps
        return [[piece] * per_ps for _ in range(self.num_ps)]

    @property
    def runnable(self) -> bool:
        """ "many" with fewer than two tensors per ps task is "one": not run."""
        return self.layout == "one" or min(len(t) for t in self.tensor_bytes()) >= 2

    def shards(self) -> list[Tensors]:
        """Float32 tensors of the case, per ps task (named ``t<ps>_<i>``)."""
        return [
            [(f"t{ps}_{i}", torch.full((nbytes // 4,), 0.5)) for i, nbytes in enumerate(sizes)]
            for ps, sizes in enumerate(self.tensor_bytes())
        ]

    @property
    def num_tensors(self) -> int:
        return sum(len(t) for t in self.tensor_bytes())

    @property
    def name(self) -> str:
        return f"{self.num_ps}ps-{self.layout}-{self.payload_bytes}"


def cases_for(sizes: Sequence[int], ps_counts: Sequence[int] = (1, 2)) -> list[Case]:
    return [
        case
        for nbytes in sizes
        for num_ps in ps_counts
        for layout in ("one", "many")
        if (case := Case(num_ps, layout, nbytes)).runnable
    ]


def prepare_case(cluster: PsCluster, case: Case) -> Step:
    """Create the case's variables on its (connected) cluster, with SGD(lr=0).

    Returns:
        The gradient requests of one step (ps task, tensors).
    """
    values = case.shards()
    create_variables(cluster.client, values, optim.SGD(lr=0.0))
    return shard_requests([[(n, torch.full_like(t, 1e-3)) for n, t in tensors] for tensors in values])


def measure_case(cluster: PsCluster, case: Case, requests: Step, settings: Settings, deadline: Deadline) -> dict:
    """Time push+pull of ``requests`` on the case's prepared cluster."""
    client = cluster.client
    expected = [[t.shape for _, t in batch] for _, batch in requests]

    def round_trip() -> None:
        pulled = push_pull(client, requests)
        if [[t.shape for t in batch] for batch in pulled] != expected:
            raise BenchmarkError(f"{case.name}: the pulled tensors do not match the pushed ones")

    rate = measure_rate(round_trip, settings, deadline, f"psframe {case.name}")
    if not all(torch.isfinite(t).all() for batch in push_pull(client, requests) for t in batch):
        raise BenchmarkError(f"{case.name}: the ps returned non-finite values")
    return {
        "system": "psframe",
        "rpc": push_pull_rpc_kind(),
        "num_ps": case.num_ps,
        "layout": case.layout,
        "num_tensors": case.num_tensors,
        "payload_bytes": case.payload_bytes,
        "round_trips_per_sec": rate.per_second,
        "gb_per_sec_each_way": gb_per_second(case.payload_bytes, rate.per_second),
        "spread": rate.spread,
        "calls_per_repeat": rate.calls_per_repeat,
        "repeats": len(rate.samples),
    }


def size_groups(sizes: Sequence[int], ps_counts: Sequence[int] = (1, 2)) -> list[list[int]]:
    """Payload sizes whose ps processes run at the same time: consecutive sizes
    while at most :data:`MAX_PROCESSES_AT_ONCE` processes and
    :data:`MAX_BYTES_AT_ONCE` bytes of payload per configuration."""
    groups: list[list[int]] = []
    procs = 0
    for nbytes in sizes:
        need = sum(c.num_ps for c in cases_for([nbytes], ps_counts))
        if not groups or procs + need > MAX_PROCESSES_AT_ONCE or sum(groups[-1]) + nbytes > MAX_BYTES_AT_ONCE:
            groups.append([])
            procs = 0
        groups[-1].append(nbytes)
        procs += need
    return groups


def run_transport_benchmarks(
    settings: Settings, timeout: float = 1200.0, ps_counts: Sequence[int] = (1, 2)
) -> list[dict]:
    """Measure every case at every size of ``settings``.

    For each group of sizes (:func:`size_groups`), every case's ps processes
    are started, connected and given their variables while nothing is timed;
    then each case is timed alone; then all of them are finished.

    Returns:
        One row per case: ``system`` ("psframe"), ``rpc`` (the kind of RPC
        PushPull is), ``num_ps``, ``layout``, ``num_tensors``,
        ``payload_bytes``, ``round_trips_per_sec``, ``gb_per_sec_each_way``,
        ``spread``, ``calls_per_repeat``, ``repeats``. :func:`add_ratios` adds
        the comparison with the raw ceiling.
    """
    single_thread()
    torch.set_num_threads(1)
    deadline = Deadline(timeout, "psframe transport benchmark")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psframe-bench-transport-") as logs:
        for sizes in size_groups(settings.sizes, ps_counts):
            cases = cases_for(sizes, ps_counts)
            with Children(logs) as children:
                ports = iter(pick_free_ports(sum(c.num_ps + 1 for c in cases)))  # all distinct
                clusters = [
                    PsCluster(
                        children,
                        c.num_ps,
                        c.name,
                        deadline.remaining() + 60,
                        [next(ports) for _ in range(c.num_ps + 1)],
                    )
                    for c in cases
                ]
                for cluster in clusters:  # all up (done importing torch) before anything is timed
                    cluster.connect(deadline)
                requests = in_parallel(
                    [functools.partial(prepare_case, cl, c) for cl, c in zip(clusters, cases)], deadline
                )
                for case, cluster, reqs in zip(cases, clusters, requests):
                    rows.append(measure_case(cluster, case, reqs, settings, deadline))
                finish_clusters(clusters)
    return rows


def add_ratios(rows: list[dict], raw_rows: Sequence[dict]) -> list[dict]:
    """Add ``vs_raw_unary`` and ``vs_raw_stream``: round trips/s over the raw
    ceiling's at the same payload (None where the raw rows lack that size),
    and ``vs_raw_same``: the one of the two in the mode of psframe's PushPull."""
    raw = {(r["mode"], r["payload_bytes"]): r["round_trips_per_sec"] for r in raw_rows}
    for row in rows:
        for mode in ("unary", "stream"):
            ceiling = raw.get((mode, row["payload_bytes"]))
            row[f"vs_raw_{mode}"] = row["round_trips_per_sec"] / ceiling if ceiling else None
        row["vs_raw_same"] = row[f"vs_raw_{row['rpc']}"]
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks import report

    return table_main(
        argv,
        __doc__,
        "small sizes, few repeats",
        lambda quick: report.transport_table(run_transport_benchmarks(Settings.for_mode(quick))),
    )


if __name__ == "__main__":
    sys.exit(main())
