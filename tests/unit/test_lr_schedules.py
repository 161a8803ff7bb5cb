"""Learning-rate schedules on the ps tasks, without a network: the rate at every global step is
torch's scheduler's, stepped the same way; the specs, their checks, wire and checkpoint forms."""

from __future__ import annotations

import functools
import io
import json
import math

import numpy
import pytest
import torch
from torch.optim import lr_scheduler as torch_schedules

import psframe
from psframe.errors import OptimizerConfigError
from psframe.optim import lr_scheduler as schedules
from psframe.optim.schedule_clock import ScheduleClock
from psframe.ps.store import VariableStore
from psframe.ps.store.schedules import ModelSchedules
from psframe.tables.spec import DynamicTableSpec
from psframe.wire import messages

STEPS = 40


def warmup(step: int) -> float:
    """A module-level function: it travels by name."""
    return min(1.0, (step + 1) / 8)


def decay_after(step: int, start: int, rate: float) -> float:
    return 1.0 if step < start else rate ** (step - start)


def shrink(step: int) -> float:
    return 0.97


# (name, psframe schedule, the same torch scheduler over a torch optimizer)
CASES = [
    ("step", schedules.StepLR(step_size=3, gamma=0.5), lambda o: torch_schedules.StepLR(o, 3, 0.5)),
    (
        "multistep",
        schedules.MultiStepLR(milestones=[2, 5, 9], gamma=0.3),
        lambda o: torch_schedules.MultiStepLR(o, [2, 5, 9], 0.3),
    ),
    ("constant", schedules.ConstantLR(factor=0.25, total_iters=4), lambda o: torch_schedules.ConstantLR(o, 0.25, 4)),
    (
        "linear_warmup",
        schedules.LinearLR(start_factor=0.1, total_iters=6),
        lambda o: torch_schedules.LinearLR(o, start_factor=0.1, total_iters=6),
    ),
    ("exponential", schedules.ExponentialLR(gamma=0.9), lambda o: torch_schedules.ExponentialLR(o, 0.9)),
    (
        "polynomial",
        schedules.PolynomialLR(total_iters=8, power=2.0),
        lambda o: torch_schedules.PolynomialLR(o, total_iters=8, power=2.0),
    ),
    (
        "cosine",
        schedules.CosineAnnealingLR(T_max=10, eta_min=0.001),
        lambda o: torch_schedules.CosineAnnealingLR(o, 10, 0.001),
    ),
    (
        "warm_restarts",
        schedules.CosineAnnealingWarmRestarts(T_0=4, T_mult=2, eta_min=0.01),
        lambda o: torch_schedules.CosineAnnealingWarmRestarts(o, 4, 2, 0.01),
    ),
    (
        "cyclic",
        schedules.CyclicLR(base_lr=0.01, max_lr=0.1, step_size_up=3, mode="triangular2"),
        lambda o: torch_schedules.CyclicLR(o, 0.01, 0.1, step_size_up=3, mode="triangular2"),
    ),
    (
        "one_cycle",
        schedules.OneCycleLR(max_lr=0.5, total_steps=STEPS + 1),
        lambda o: torch_schedules.OneCycleLR(o, 0.5, total_steps=STEPS + 1),
    ),
    (
        "sequential",
        schedules.SequentialLR(
            schedulers=[schedules.LinearLR(start_factor=0.1, total_iters=5), schedules.CosineAnnealingLR(T_max=20)],
            milestones=[5],
        ),
        lambda o: torch_schedules.SequentialLR(
            o, [torch_schedules.LinearLR(o, 0.1, total_iters=5), torch_schedules.CosineAnnealingLR(o, 20)], [5]
        ),
    ),
    (
        "chained",
        schedules.ChainedScheduler(
            schedulers=[schedules.ConstantLR(factor=0.5, total_iters=3), schedules.ExponentialLR(gamma=0.95)]
        ),
        lambda o: torch_schedules.ChainedScheduler(
            [torch_schedules.ConstantLR(o, 0.5, 3), torch_schedules.ExponentialLR(o, 0.95)]
        ),
    ),
    ("lambda", schedules.LambdaLR(lr_lambda=warmup), lambda o: torch_schedules.LambdaLR(o, warmup)),
    (
        "lambda_partial",
        schedules.LambdaLR(lr_lambda=functools.partial(decay_after, start=10, rate=0.9)),
        lambda o: torch_schedules.LambdaLR(o, functools.partial(decay_after, start=10, rate=0.9)),
    ),
    (
        "multiplicative",
        schedules.MultiplicativeLR(lr_lambda=shrink),
        lambda o: torch_schedules.MultiplicativeLR(o, shrink),
    ),
]
IDS = [c[0] for c in CASES]
# (psframe optimizer factory, torch optimizer, its arguments): momentum and betas cycle in some schedules.
OPTIMIZERS = [
    (psframe.optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (psframe.optim.Adam, torch.optim.Adam, {"lr": 0.01, "betas": (0.9, 0.99)}),
]


def torch_rates(make, optimizer_cls, kwargs, steps=STEPS) -> list[dict]:
    """What torch's scheduler sets at each global step: ``optimizer.step(); scheduler.step()`` per step."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = optimizer_cls([param], **kwargs)
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append({k: optimizer.param_groups[0][k] for k in ("lr", "momentum", "betas") if k in kwargs or k == "lr"})
        param.grad = torch.zeros(1)
        optimizer.step()
        scheduler.step()
    return rates


def clock_rates(clock: ScheduleClock, steps_counter: numpy.ndarray, keys, steps=STEPS, start=0) -> list[dict]:
    rates = []
    for step in range(start, steps):
        steps_counter[0] = step
        values = clock.hyperparameters()
        rates.append({k: values[k] for k in keys})
    return rates


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("factory,optimizer_cls,kwargs", OPTIMIZERS, ids=["sgd", "adam"])
def test_the_rate_at_every_global_step_is_torchs(case, factory, optimizer_cls, kwargs):
    _, schedule, make = case
    expected = torch_rates(make, optimizer_cls, kwargs)
    counter = numpy.zeros(1, dtype=numpy.int64)
    clock = ModelSchedules(factory(**kwargs, schedule=schedule), None, counter).dense
    assert clock is not None
    assert clock_rates(clock, counter, expected[0].keys()) == expected


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_clock_goes_on_from_its_state_as_if_never_stopped(case):
    _, schedule, make = case
    spec = psframe.optim.SGD(lr=0.1, momentum=0.9, schedule=schedule)
    expected = torch_rates(make, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    counter = numpy.array([13], dtype=numpy.int64)
    state = ScheduleClock(spec, lambda: int(counter[0])).state_dict()
    # Through a checkpoint file (weights_only) and through JSON (a re-layout's record), as builtins.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    for kept in (torch.load(buffer, weights_only=True), json.loads(json.dumps(state))):
        resumed = ScheduleClock(spec, lambda: int(counter[0]))
        resumed.load_state_dict(kept)
        assert resumed.step == 13
        assert clock_rates(resumed, counter, ("lr", "momentum"), start=13) == expected[13:]


def test_a_clock_steps_once_per_global_step_and_again_from_zero_if_the_step_goes_back():
    spec = psframe.optim.SGD(lr=1.0, schedule=schedules.StepLR(step_size=2, gamma=0.5))
    counter = numpy.zeros(1, dtype=numpy.int64)
    clock = ScheduleClock(spec, lambda: int(counter[0]))
    counter[0] = 5
    assert clock.hyperparameters()["lr"] == 0.25 and clock.step == 5
    counter[0] = 1
    assert clock.hyperparameters()["lr"] == 1.0 and clock.step == 1


def test_plateau_steps_with_the_reported_metrics_as_torchs_does():
    metrics = [1.0, 0.9, 0.9, 0.95, 0.91, 0.92, 0.93, 0.5, 0.6, 0.7, 0.8]
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([param], lr=0.01)
    reference = torch_schedules.ReduceLROnPlateau(optimizer, factor=0.25, patience=1)
    spec = psframe.optim.Adam(lr=0.01, schedule=schedules.ReduceLROnPlateau(factor=0.25, patience=1))
    counter = numpy.zeros(1, dtype=numpy.int64)
    model = ModelSchedules(spec, spec.for_tables(), counter)
    assert model.plateau and model.tables is not None
    for step, metric in enumerate(metrics):
        counter[0] = 10 * step
        reference.step(metric)
        assert model.report(metric, 10 * step) == 10 * step
        assert model.learning_rate() == optimizer.param_groups[0]["lr"]
        assert model.tables.hyperparameters()["lr"] == optimizer.param_groups[0]["lr"]  # the tables' too
    assert optimizer.param_groups[0]["lr"] < 0.01 / 16
    # Restored, it goes on with the same best and counts.
    restored = ModelSchedules(spec, spec.for_tables(), counter)
    restored.load_state_dict(json.loads(json.dumps(model.state_dict())))
    for metric in (0.9, 0.95, 0.96):
        reference.step(metric)
        restored.report(metric, int(counter[0]))
        assert restored.learning_rate() == optimizer.param_groups[0]["lr"]


def test_a_metric_reported_ahead_counts_once_the_global_step_gets_there():
    spec = psframe.optim.SGD(lr=1.0, schedule=schedules.ReduceLROnPlateau(factor=0.5, patience=0))
    counter = numpy.array([3], dtype=numpy.int64)
    model = ModelSchedules(spec, None, counter)
    assert model.report(1.0, 3) == 3  # the best so far
    assert model.report(2.0, 5) == 5  # worse: halves, but from step 5 on
    assert model.learning_rate() == 1.0
    pending = model.state_dict()
    counter[0] = 4
    assert model.learning_rate() == 1.0
    counter[0] = 5
    assert model.learning_rate() == 0.5
    restored = ModelSchedules(spec, None, counter)  # a waiting metric is kept in the state too
    counter[0] = 3
    restored.load_state_dict(pending)
    counter[0] = 6
    assert restored.learning_rate() == 0.5


def test_a_metric_without_a_plateau_schedule_is_refused():
    spec = psframe.optim.SGD(lr=1.0, schedule=schedules.StepLR(step_size=2))
    with pytest.raises(OptimizerConfigError, match="no optimizer here has a ReduceLROnPlateau"):
        ModelSchedules(spec, None).report(1.0, 0)
    with pytest.raises(OptimizerConfigError, match="no schedule"):
        ModelSchedules(psframe.optim.SGD(lr=1.0), None).report(1.0, 0)


# ---- on the store: the dense optimizer, the fixed tables' and a dynamic table's, by global step


def sparse_rows(table_rows: int, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    shape = (table_rows, values.shape[1])
    return torch.sparse_coo_tensor(ids.unsqueeze(0), values, shape, check_invariants=False).coalesce()


@pytest.mark.parametrize(
    "optimizer",
    [
        psframe.optim.SGD(lr=0.1, momentum=0.9, schedule=schedules.StepLR(step_size=3, gamma=0.5)),
        psframe.optim.Adam(
            lr=0.05,
            schedule=schedules.SequentialLR(
                schedulers=[schedules.LinearLR(start_factor=0.2, total_iters=4), schedules.ExponentialLR(gamma=0.8)],
                milestones=[4],
            ),
        ),
    ],
    ids=["sgd_momentum", "adam"],
)
def test_a_store_with_a_schedule_is_one_process_with_that_scheduler_tables_included(optimizer):
    generator = torch.Generator().manual_seed(3)
    weight, table = torch.randn(4, 3, generator=generator), torch.randn(10, 2, generator=generator)
    table_optimizer = optimizer.for_tables()
    store = VariableStore()
    store.create({"w": weight, "emb": table}, optimizer, tables=["emb"], table_optimizer=table_optimizer)
    local_w, local_t = weight.clone().requires_grad_(), table.clone().requires_grad_()
    dense = optimizer.build([local_w])
    rows = table_optimizer.build([local_t], per_parameter=True)
    schedulers = [
        schedules.build(optimizer.schedule, dense),
        schedules.build(table_optimizer.schedule, rows),
    ]
    for step in range(12):
        grad = torch.randn(4, 3, generator=generator)
        ids = torch.unique(torch.randint(0, 10, (4,), generator=generator))
        row_grads = torch.randn(ids.numel(), 2, generator=generator)
        global_step, _ = store.push_pull({"w": grad}, [], True, rows=[("emb", ids, row_grads)])
        assert global_step == step + 1
        local_w.grad, local_t.grad = grad, sparse_rows(10, ids, row_grads)
        dense.step()
        rows.step()
        for scheduler in schedulers:
            scheduler.step()
        held_w, held_t = store.read(["w", "emb"])
        assert torch.equal(held_w, local_w.detach()) and torch.equal(held_t, local_t.detach()), step
    assert store.schedules.learning_rate() == dense.param_groups[0]["lr"] != optimizer.kwargs["lr"]


def test_a_dynamic_tables_rows_follow_the_schedule():
    optimizer = psframe.optim.Adagrad(lr=0.5, schedule=schedules.ExponentialLR(gamma=0.5))
    store = VariableStore()
    store.create(
        {"w": torch.zeros(2)},
        optimizer,
        table_optimizer=optimizer,
        dynamic={"ids": _dynamic_part()},
    )
    part = store._model.table_parts.dynamic_rows("ids")
    for step in range(4):
        store.push_pull({}, [], True, rows=[("ids", torch.tensor([7, 11 + step]), torch.ones(2, 3))])
        assert part.optimizer.param_groups[0]["lr"] == 0.5 * 0.5**step


def _dynamic_part():
    from psframe.ps.store.table_parts import DynamicPart

    return DynamicPart(DynamicTableSpec(), (3,), torch.float32)


def test_a_store_refuses_a_schedule_whose_function_it_cannot_import():
    # As it arrives from a chief whose function this task cannot import (a worker checks its own import).
    function = schedules.FunctionRef("no_such_module_here:factor")
    optimizer = psframe.optim.SGD(lr=0.1, schedule=schedules.ScheduleSpec("LambdaLR", function=function))
    with pytest.raises(OptimizerConfigError, match="cannot import"):
        schedules.LambdaLR(lr_lambda="no_such_module_here:factor")
    store = VariableStore()
    with pytest.raises(OptimizerConfigError, match="cannot import the schedule's function 'no_such_module_here"):
        store.create({"w": torch.zeros(2)}, optimizer)
    assert not store.ready


# ---- the specs: checked up front, on the wire, in checkpoints


def test_specs_are_checked_on_the_worker_with_the_reason():
    with pytest.raises(OptimizerConfigError, match="a lambda or a nested function cannot"):
        schedules.LambdaLR(lr_lambda=lambda step: 1.0)

    def nested(step):
        return 1.0

    with pytest.raises(OptimizerConfigError, match="top level of a module"):
        schedules.LambdaLR(lr_lambda=nested)
    with pytest.raises(OptimizerConfigError, match="tuples may hold numbers only"):
        schedules.LambdaLR(lr_lambda=functools.partial(decay_after, start=[1, "a"], rate=0.5))
    with pytest.raises(OptimizerConfigError, match="LambdaLR needs its lr_lambda"):
        schedules.ScheduleSpec("LambdaLR")
    with pytest.raises(OptimizerConfigError, match="StepLR takes no function"):
        schedules.ScheduleSpec("StepLR", {"step_size": 2}, function=schedules.FunctionRef("math:sqrt"))
    with pytest.raises(OptimizerConfigError, match="SequentialLR needs schedulers"):
        schedules.ScheduleSpec("SequentialLR", {"milestones": (2,)})
    with pytest.raises(OptimizerConfigError, match="unknown schedule 'WarmupLR'"):
        schedules.ScheduleSpec("WarmupLR")
    with pytest.raises(OptimizerConfigError, match=r"last_epoch=\.\.\.\): psframe sets these itself"):
        schedules.ScheduleSpec("StepLR", {"step_size": 2, "last_epoch": 4})
    with pytest.raises(OptimizerConfigError, match="torch refused .*StepLR"):
        schedules.StepLR(step_size=0)
    with pytest.raises(OptimizerConfigError, match="torch refused .*OneCycleLR.* over torch.optim.Adagrad"):
        psframe.optim.Adagrad(lr=0.1, schedule=schedules.OneCycleLR(max_lr=1.0, total_steps=10))
    with pytest.raises(OptimizerConfigError, match="schedule= takes a psframe.optim.lr_scheduler spec"):
        psframe.optim.SGD(lr=0.1, schedule=torch_schedules.StepLR)  # type: ignore[arg-type]
    with pytest.raises(OptimizerConfigError, match="stepped by the global step"):
        schedules.SequentialLR(
            schedulers=[schedules.ReduceLROnPlateau(), schedules.StepLR(step_size=2)], milestones=[3]
        )


def test_a_function_travels_by_its_name_and_arguments():
    spec = schedules.LambdaLR(lr_lambda=functools.partial(decay_after, start=10, rate=0.9))
    assert spec.function == schedules.FunctionRef(
        "tests.unit.test_lr_schedules:decay_after", (), {"start": 10, "rate": 0.9}
    )
    assert spec.function.resolve()(12) == decay_after(12, 10, 0.9)
    assert schedules.LambdaLR(lr_lambda=math.sqrt).function.path == "math:sqrt"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_optimizer_with_a_schedule_comes_back_the_same_from_the_wire_and_a_checkpoint(case):
    spec = psframe.optim.SGD(lr=0.1, momentum=0.9, schedule=case[1])
    assert messages.optimizer_from_proto(messages.optimizer_to_proto(spec)) == spec
    assert schedules.ScheduleSpec.from_dict(json.loads(json.dumps(spec.schedule.to_dict()))) == spec.schedule
    assert "schedule=psframe.optim.lr_scheduler." in repr(spec)


def test_milestones_arrive_as_whole_numbers():
    spec = psframe.optim.SGD(lr=0.1, schedule=schedules.MultiStepLR(milestones=[30, 80]))
    back = messages.optimizer_from_proto(messages.optimizer_to_proto(spec))
    assert back.schedule.kwargs["milestones"] == (30, 80)
    assert all(type(m) is int for m in back.schedule.kwargs["milestones"])


def test_the_table_optimizer_keeps_the_schedule_of_the_optimizer_it_comes_from():
    step = schedules.StepLR(step_size=10)
    assert psframe.optim.Adam(lr=0.1, schedule=step).for_tables() == psframe.optim.SparseAdam(lr=0.1, schedule=step)
    assert psframe.optim.SGD(lr=0.1, momentum=0.9, schedule=step).for_tables().name == "SparseSGD"


# ---- TensorFlow's decays, as the TF1 guide maps them


def tf_exponential_decay(lr, step, decay_steps, decay_rate, staircase):
    p = step // decay_steps if staircase else step / decay_steps
    return lr * decay_rate**p


def tf_piecewise_constant(step, boundaries, values):
    return values[sum(step > b for b in boundaries)]


def test_tfs_decays_map_onto_torchs_schedules():
    counter = numpy.zeros(1, dtype=numpy.int64)

    def rates(schedule, lr):
        clock = ScheduleClock(psframe.optim.SGD(lr=lr, schedule=schedule), lambda: int(counter[0]))
        return clock_rates(clock, counter, ("lr",), steps=300)

    staircase = rates(schedules.StepLR(step_size=100, gamma=0.96), 0.1)
    smooth = rates(schedules.ExponentialLR(gamma=0.96 ** (1 / 100)), 0.1)
    piecewise = rates(schedules.MultiStepLR(milestones=[101, 201], gamma=0.5), 1.0)
    for step in range(300):
        assert staircase[step]["lr"] == pytest.approx(tf_exponential_decay(0.1, step, 100, 0.96, True), rel=1e-12)
        assert smooth[step]["lr"] == pytest.approx(tf_exponential_decay(0.1, step, 100, 0.96, False), rel=1e-12)
        assert piecewise[step]["lr"] == tf_piecewise_constant(step, [100, 200], [1.0, 0.5, 0.25])


# ---- a ps task served from several processes: one global step, a clock in each process


def test_serving_processes_follow_the_shared_global_step_and_a_plateau_stays_with_the_owner():
    from psframe.ps.serving.shared_store import SharedStore, publish_store
    from psframe.ps.serving.store_memory import SharedStoreMemory

    for schedule, shared_too in (
        (schedules.StepLR(step_size=2, gamma=0.5), True),
        (schedules.ReduceLROnPlateau(), False),  # the chief's metrics reach the owner alone
        (schedules.LambdaLR(lr_lambda=warmup), False),  # a serving process may not import the function
    ):
        shared = SharedStore.create(num_workers=2)
        try:
            owner = VariableStore(
                "/job:ps/task:0", lock=shared.lock, counters=shared.counters, memory=SharedStoreMemory(shared.allocate)
            )
            optimizer = psframe.optim.SGD(lr=1.0, momentum=0.9, schedule=schedule)
            owner.create({"w": torch.zeros(3)}, optimizer)
            owner.push_pull({"w": torch.ones(3)}, [], True)  # the momentum buffer: state to share
            assert publish_store(shared, owner, "/job:ps/task:0") is shared_too
            if not shared_too:  # the owner applies every update
                continue
            other = VariableStore("/job:ps/task:0", lock=shared.lock, counters=shared.counters)
            other.attach_shared(*SharedStore.attach(shared.folder, 2).load())
            assert other.optimizer_spec == optimizer
            local = torch.zeros(3, requires_grad=True)
            local_opt = torch.optim.SGD([local], lr=1.0, momentum=0.9)
            local_schedule = torch_schedules.StepLR(local_opt, 2, 0.5)
            for step in range(7):
                grad = torch.full((3,), float(step + 1))
                local.grad = grad
                local_opt.step()
                local_schedule.step()
                if step:  # step 0 went through the owner above (a gradient of ones); then each in turn
                    (owner if step % 2 else other).push_pull({"w": grad}, [], True)
            assert torch.equal(owner.read(["w"])[0], local.detach())
            assert other.schedules.learning_rate() == owner.schedules.learning_rate() == local_opt.param_groups[0]["lr"]
        finally:
            shared.close()
