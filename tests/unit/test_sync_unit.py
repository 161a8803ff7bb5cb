"""Unit tests of the synchronous barrier (``psframe.ps.protocol.sync.SyncAggregator``), no network.

Every update is checked bit for bit against ``torch.optim.SGD`` run on copies
of the same variables (leaf tensors, ``.grad`` set, ``opt.step()``), with the
gradient mean computed the way the design fixes it: summed in task-index
order, divided by the number of members.

``push`` blocks until its step is applied, so concurrent workers run in
threads; every thread is joined with a timeout and must have ended. Arrival
orders are forced by waiting (under the store lock) until a push is recorded
in the round before the next one starts; no test depends on a sleep.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import psframe
from psframe.errors import (
    BarrierTimeoutError,
    DtypeMismatchError,
    PsframeError,
    ShapeMismatchError,
    TaskUnavailableError,
    UnknownVariableError,
)
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.store import VariableStore
from tests.support.doubles import FakeClock

LR = 0.5
TIMEOUT = 5.0  # the aggregator's deadline in tests that must not time out
JOIN_S = 10.0  # > TIMEOUT: a push that hangs ends with BarrierTimeoutError first
WAIT_S = 5.0  # polling for a thread to reach a point


# --------------------------------------------------------------------- helpers


class Call:
    """Run ``fn(*args, **kwargs)`` in a daemon thread; keep its result or exception."""

    _UNSET = object()

    def __init__(self, fn, *args, **kwargs) -> None:
        self.result = self._UNSET
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            self.result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def join(self, timeout: float = JOIN_S) -> Call:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"a push did not return within {timeout}s"
        return self

    def value(self):
        """The result, re-raising the thread's exception."""
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(predicate, store: VariableStore, *calls: Call, what: str = "a condition") -> None:
    """Poll ``predicate`` under ``store.lock``; fail if a watched call ended first or WAIT_S passes."""
    deadline = time.monotonic() + WAIT_S
    while True:
        with store.lock:
            if predicate():
                return
        for call in calls:
            if not call.thread.is_alive():
                raise AssertionError(
                    f"waiting for {what}: a push ended early with result={call.result!r}, error={call.error!r}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {WAIT_S}s")
        time.sleep(0.001)


class SignalingGrads(dict):
    """A gradient dict that signals when ``push`` first looks at it.

    ``push`` reads the gradients only under the store lock, after the stale
    check, so once :attr:`seen` is set the push has joined the current round.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = threading.Event()

    def items(self):
        self.seen.set()
        return super().items()

    def keys(self):
        self.seen.set()
        return super().keys()

    def __iter__(self):
        self.seen.set()
        return super().__iter__()

    def __getitem__(self, key):
        self.seen.set()
        return super().__getitem__(key)


def rand(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float32) * scale


def values0() -> dict[str, torch.Tensor]:
    """The variables of ps 0 in most tests."""
    return {"w": rand((4, 3), 1), "b": rand((3,), 2)}


def values1() -> dict[str, torch.Tensor]:
    """Different variables, for ps 1."""
    return {"u": rand((2, 5), 3), "v": rand((7,), 4)}


def grads_for(values: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    return {name: rand(tuple(v.shape), 1000 * seed + i) for i, (name, v) in enumerate(values.items())}


def make_store(values: dict[str, torch.Tensor], owner: str = "/job:ps/task:0") -> VariableStore:
    store = VariableStore(task_name=owner)
    assert store.create(values, psframe.optim.SGD(lr=LR))
    return store


def snapshot(store: VariableStore) -> dict[str, torch.Tensor]:
    with store.lock:
        names = store.names
        return {name: value.clone() for name, value in zip(names, store.read(names))}


def mean_in_order(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """((g0 + g1) + g2 ...) / n, in the order given."""
    out = {}
    for name in grads[0]:
        total = grads[0][name]
        for g in grads[1:]:
            total = total + g[name]
        out[name] = total / len(grads)
    return out


def sgd_reference(init: dict[str, torch.Tensor], grad: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What torch.optim.SGD(lr=LR) makes of ``init`` after one step with ``grad``."""
    params = {name: value.detach().clone().requires_grad_(True) for name, value in init.items()}
    opt = torch.optim.SGD(list(params.values()), lr=LR)
    for name, param in params.items():
        param.grad = grad[name].clone()
    opt.step()
    return {name: param.detach().clone() for name, param in params.items()}


def assert_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), f"{name}: not bit-identical to the oracle"


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[name], b[name]) for name in a)


def ps1_decides_via(agg0: SyncAggregator):
    return lambda step, timeout: agg0.members_of(step, timeout)


# --------------------------------------------------------------------- 1. one exact step


def test_two_workers_one_step_is_sgd_on_the_mean():
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    g0, g1 = grads_for(init, 10), grads_for(init, 11)

    calls = {0: Call(agg.push, 0, 0, g0), 1: Call(agg.push, 1, 0, g1)}

    assert calls[0].value() is False
    assert calls[1].value() is False
    expected = sgd_reference(init, {n: (g0[n] + g1[n]) / 2 for n in init})
    assert differs(expected, init)
    assert differs(expected, sgd_reference(init, g0))  # one worker alone would not do
    assert_exact(snapshot(store), expected)
    assert store.global_step == 1
    assert agg.dropped_gradients == 0


# --------------------------------------------------------------------- 2. summation order


def _order_sensitive_grads(n: int = 4096) -> list[dict[str, torch.Tensor]]:
    """float32 gradients spanning many magnitudes, so addition order shows in the bits."""
    grads = []
    for i in range(3):
        generator = torch.Generator().manual_seed(500 + i)
        mantissa = torch.randn(n, generator=generator)
        exponent = torch.randint(-3, 9, (n,), generator=generator).to(torch.float32)
        sign = 1.0 if i != 2 else -1.0
        grads.append({"w": (sign * mantissa * torch.pow(10.0, exponent)).to(torch.float32)})
    return grads


@pytest.fixture(scope="module")
def order_case():
    init = {"w": rand((4096,), 77)}
    return init, _order_sensitive_grads()


def test_summation_is_in_task_index_order_whatever_the_arrival_order(order_case):
    init, grads = order_case
    expected = sgd_reference(init, mean_in_order([grads[0], grads[1], grads[2]]))
    results = {}
    for order in [(0, 1, 2), (2, 1, 0), (1, 2, 0)]:
        store = make_store(init)
        agg = SyncAggregator(store, num_workers=3, replicas_to_aggregate=3, timeout=TIMEOUT)
        calls = {}
        for position, worker in enumerate(order):
            calls[worker] = Call(agg.push, worker, 0, grads[worker])
            if position < 2:  # the last one completes the round
                wait_until(
                    lambda k=position + 1: len(agg._round.completed) == k,  # noqa: B023 - called in this iteration
                    store,
                    calls[worker],
                    what=f"worker {worker} to be waiting in push",
                )
        for worker in order:
            assert calls[worker].value() is False
        assert store.global_step == 1
        results[order] = snapshot(store)

    for result in results.values():
        assert_exact(result, expected)

    # The oracle can tell: summing in arrival order would have changed the bits.
    for order in [(2, 1, 0), (1, 2, 0)]:
        in_arrival_order = sgd_reference(init, mean_in_order([grads[w] for w in order]))
        assert differs(in_arrival_order, expected), order


# --------------------------------------------------------------------- 3. stale


@pytest.mark.parametrize("count_drop", [True, False])
def test_stale_push_is_dropped_at_once_and_counted_only_if_asked(count_drop):
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    g0, g1 = grads_for(init, 20), grads_for(init, 21)
    calls = [Call(agg.push, 0, 0, g0), Call(agg.push, 1, 0, g1)]
    assert [c.value() for c in calls] == [False, False]
    after_step_0 = snapshot(store)
    assert store.global_step == 1

    # Nobody else pushes for step 1: a stale push must not wait for a round.
    stale = Call(agg.push, 0, 0, grads_for(init, 22), count_drop=count_drop)
    assert stale.value() is True
    assert agg.dropped_gradients == (1 if count_drop else 0)
    assert_exact(snapshot(store), after_step_0)
    assert store.global_step == 1
    with store.lock:
        assert agg._round.contributions == {}  # nothing joined step 1


def test_push_for_a_future_step_is_dropped_at_once(caplog):
    # A ps restored from a checkpoint is behind the step the worker pulled at.
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    assert agg.push(0, 3, grads_for(init, 1)) is True
    assert agg.dropped_gradients == 1
    assert "step 3" in caplog.text
    assert_exact(snapshot(store), init)
    assert store.global_step == 0
    with store.lock:
        assert agg._round.contributions == {}


# --------------------------------------------------------------------- 4. backup worker


def test_backup_worker_is_ignored_and_its_late_push_is_stale():
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT)
    g = {w: grads_for(init, 30 + w) for w in range(3)}

    first = Call(agg.push, 2, 0, g[2])
    wait_until(lambda: agg._round.completed == [2], store, first, what="worker 2 waiting")
    second = Call(agg.push, 0, 0, g[0])
    assert first.value() is False
    assert second.value() is False
    assert store.global_step == 1
    assert agg.dropped_gradients == 0

    assert agg.push(1, 0, g[1]) is True  # the backup: stale by now
    assert agg.dropped_gradients == 1

    expected = sgd_reference(init, mean_in_order([g[0], g[2]]))
    assert differs(expected, sgd_reference(init, mean_in_order([g[0], g[1], g[2]])))
    assert differs(expected, sgd_reference(init, mean_in_order([g[0], g[1]])))
    assert_exact(snapshot(store), expected)
    assert store.global_step == 1
    assert agg.members_of(0) == (0, 2)


# --------------------------------------------------------------------- 5. timeout


def test_timeout_names_step_and_workers_and_does_not_poison_the_round():
    init = values0()
    store = make_store(init)
    clock = FakeClock(tick=0.05)  # each reading a twentieth of a second on: the wait ends on its own
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=0.3, clock=clock)
    g0, g1 = grads_for(init, 40), grads_for(init, 41)

    started = clock.now()
    with pytest.raises(BarrierTimeoutError) as excinfo:
        agg.push(0, 0, g0)
    assert clock.now() - started >= 0.3  # it gave up once its clock passed the deadline, not before
    message = str(excinfo.value)
    assert "sync step 0" in message
    assert "waited" in message
    arrived, _, missing = message.partition("missing:")
    assert "arrived: /job:worker/task:0" in arrived
    assert "/job:worker/task:1" not in arrived
    assert "/job:worker/task:1" in missing
    assert "/job:worker/task:0" not in missing
    assert_exact(snapshot(store), init)
    assert store.global_step == 0
    assert agg.dropped_gradients == 0

    # Worker 0 retries, then worker 1 comes: the round still completes.
    agg.timeout = TIMEOUT
    retry = SignalingGrads(g0)
    again = Call(agg.push, 0, 0, retry)
    assert retry.seen.wait(WAIT_S), "worker 0's retry never reached the round"
    late = Call(agg.push, 1, 0, g1)
    assert again.value() is False
    assert late.value() is False
    assert_exact(snapshot(store), sgd_reference(init, mean_in_order([g0, g1])))
    assert store.global_step == 1
    assert agg.dropped_gradients == 0


# --------------------------------------------------------------------- 6. same members on every shard


def test_every_shard_uses_the_members_ps0_chose():
    init0, init1 = values0(), values1()
    store0, store1 = make_store(init0, "/job:ps/task:0"), make_store(init1, "/job:ps/task:1")
    agg0 = SyncAggregator(store0, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT)
    agg1 = SyncAggregator(store1, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT, decide=ps1_decides_via(agg0))
    g = {w: grads_for(init0, 60 + w) for w in range(3)}  # for ps 0
    h = {w: grads_for(init1, 70 + w) for w in range(3)}  # for ps 1

    # Worker 1 is first on ps 1, worker 0 second: ps 1 must not pick the first
    # two to complete there, only ps 0's choice counts.
    w1_on_ps1 = Call(agg1.push, 1, 0, h[1])
    wait_until(lambda: agg1._round.completed == [1], store1, w1_on_ps1, what="worker 1 waiting on ps 1")
    w0_on_ps1 = Call(agg1.push, 0, 0, h[0])
    wait_until(lambda: agg1._round.completed == [1, 0], store1, w0_on_ps1, w1_on_ps1, what="worker 0 waiting on ps 1")
    assert store1.global_step == 0

    # Workers 0 and 2 complete the step on ps 0 first.
    w0_on_ps0 = Call(agg0.push, 0, 0, g[0])
    wait_until(lambda: agg0._round.completed == [0], store0, w0_on_ps0, what="worker 0 waiting on ps 0")
    w2_on_ps0 = Call(agg0.push, 2, 0, g[2])
    assert w0_on_ps0.value() is False
    assert w2_on_ps0.value() is False

    # Worker 1 is last on ps 0: stale there.
    assert agg0.push(1, 0, g[1]) is True

    w2_on_ps1 = Call(agg1.push, 2, 0, h[2])
    assert w0_on_ps1.value() is False
    assert w2_on_ps1.value() is False
    assert w1_on_ps1.value() is True

    expected1 = sgd_reference(init1, mean_in_order([h[0], h[2]]))
    for first_two_on_ps1 in ([h[0], h[1]], [h[1], h[2]]):
        assert differs(expected1, sgd_reference(init1, mean_in_order(first_two_on_ps1)))
    assert_exact(snapshot(store1), expected1)
    assert_exact(snapshot(store0), sgd_reference(init0, mean_in_order([g[0], g[2]])))
    assert store0.global_step == store1.global_step == 1
    assert agg0.dropped_gradients == 1  # worker 1, stale
    assert agg1.dropped_gradients == 1  # worker 1, late


def test_a_non_member_arriving_after_the_decision_but_before_the_update_is_late():
    init0, init1 = values0(), values1()
    store0, store1 = make_store(init0, "/job:ps/task:0"), make_store(init1, "/job:ps/task:1")
    agg0 = SyncAggregator(store0, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT)
    agg1 = SyncAggregator(store1, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT, decide=ps1_decides_via(agg0))
    g = {w: grads_for(init0, 80 + w) for w in range(3)}
    h = {w: grads_for(init1, 90 + w) for w in range(3)}

    first = Call(agg0.push, 0, 0, g[0])
    wait_until(lambda: agg0._round.completed == [0], store0, first, what="worker 0 waiting on ps 0")
    second = Call(agg0.push, 2, 0, g[2])
    assert first.value() is False and second.value() is False

    # On ps 1 worker 0 arrives, learns the members (0, 2) and waits for worker 2.
    w0 = Call(agg1.push, 0, 0, h[0])
    wait_until(lambda: agg1._round.members == (0, 2), store1, w0, what="ps 1 to learn the members")
    # Worker 1 arrives now: decided, not applied.
    w1 = Call(agg1.push, 1, 0, h[1])
    wait_until(lambda: 1 in agg1._round.late, store1, w1, what="worker 1 to be recorded late")
    assert store1.global_step == 0
    w2 = Call(agg1.push, 2, 0, h[2])
    assert w0.value() is False
    assert w2.value() is False
    assert w1.value() is True
    assert_exact(snapshot(store1), sgd_reference(init1, mean_in_order([h[0], h[2]])))
    assert store1.global_step == 1
    assert agg1.dropped_gradients == 1


# --------------------------------------------------------------------- 7. worker_finished


def test_a_finished_worker_is_not_waited_for():
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    g0 = grads_for(init, 100)
    agg.worker_finished(1)
    assert Call(agg.push, 0, 0, g0).value() is False
    assert_exact(snapshot(store), sgd_reference(init, g0))
    assert store.global_step == 1
    assert agg.dropped_gradients == 0


def test_a_worker_finishing_releases_a_waiting_push():
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    g0 = grads_for(init, 110)
    waiting = Call(agg.push, 0, 0, g0)
    wait_until(lambda: agg._round.completed == [0], store, waiting, what="worker 0 waiting")
    assert store.global_step == 0
    finisher = Call(agg.worker_finished, 1)
    finisher.value()
    assert waiting.value() is False
    assert_exact(snapshot(store), sgd_reference(init, g0))
    assert store.global_step == 1


def test_workers_finishing_together_at_a_clean_end_warn_of_nothing(caplog):
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    pushes = [Call(agg.push, w, 0, grads_for(init, 140 + w)) for w in (0, 1)]
    assert [p.value() for p in pushes] == [False, False]
    with caplog.at_level(logging.INFO, logger="psframe.ps.protocol.sync"):
        agg.worker_finished(1)
        agg.worker_finished(0)  # the last: no round follows, none averages fewer than 2
    assert store.global_step == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_round_short_of_replicas_to_aggregate_while_one_trains_on_warns_once(caplog):
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT)
    with caplog.at_level(logging.INFO, logger="psframe.ps.protocol.sync"):
        agg.worker_finished(2)  # 2 left: rounds still average 2, nothing to say
        pushes = [Call(agg.push, w, 0, grads_for(init, 150 + w)) for w in (0, 1)]
        assert [p.value() for p in pushes] == [False, False]
        agg.worker_finished(1)  # said once a round averages fewer, not before
        assert not caplog.records, caplog.text
        for step in (1, 2):
            assert Call(agg.push, 0, step, grads_for(init, 160 + step)).value() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "/job:ps/task:0: 1 workers still training, fewer than replicas_to_aggregate=2; "
        "from step 1 each update averages the gradients of 1"
    ]


# --------------------------------------------------------------------- 8. a contribution in two pushes


def test_a_contribution_may_come_in_two_pushes():
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=1, replicas_to_aggregate=1, timeout=TIMEOUT)
    g = grads_for(init, 120)

    part_w = Call(agg.push, 0, 0, {"w": g["w"]})
    wait_until(
        lambda: set(agg._round.contributions.get(0, {})) == {"w"}, store, part_w, what="the first half to be recorded"
    )
    assert store.global_step == 0
    assert_exact(snapshot(store), init)
    part_b = Call(agg.push, 0, 0, {"b": g["b"]})
    assert part_w.value() is False
    assert part_b.value() is False
    assert_exact(snapshot(store), sgd_reference(init, g))
    assert store.global_step == 1
    assert agg.dropped_gradients == 0


# --------------------------------------------------------------------- 9. invalid gradients


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"w": torch.zeros(3, 4)}, ShapeMismatchError),
        ({"w": torch.zeros(4, 3, dtype=torch.float64)}, DtypeMismatchError),
        ({"nope": torch.zeros(4, 3)}, UnknownVariableError),
    ],
    ids=["shape", "dtype", "unknown"],
)
def test_an_invalid_gradient_is_refused_and_records_nothing(bad, error):
    init = values0()
    store = make_store(init)
    agg = SyncAggregator(store, num_workers=1, replicas_to_aggregate=1, timeout=TIMEOUT)
    g = grads_for(init, 130)
    poison = {"b": torch.full((3,), 1e6)}  # valid on its own: must not be kept either
    with pytest.raises(error):
        agg.push(0, 0, {**poison, **bad})
    with store.lock:
        assert agg._round.contributions == {} and agg._round.completed == []
    assert_exact(snapshot(store), init)
    assert store.global_step == 0

    # Had "b" been kept, this half would complete the step at once with the poison.
    part_w = Call(agg.push, 0, 0, {"w": g["w"]})
    wait_until(
        lambda: set(agg._round.contributions.get(0, {})) == {"w"}, store, part_w, what="the valid half to be recorded"
    )
    part_b = Call(agg.push, 0, 0, {"b": g["b"]})
    assert part_w.value() is False
    assert part_b.value() is False
    assert_exact(snapshot(store), sgd_reference(init, g))
    assert store.global_step == 1


# --------------------------------------------------------------------- 10. members_of and decide


def test_members_of_remembers_past_steps_and_waits_for_the_current_one():
    init = values0()
    store = make_store(init)
    clock = FakeClock()
    agg = SyncAggregator(store, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT, clock=clock)

    def step(step_index: int, order: tuple[int, int]) -> None:
        first = Call(agg.push, order[0], step_index, grads_for(init, 10 * step_index + order[0]))
        wait_until(lambda: agg._round.completed == [order[0]], store, first, what="the first worker waiting")
        second = Call(agg.push, order[1], step_index, grads_for(init, 10 * step_index + order[1]))
        assert first.value() is False and second.value() is False

    step(0, (2, 0))
    step(1, (1, 2))
    assert agg.members_of(0) == (0, 2)
    assert agg.members_of(1) == (1, 2)

    started = clock.now()
    running = threading.Event()
    running.set()
    ticking = threading.Thread(target=_run_clock, args=(clock, running), daemon=True)
    ticking.start()  # the clock runs on while the call waits
    try:
        with pytest.raises(BarrierTimeoutError, match="sync step 2"):
            agg.members_of(2, 0.2)
    finally:
        running.clear()
        ticking.join(10)
    assert clock.now() - started >= 0.2

    asking = Call(agg.members_of, 2)
    step(2, (0, 1))
    assert asking.value() == (0, 1)


def test_only_ps0_answers_members_of():
    agg0 = SyncAggregator(make_store(values0()), num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    agg1 = SyncAggregator(
        make_store(values1(), "/job:ps/task:1"),
        num_workers=2,
        replicas_to_aggregate=2,
        timeout=TIMEOUT,
        decide=ps1_decides_via(agg0),
    )
    with pytest.raises(PsframeError, match="ps 0"):
        agg1.members_of(0, 0.1)


def test_a_failing_decide_fails_the_push_and_a_later_push_completes_the_round():
    init0, init1 = values0(), values1()
    store0, store1 = make_store(init0, "/job:ps/task:0"), make_store(init1, "/job:ps/task:1")
    agg0 = SyncAggregator(store0, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT)
    unavailable = TaskUnavailableError("/job:ps/task:0 is unavailable")
    asked = []

    def decide(step, timeout):
        asked.append(step)
        if len(asked) == 1:
            raise unavailable
        return agg0.members_of(step, timeout)

    agg1 = SyncAggregator(store1, num_workers=2, replicas_to_aggregate=2, timeout=TIMEOUT, decide=decide)
    g = {w: grads_for(init0, 140 + w) for w in range(2)}
    h = {w: grads_for(init1, 150 + w) for w in range(2)}

    with pytest.raises(TaskUnavailableError) as excinfo:
        Call(agg1.push, 0, 0, h[0]).value()
    assert excinfo.value is unavailable
    assert_exact(snapshot(store1), init1)
    assert store1.global_step == 0

    ps0 = [Call(agg0.push, w, 0, g[w]) for w in range(2)]
    assert [c.value() for c in ps0] == [False, False]

    retry = Call(agg1.push, 0, 0, h[0])
    wait_until(lambda: agg1._round.members == (0, 1), store1, retry, what="ps 1 to learn the members")
    other = Call(agg1.push, 1, 0, h[1])
    assert retry.value() is False
    assert other.value() is False
    assert asked == [0, 0]
    assert_exact(snapshot(store1), sgd_reference(init1, mean_in_order([h[0], h[1]])))
    assert store1.global_step == 1


def test_a_decide_failing_with_any_exception_does_not_wedge_the_round():
    init0, init1 = values0(), values1()
    store0, store1 = make_store(init0, "/job:ps/task:0"), make_store(init1, "/job:ps/task:1")
    agg0 = SyncAggregator(store0, num_workers=1, replicas_to_aggregate=1, timeout=TIMEOUT)
    asked = []

    def decide(step, timeout):
        asked.append(step)
        if len(asked) == 1:
            raise RuntimeError("channel closed")
        return agg0.members_of(step, timeout)

    agg1 = SyncAggregator(store1, num_workers=1, replicas_to_aggregate=1, timeout=0.5, decide=decide)
    g, h = grads_for(init0, 160), grads_for(init1, 170)

    with pytest.raises(Exception):  # noqa: B017 - whichever error, the push must fail
        Call(agg1.push, 0, 0, h).value()
    assert Call(agg0.push, 0, 0, g).value() is False
    assert Call(agg1.push, 0, 0, h).value() is False  # with the bug: BarrierTimeoutError
    assert_exact(snapshot(store1), sgd_reference(init1, h))


# --------------------------------------------------------------------- 11. constructor


@pytest.mark.parametrize("replicas", [0, -1, 4])
def test_replicas_to_aggregate_must_be_between_1_and_num_workers(replicas):
    with pytest.raises(ValueError, match="replicas_to_aggregate"):
        SyncAggregator(make_store(values0()), num_workers=3, replicas_to_aggregate=replicas, timeout=TIMEOUT)


@pytest.mark.parametrize("replicas", [1, 3])
def test_replicas_to_aggregate_at_the_bounds_is_accepted(replicas):
    agg = SyncAggregator(make_store(values0()), num_workers=3, replicas_to_aggregate=replicas, timeout=TIMEOUT)
    assert agg.replicas_to_aggregate == replicas and agg.num_workers == 3


# ------------------------------------------------------- a checkpoint's cut


def test_a_hold_keeps_rounds_from_being_applied_until_released_or_its_end():
    """A round completed during a hold waits; reach() applies rounds up to the cut and holds
    the next; release() lets it go; a hold that is never released ends by itself."""
    from psframe.errors import CheckpointCutError

    store = make_store(values0())
    agg = SyncAggregator(store, num_workers=1, replicas_to_aggregate=1, timeout=TIMEOUT)
    grads = {"w": rand((4, 3), 5), "b": rand((3,), 6)}
    assert agg.cut.hold(5.0) == 0
    first = Call(agg.push, 0, 0, grads)
    wait_until(lambda: agg._round.completed == [0], store, first, what="the round to complete")
    assert store.global_step == 0 and first.thread.is_alive()  # complete, not applied: held
    agg.cut.reach(1)  # the cut is one round on: applied, and held there
    assert first.value() is False and store.global_step == 1
    agg.cut.check()
    second = Call(agg.push, 0, 1, grads)
    wait_until(lambda: agg._round.completed == [0], store, second, what="the next round to complete")
    assert store.global_step == 1
    with pytest.raises(CheckpointCutError, match="past the checkpoint's cut at 0"):
        agg.cut.reach(0)
    agg.cut.release()
    assert second.value() is False and store.global_step == 2
    with pytest.raises(CheckpointCutError, match="its hold on rounds ended"):
        agg.cut.check()
    agg.cut.hold(0.2)  # never released: the round goes through once the hold ends
    assert Call(agg.push, 0, 2, grads).value() is False and store.global_step == 3


def _run_clock(clock: FakeClock, running: threading.Event) -> None:
    """Move ``clock`` on by a twentieth of a second every hundredth of one, while ``running``."""
    while running.is_set():
        clock.advance(0.05)
        time.sleep(0.01)
