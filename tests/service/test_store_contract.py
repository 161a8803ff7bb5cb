"""The ps contract, written once and run against two backends (torch's StoreTestBase style).

``memory`` drives a :class:`VariableStore` directly, the way
``ParameterServerService.push_pull`` does; ``grpc`` goes through a real
``psframe.Server`` on a free loopback port with the worker's ``PsClient``.
The oracle for every update is a local ``torch.optim`` optimizer run on copies
of the same tensors with the same gradients: results must be bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import psframe
from psframe import optim
from psframe.cluster.placement import Shard
from psframe.errors import (
    ClusterMismatchError,
    DtypeMismatchError,
    NotReadyError,
    PsframeError,
    ShapeMismatchError,
    UnknownVariableError,
)
from psframe.launch import pick_free_ports
from psframe.optim import OptimizerSpec
from psframe.ps.store import VariableStore
from psframe.status import TaskState
from psframe.wire import codec, transport
from psframe.wire import psframe_pb2 as pb
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from psframe.worker.plan.step_plan import Request, Slot

DEADLINE_S = 30.0  # a wait that never ends is a failure, not a hang


# --------------------------------------------------------------------- the backends


def _slot(name: str, like: torch.Tensor | None = None) -> Slot:
    """A whole, unpartitioned variable ``name`` on ps task 0, shaped like ``like``."""
    like = like if like is not None else torch.zeros(())
    shard = Shard(
        name=name,
        variable=name,
        ps_task=0,
        row_start=0,
        row_end=like.shape[0] if like.dim() else 1,
        shape=tuple(like.shape),
        nbytes=like.nbytes,
    )
    return Slot(shard, like.detach())


class MemoryBackend:
    """VariableStore called directly, as the servicer calls it."""

    def __init__(self) -> None:
        self.store = VariableStore("/job:ps/task:0")

    def create(self, values: dict[str, torch.Tensor], optimizer_spec: OptimizerSpec) -> bool:
        return self.store.create(values, optimizer_spec)

    def push_pull(
        self, grads: dict[str, torch.Tensor], pull: list[str], end_of_step: bool = True
    ) -> tuple[int, dict[str, torch.Tensor]]:
        store = self.store
        with store.lock:
            step, values = store.push_pull(grads, pull, end_of_step)
            values = [v.clone() for v in values]
        return step, dict(zip(pull, values))

    def nbytes(self) -> int:
        return self.store.nbytes()

    def close(self) -> None:
        pass


class GrpcBackend:
    """A real ps task on loopback, reached through the worker's PsClient."""

    def __init__(self) -> None:
        ps_port, *worker_ports = pick_free_ports(3)
        self.cluster = psframe.ClusterSpec(
            {
                "ps": [f"127.0.0.1:{ps_port}"],
                "worker": [f"127.0.0.1:{p}" for p in worker_ports],
            }
        )
        self.server = psframe.Server(self.cluster, "ps", 0, serving_processes=1)
        self.clients: list[PsClient] = []
        try:
            self.client = self.connect(0)
        except BaseException:
            self.close()
            raise

    def connect(self, task_index: int, cluster: psframe.ClusterSpec | None = None, wait: bool = True) -> PsClient:
        client = PsClient(cluster or self.cluster, task_index, rpc_timeout=DEADLINE_S)
        self.clients.append(client)
        if wait:
            control_calls.wait_for_ps(client, DEADLINE_S)
        return client

    def create(
        self, values: dict[str, torch.Tensor], optimizer_spec: OptimizerSpec, client: PsClient | None = None
    ) -> bool:
        client = client or self.client
        slots = [_slot(name, value) for name, value in values.items()]
        created = control_calls.create(
            client, 0, slots, list(values.items()), optimizer_spec, sync=None, checkpoint_dir=None
        )
        assert control_calls.get_info(client, 0).state is TaskState.READY
        return created

    def push_pull(
        self, grads: dict[str, torch.Tensor], pull: list[str], end_of_step: bool = True, client: PsClient | None = None
    ) -> tuple[int, dict[str, torch.Tensor]]:
        client = client or self.client
        request = Request(0, tuple(_slot(n, g) for n, g in grads.items()), tuple(_slot(n) for n in pull), end_of_step)
        (reply,) = client.push_pull([(request, list(grads.items()))], step=0)
        assert len(reply.values) == len(pull)
        return reply.global_step, {name: t.clone() for name, t in zip(pull, reply.values)}

    def nbytes(self) -> int:
        return control_calls.get_info(self.client, 0).bytes_held

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.stop(grace=0.0)


@pytest.fixture(params=["memory", "grpc"])
def backend(request) -> Iterator[MemoryBackend | GrpcBackend]:
    b = MemoryBackend() if request.param == "memory" else GrpcBackend()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def grpc_backend() -> Iterator[GrpcBackend]:
    b = GrpcBackend()
    try:
        yield b
    finally:
        b.close()


# ------------------------------------------------------------------------- helpers


def _initial(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "fc.weight": torch.randn(3, 4, generator=g, dtype=torch.float64).to(dtype),
        "fc.bias": torch.randn(3, generator=g, dtype=torch.float64).to(dtype),
        "scale": torch.randn((), generator=g, dtype=torch.float64).to(dtype),
    }


def _grads(values: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype) for name, v in values.items()}


class Reference:
    """The oracle: torch.optim on local leaf tensors."""

    def __init__(self, values: dict[str, torch.Tensor], make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.params = {n: v.clone().requires_grad_(True) for n, v in values.items()}
        self.optimizer = make(list(self.params.values()))

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            p.grad = grads[name].clone() if name in grads else None
        self.optimizer.step()

    def values(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), (name, got[name], want[name])


def _pull_all(backend, names) -> tuple[int, dict[str, torch.Tensor]]:
    return backend.push_pull({}, list(names), end_of_step=False)


CONFIGS = {
    "sgd": (optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd-nesterov-wd": (
        optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "adam": (optim.Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    "adamw-wd": (optim.AdamW(lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "adagrad": (optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "rmsprop-momentum": (optim.RMSprop(lr=0.01, momentum=0.5), lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5)),
}


# ------------------------------------------------------------------------ contract


@pytest.mark.parametrize("config", list(CONFIGS))
def test_updates_equal_local_torch_optim(backend, config):
    spec, make = CONFIGS[config]
    values = _initial()
    assert backend.create(values, spec) is True
    reference = Reference(values, make)
    names = list(values)
    for step in range(1, 5):
        grads = _grads(values, step)
        global_step, pulled = backend.push_pull(grads, names)
        reference.step(grads)
        assert global_step == step
        _assert_exact(pulled, reference.values())
    # A step where only some variables have gradients: the others stay put (and
    # their optimizer state is not advanced, as in torch.optim).
    grads = {"fc.bias": _grads(values, 99)["fc.bias"]}
    global_step, pulled = backend.push_pull(grads, names)
    reference.step(grads)
    assert global_step == 5
    _assert_exact(pulled, reference.values())
    # Moved from the start, so equality above is not trivially true.
    assert not torch.equal(pulled["fc.weight"], values["fc.weight"])


def test_creation_copies_the_values(backend):
    values = _initial()
    before = {n: v.clone() for n, v in values.items()}
    backend.create(values, optim.SGD(lr=0.1))
    values["fc.weight"].add_(100.0)  # the caller's tensor is not the stored one
    _, pulled = _pull_all(backend, before)
    _assert_exact(pulled, before)
    backend.push_pull(_grads(before, 1), list(before))
    assert torch.equal(values["fc.weight"], before["fc.weight"] + 100.0)  # nor is it updated


def test_pull_order_and_subset(backend):
    values = _initial()
    backend.create(values, optim.SGD(lr=0.1))
    _, pulled = _pull_all(backend, ["scale", "fc.weight"])
    assert list(pulled) == ["scale", "fc.weight"]
    _assert_exact(pulled, {"scale": values["scale"], "fc.weight": values["fc.weight"]})
    step, pulled = backend.push_pull(_grads(values, 1), [])
    assert step == 1 and pulled == {}


def test_global_step_counts_end_of_step_pushes_only(backend):
    spec, make = CONFIGS["sgd-nesterov-wd"]
    values = _initial()
    backend.create(values, spec)
    reference = Reference(values, make)
    names = list(values)
    expected_step = 0
    for i, end in enumerate([False, True, False, False, True, True]):
        grads = _grads(values, i)
        step, pulled = backend.push_pull(grads, names, end_of_step=end)
        reference.step(grads)  # applied either way
        expected_step += end
        assert step == expected_step, i
        _assert_exact(pulled, reference.values())
    assert expected_step == 3


def test_pull_only_changes_nothing(backend):
    spec, make = CONFIGS["adam"]
    values = _initial()
    backend.create(values, spec)
    reference = Reference(values, make)
    names = list(values)
    backend.push_pull(_grads(values, 1), names)
    reference.step(_grads(values, 1))
    for _ in range(3):
        step, pulled = _pull_all(backend, names)
        assert step == 1
        _assert_exact(pulled, reference.values())
    _assert_next_update_matches(backend, reference, values, names)


def _assert_next_update_matches(backend, reference, values, names) -> None:
    """The optimizer state did not move: the next update (step 2) is the reference's."""
    step, pulled = backend.push_pull(_grads(values, 2), names)
    reference.step(_grads(values, 2))
    assert step == 2
    _assert_exact(pulled, reference.values())


def _bad_pushes(values):
    good = _grads(values, 7)
    return {
        "shape": ({"fc.weight": torch.zeros(4, 3)}, ShapeMismatchError, ["'fc.weight'", "(4, 3)", "(3, 4)"]),
        "shape-0d": ({"scale": torch.zeros(1)}, ShapeMismatchError, ["'scale'", "(1,)", "()"]),
        "dtype": (
            {"fc.bias": torch.zeros(3, dtype=torch.float64)},
            DtypeMismatchError,
            ["'fc.bias'", "torch.float64", "torch.float32"],
        ),
        "unknown": ({"fc.kernel": torch.zeros(3, 4)}, UnknownVariableError, ["'fc.kernel'", "fc.weight"]),
        "good-then-bad": (
            {"fc.weight": good["fc.weight"], "fc.bias": torch.zeros(2)},
            ShapeMismatchError,
            ["'fc.bias'", "(2,)", "(3,)"],
        ),
        "bad-then-good": (
            {"fc.bias": torch.zeros(3, dtype=torch.int64), "fc.weight": good["fc.weight"]},
            DtypeMismatchError,
            ["'fc.bias'", "torch.int64", "torch.float32"],
        ),
        "good-then-unknown": (
            {"fc.weight": good["fc.weight"], "nope": torch.zeros(1)},
            UnknownVariableError,
            ["'nope'"],
        ),
    }


@pytest.mark.parametrize("case", list(_bad_pushes(_initial())))
def test_bad_push_is_refused_and_changes_nothing(backend, case):
    spec, make = CONFIGS["adam"]
    values = _initial()
    backend.create(values, spec)
    reference = Reference(values, make)
    names = list(values)
    backend.push_pull(_grads(values, 1), names)
    reference.step(_grads(values, 1))

    grads, error, needles = _bad_pushes(values)[case]
    with pytest.raises(error) as info:
        backend.push_pull(grads, names)
    assert info.type is error  # the same class on both backends, not a parent
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))

    step, pulled = _pull_all(backend, names)
    assert step == 1
    _assert_exact(pulled, reference.values())
    _assert_next_update_matches(backend, reference, values, names)


def test_pull_of_unknown_variable_is_refused_and_changes_nothing(backend):
    values = _initial()
    backend.create(values, optim.SGD(lr=0.1))
    names = list(values)
    with pytest.raises(UnknownVariableError, match="'fc.kernel'"):
        backend.push_pull(_grads(values, 1), [*names, "fc.kernel"])
    step, pulled = _pull_all(backend, names)
    assert step == 0
    _assert_exact(pulled, values)


def test_push_before_create_is_not_ready(backend):
    values = _initial()
    with pytest.raises(NotReadyError) as info:
        backend.push_pull(_grads(values, 1), list(values))
    assert info.type is NotReadyError
    assert "/job:ps/task:0" in str(info.value)
    with pytest.raises(NotReadyError):
        _pull_all(backend, list(values))
    # Creating afterwards works and starts from the created values.
    assert backend.create(values, optim.SGD(lr=0.1)) is True
    step, pulled = _pull_all(backend, list(values))
    assert step == 0
    _assert_exact(pulled, values)


def test_create_twice_with_same_model_is_a_no_op(backend):
    spec, make = CONFIGS["sgd-nesterov-wd"]
    values = _initial()
    assert backend.create(values, spec) is True
    reference = Reference(values, make)
    backend.push_pull(_grads(values, 1), list(values))
    reference.step(_grads(values, 1))
    # A restarted chief creates again with other initial values: nothing changes.
    other = {n: torch.full_like(v, 5.0) for n, v in values.items()}
    assert backend.create(other, optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)) is False
    step, pulled = _pull_all(backend, list(values))
    assert step == 1
    _assert_exact(pulled, reference.values())
    # And the momentum buffers survived.
    step, pulled = backend.push_pull(_grads(values, 2), list(values))
    reference.step(_grads(values, 2))
    _assert_exact(pulled, reference.values())


@pytest.mark.parametrize("change", ["shape", "dtype", "extra", "missing", "optimizer"])
def test_create_with_a_different_model_is_refused(backend, change):
    values = _initial()
    spec = optim.SGD(lr=0.1)
    backend.create(values, spec)
    other = dict(values)
    if change == "shape":
        other["fc.weight"] = torch.zeros(4, 4)
    elif change == "dtype":
        other["fc.bias"] = torch.zeros(3, dtype=torch.float64)
    elif change == "extra":
        other["fc2.weight"] = torch.zeros(2)
    elif change == "missing":
        del other["scale"]
    else:
        spec = optim.Adam()
    with pytest.raises(ClusterMismatchError) as info:
        backend.create(other, spec)
    assert info.type is ClusterMismatchError
    if change == "shape":
        assert "fc.weight" in str(info.value)
    if change == "optimizer":
        assert "Adam" in str(info.value) and "SGD" in str(info.value)
    _, pulled = _pull_all(backend, list(values))
    _assert_exact(pulled, values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_float_dtypes_with_sgd(backend, dtype):
    values = _initial(dtype)
    backend.create(values, optim.SGD(lr=0.25, momentum=0.5))
    reference = Reference(values, lambda p: torch.optim.SGD(p, lr=0.25, momentum=0.5))
    for step in range(1, 4):
        grads = _grads(values, step)
        global_step, pulled = backend.push_pull(grads, list(values))
        reference.step(grads)
        assert global_step == step
        _assert_exact(pulled, reference.values())
        assert all(v.dtype == dtype for v in pulled.values())
    # float32 gradients for these variables are refused.
    with pytest.raises(DtypeMismatchError, match=str(dtype)):
        backend.push_pull({"fc.bias": torch.zeros(3)}, [])


def test_nbytes_counts_adam_state(backend):
    values = _initial()
    variable_bytes = sum(v.numel() * v.element_size() for v in values.values())
    assert variable_bytes == (12 + 3 + 1) * 4
    backend.create(values, optim.Adam(lr=0.01))
    assert backend.nbytes() == variable_bytes  # Adam's state is created lazily
    backend.push_pull(_grads(values, 1), [])
    # exp_avg and exp_avg_sq like each variable, plus a float32 0-d "step" per variable.
    assert backend.nbytes() == 3 * variable_bytes + 4 * len(values)
    # Cross-check with the state a local Adam holds after one step.
    reference = Reference(values, lambda p: torch.optim.Adam(p, lr=0.01))
    reference.step(_grads(values, 1))
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in reference.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    assert backend.nbytes() == variable_bytes + state_bytes


def test_nbytes_sgd_without_momentum_holds_no_state(backend):
    values = _initial(torch.float64)
    backend.create(values, optim.SGD(lr=0.1))
    backend.push_pull(_grads(values, 1), [])
    assert backend.nbytes() == 16 * 8


# ----------------------------------------------------------------- grpc only


def test_grpc_wrong_cluster_is_refused(grpc_backend):
    values = _initial()
    grpc_backend.create(values, optim.SGD(lr=0.1))
    # A worker started with a cluster that lists one more worker: same ps address, other fingerprint.
    other = psframe.ClusterSpec(
        {
            "ps": grpc_backend.cluster.job_tasks("ps"),
            "worker": [*grpc_backend.cluster.job_tasks("worker"), "127.0.0.1:1"],
        }
    )
    assert other.fingerprint != grpc_backend.cluster.fingerprint
    stranger = grpc_backend.connect(0, other, wait=False)
    with pytest.raises(ClusterMismatchError) as info:
        grpc_backend.push_pull(_grads(values, 1), list(values), client=stranger)
    assert info.type is ClusterMismatchError
    assert other.fingerprint in str(info.value) and grpc_backend.cluster.fingerprint in str(info.value)
    with pytest.raises(ClusterMismatchError):
        grpc_backend.create(values, optim.SGD(lr=0.1), client=stranger)
    # Its connect check also notices, on the worker side.
    with pytest.raises(ClusterMismatchError):
        control_calls.wait_for_ps(stranger, DEADLINE_S)
    # Nothing was applied.
    step, pulled = _pull_all(grpc_backend, list(values))
    assert step == 0
    _assert_exact(pulled, values)


def test_grpc_caller_that_is_not_a_worker_is_refused(grpc_backend):
    values = _initial()
    grpc_backend.create(values, optim.SGD(lr=0.1))
    watchdog = transport.Watchdog()
    with transport.Connection(grpc_backend.cluster.task_address("ps", 0)) as connection:
        for caller in (
            pb.Caller(job_name="ps", task_index=0, cluster_fingerprint=grpc_backend.cluster.fingerprint),
            pb.Caller(job_name="worker", task_index=5, cluster_fingerprint=grpc_backend.cluster.fingerprint),
            pb.Caller(),
        ):
            data = codec.encode(
                pb.PushPullHeader(caller=caller, pull=["scale"], end_of_step=True), [("scale", torch.ones(()))]
            )
            stream = connection.open_stream("PushPull", watchdog)
            stream.send(data, DEADLINE_S)
            reply, tensors = codec.decode(stream.receive(), pb.PushPullReplyHeader)
            stream.close()
            assert (reply.error_class, tensors) == ("ClusterMismatchError", [])
    watchdog.stop()
    step, pulled = _pull_all(grpc_backend, list(values))
    assert step == 0
    _assert_exact(pulled, values)


def test_grpc_init_from_worker_1_is_refused(grpc_backend):
    values = _initial()
    worker1 = grpc_backend.connect(1)
    with pytest.raises(ClusterMismatchError, match="chief") as info:
        grpc_backend.create(values, optim.SGD(lr=0.1), client=worker1)
    assert info.type is ClusterMismatchError
    assert "/job:worker/task:1" in str(info.value)
    # The store is still empty, and the chief can create it.
    with pytest.raises(NotReadyError):
        grpc_backend.push_pull(_grads(values, 1), list(values), client=worker1)
    assert grpc_backend.create(values, optim.SGD(lr=0.1)) is True
    # Worker 1 may push once the model exists, and may not re-create it either.
    step, pulled = grpc_backend.push_pull({"scale": torch.ones(())}, ["scale"], client=worker1)
    assert step == 1
    assert torch.equal(pulled["scale"], values["scale"] - 0.1 * torch.ones(()))
    with pytest.raises(ClusterMismatchError):
        grpc_backend.create(values, optim.SGD(lr=0.1), client=worker1)


def test_grpc_info_reports_the_store(grpc_backend):
    values = _initial()
    info = control_calls.get_info(grpc_backend.client, 0)
    assert info.state is TaskState.WAITING_FOR_MODEL and info.global_step == 0
    spec = optim.RMSprop(lr=0.01, momentum=0.5)
    grpc_backend.create(values, spec)
    grpc_backend.push_pull(_grads(values, 1), [])
    with pytest.raises(ShapeMismatchError):
        grpc_backend.push_pull({"scale": torch.zeros(2)}, [])
    info = control_calls.get_info(grpc_backend.client, 0)
    assert info.state is TaskState.READY
    assert (info.global_step, info.applied_steps, info.rejected_pushes) == (1, 1, 1)
    assert [(v.name, v.dtype, list(v.shape)) for v in info.variables] == [
        (n, "float32", list(v.shape)) for n, v in values.items()
    ]
    assert info.optimizer == spec


def test_errors_are_psframe_errors(backend):
    with pytest.raises(PsframeError):
        backend.push_pull({}, ["x"])
