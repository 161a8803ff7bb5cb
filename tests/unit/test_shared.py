"""psframe.ps.serving.shared_store: one model, one lock and one set of counters for a ps task's
processes. No network.

This file holds the unit tier's tests of the subject; `tests/cluster/test_shared.py` holds the other
tiers'.
"""

from __future__ import annotations

import os

import pytest
import torch

import psframe
from psframe.ps.serving.shared_store import SharedStore, publish_store
from psframe.ps.serving.store_memory import SharedStoreMemory
from psframe.ps.store import VariableStore


@pytest.fixture
def memory():
    shared = SharedStore.create(num_workers=2)
    yield shared
    shared.close()


def _store(shared: SharedStore) -> VariableStore:
    return VariableStore(
        "/job:ps/task:0", lock=shared.lock, counters=shared.counters, memory=SharedStoreMemory(shared.allocate)
    )


def test_a_published_model_is_the_same_memory_in_every_view(memory):
    owner = _store(memory)
    owner.create({"w": torch.arange(4.0), "b": torch.zeros(())}, psframe.optim.Adam(lr=0.5))
    assert publish_store(memory, owner, "/job:ps/task:0") is None  # no optimizer state before an update
    owner.apply({"w": torch.ones(4), "b": torch.ones(())})
    assert publish_store(memory, owner, "/job:ps/task:0") is True and memory.version == 1
    other = VariableStore("/job:ps/task:0", lock=memory.lock, counters=memory.counters)
    other.attach_shared(*SharedStore.attach(memory.folder, 2).load())
    other.apply({"w": torch.ones(4), "b": torch.ones(())})  # the second Adam step, through the other view
    reference = [torch.arange(4.0).requires_grad_(True), torch.zeros(()).requires_grad_(True)]
    local = torch.optim.Adam(reference, lr=0.5)
    for _ in range(2):
        for r in reference:
            r.grad = torch.ones_like(r)
        local.step()
    assert torch.equal(owner.read(["w"])[0], reference[0].detach())
    assert owner.pushes == other.pushes == 2


def test_state_that_is_not_a_tensor_is_never_published(memory):
    store = _store(memory)
    store.create({"w": torch.zeros(3)}, psframe.optim.SGD(lr=0.1, momentum=0.9))
    store.apply({"w": torch.ones(3)})
    with store.lock:
        store._model.state_of("w")["calls"] = 1  # as an optimizer with a Python counter would
    assert publish_store(memory, store, "/job:ps/task:0") is False and memory.version == 0


def test_initial_values_are_copied_into_shared_memory_once(memory):
    store = _store(memory)
    made = []
    allocate = store._memory.allocate
    store._memory.allocate = lambda dtype, shape: made.append(allocate(dtype, shape)) or made[-1]
    value = store.copy_in(torch.arange(6.0))  # what the service keeps of an Init request
    store.create({"w": value}, psframe.optim.SGD(lr=0.1), copy=False)
    assert len(made) == 1 and store.read(["w"])[0].data_ptr() == made[0].data_ptr()
    assert torch.equal(store.read(["w"])[0], torch.arange(6.0))


def test_moving_the_state_to_shared_memory_keeps_its_values(memory):
    store = _store(memory)
    store.create({"w": torch.zeros(5)}, psframe.optim.Adam(lr=0.5))
    store.apply({"w": torch.ones(5)})
    before = {k: v.clone() for k, v in store.optimizer_state()["w"].items() if isinstance(v, torch.Tensor)}
    store.share_state()
    after = store.optimizer_state()["w"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    folder_bytes = sum(os.path.getsize(os.path.join(memory.folder, f)) for f in os.listdir(memory.folder))
    assert folder_bytes >= sum(v.nbytes for v in after.values() if isinstance(v, torch.Tensor) and v.dim())


def test_state_goes_to_shared_memory_at_each_variables_first_step(memory):
    """Torch makes a variable's state at its first step: it moves to shared memory then, one
    variable at a time, so a task never holds the whole model's state privately first."""
    shared, private = _store(memory), VariableStore("/job:ps/task:0")
    for store in (shared, private):
        store.create({"a": torch.zeros(5), "b": torch.zeros(3)}, psframe.optim.SGD(lr=0.5, momentum=0.9))
        store.apply({"a": torch.ones(5)})
    momentum = shared._model.state_of("a")["momentum_buffer"]
    assert momentum.is_shared() and shared.optimizer_state() is None  # "b" has no state yet
    for store in (shared, private):
        store.apply({"a": torch.full((5,), 2.0), "b": torch.ones(3)})
    state = shared.optimizer_state()
    assert all(v["momentum_buffer"].is_shared() for v in state.values())
    assert state["a"]["momentum_buffer"].data_ptr() == momentum.data_ptr()  # moved once, then updated in place
    expected = private.optimizer_state()
    assert all(torch.equal(state[n]["momentum_buffer"], expected[n]["momentum_buffer"]) for n in ("a", "b"))
    assert all(torch.equal(x, y) for x, y in zip(shared.read(["a", "b"]), private.read(["a", "b"])))
    shared.share_state()  # nothing left to move
    assert shared.optimizer_state()["a"]["momentum_buffer"].data_ptr() == momentum.data_ptr()


def _published_with_a_table(
    memory: SharedStore, dense: dict[str, torch.Tensor] | None = None
) -> tuple[VariableStore, VariableStore]:
    """The owner's store of a table "emb" (6 x 2, Adagrad) and ``dense`` variables (Adagrad), each
    stepped once and published, and another process's view of it."""
    owner = _store(memory)
    dense = dense or {}
    owner.create(
        {"emb": torch.zeros(6, 2), **dense},
        psframe.optim.Adagrad(lr=1.0),
        tables=["emb"],
        table_optimizer=psframe.optim.Adagrad(lr=1.0),
    )
    owner.apply_rows([("emb", torch.tensor([0]), torch.ones(1, 2))])  # the table's state is made
    if dense:
        owner.apply({name: torch.ones_like(value) for name, value in dense.items()})  # and the dense ones'
    assert publish_store(memory, owner, "/job:ps/task:0") is True
    other = VariableStore("/job:ps/task:0", lock=memory.lock, counters=memory.counters)
    other.attach_shared(*SharedStore.attach(memory.folder, 2).load())
    return owner, other


def test_a_table_row_updated_through_one_view_moves_its_version_in_every_view(memory):
    """Deltas and a re-layout's precopy may be taken by any of the task's processes: the rows'
    versions, and the count they are stamped from, are one across them."""
    owner, other = _published_with_a_table(memory)
    ids = torch.tensor([1, 2, 3])
    before = owner.row_versions()["emb"][ids].clone()
    other.apply_rows([("emb", torch.tensor([2]), torch.ones(1, 2))])
    now = owner.row_versions()["emb"][ids].clone()
    assert (now > before).tolist() == [False, True, False]
    owner.apply_rows([("emb", torch.tensor([3]), torch.ones(1, 2))])
    later = other.row_versions()["emb"][ids].clone()
    assert (later > now).tolist() == [False, False, True]


def test_a_delta_holds_the_table_rows_any_view_changed_and_the_dense_variables_whole(memory):
    owner, other = _published_with_a_table(memory, {"w": torch.zeros(3)})
    owner.mark_snapshot(10)
    other.apply_rows([("emb", torch.tensor([4, 1]), torch.ones(2, 2))])
    changes = owner.changes_since(10)
    ids, values, _ = changes.rows["emb"]
    assert ids.tolist() == [1, 4] and torch.equal(values, other.read_rows("emb", torch.tensor([1, 4])))
    assert list(changes.values) == ["w"]  # another process's dense updates are not seen here: held whole


def test_a_stateless_dense_optimizer_beside_a_stateful_table_one_is_published(memory):
    """Plain SGD makes no state for the dense variables; Adagrad makes the tables': the
    model is shared once both groups stepped, not never."""
    owner = _store(memory)
    owner.create(
        {"emb": torch.zeros(6, 2), "w": torch.zeros(3)},
        psframe.optim.SGD(lr=1.0),
        tables=["emb"],
        table_optimizer=psframe.optim.Adagrad(lr=1.0),
    )
    owner.apply_rows([("emb", torch.tensor([0]), torch.ones(1, 2))])
    assert publish_store(memory, owner, "/job:ps/task:0") is None  # the dense group has not stepped
    owner.apply({"w": torch.ones(3)})
    assert publish_store(memory, owner, "/job:ps/task:0") is True
