"""A store made anew after a re-layout's cut takes over the optimizers of the model it let go of.

The oracle: a store that takes over steps exactly as one built afresh over copies of the same
values and state (the same bits), and the parts it kept are the same memory as before, their
state never rebuilt.
"""

from __future__ import annotations

import pytest
import torch

from psframe import optim
from psframe.errors import UnknownVariableError
from psframe.optim import OptimizerSpec
from psframe.ps.store import VariableStore

OPTIMIZERS = {
    "adam": optim.Adam(lr=0.01),
    "sgd_momentum": optim.SGD(lr=0.1, momentum=0.9),
    "adagrad": optim.Adagrad(lr=0.1),
}


def _trained(spec: OptimizerSpec, names: list[str], steps: int = 3) -> VariableStore:
    """A store of ``names`` (vectors of 1,000 floats, fixed values), stepped a few times."""
    store = VariableStore("ps 0")
    store.create({n: torch.linspace(k, k + 1, 1000) for k, n in enumerate(names)}, spec)
    for step in range(steps):
        store.apply({n: torch.full((1000,), 0.1 * (step + 1) * (k + 1)) for k, n in enumerate(names)})
    return store


def _step_both(a: VariableStore, b: VariableStore, names: list[str]) -> None:
    for step in range(3):
        grads = {n: torch.sin(torch.arange(1000.0) * (k + 1) + step) for k, n in enumerate(names)}
        a.apply(grads)
        b.apply(grads)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parts_kept_moved_and_new_step_as_a_store_built_afresh(name):
    spec = OPTIMIZERS[name]
    store = _trained(spec, ["kept", "gone"])
    arriving = _trained(spec, ["arrives"])  # another task's part, which moves here
    _, values, states = store.snapshot(copy=False)  # the cut's snapshot: the store's own tensors
    _, moved_values, moved_states = arriving.snapshot()
    kept_state = {k: x.data_ptr() for k, x in states["kept"].items() if isinstance(x, torch.Tensor)}
    optimizer = store._model.dense.optimizer
    store.clear()
    new_values = {"kept": values["kept"], "arrives": moved_values["arrives"]}
    new_states = {"kept": states["kept"], "arrives": moved_states["arrives"]}
    afresh = VariableStore("ps 0 afresh")
    afresh.create({n: v.clone() for n, v in new_values.items()}, spec)
    afresh.restore(
        {},
        {n: {k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in s.items()} for n, s in new_states.items()},
        3,
    )

    store.create(new_values, spec, copy=False)
    store.restore({}, new_states, 3, copy=False)

    assert store._model.dense.optimizer is optimizer  # taken over, not built over every part again
    held = store.optimizer_state()
    assert held is not None
    assert {k: x.data_ptr() for k, x in held["kept"].items() if isinstance(x, torch.Tensor)} == kept_state
    assert store.names == ["kept", "arrives"]
    _step_both(store, afresh, ["kept", "arrives"])
    _, ours, our_states = store.snapshot()
    _, theirs, their_states = afresh.snapshot()
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n
        for k, x in our_states[n].items():
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(their_states[n][k])), (n, k)


def test_a_part_that_went_leaves_the_optimizer_with_its_state():
    store = _trained(optim.Adam(lr=0.01), ["kept", "gone"])
    _, values, states = store.snapshot(copy=False)
    gone = values["gone"].clone()
    store.clear()
    store.create({"kept": values["kept"]}, optim.Adam(lr=0.01), copy=False)
    store.restore({}, {"kept": states["kept"]}, 3, copy=False)
    store.apply({"kept": torch.ones(1000)})
    assert store.names == ["kept"]
    assert set(store.optimizer_state() or {}) == {"kept"}
    assert torch.equal(values["gone"], gone)  # the snapshot's part, handed over elsewhere, unchanged
    with pytest.raises(UnknownVariableError, match="gone"):
        store.apply({"gone": torch.ones(1000)})


def test_another_optimizer_builds_anew():
    store = _trained(optim.Adam(lr=0.01), ["kept"])
    _, values, _ = store.snapshot(copy=False)
    store.clear()
    store.create({"kept": values["kept"]}, optim.SGD(lr=0.1), copy=False)
    store.apply({"kept": torch.ones(1000)})
    assert store.optimizer_state() == {"kept": {}}  # plain SGD: none of Adam's state carried over


def test_a_copy_is_never_taken_for_the_variable_it_copies():
    store = _trained(optim.SGD(lr=0.1, momentum=0.9), ["w"])
    _, values, _ = store.snapshot(copy=False)
    before = values["w"].clone()
    store.clear()
    store.create({"w": values["w"].clone()}, optim.SGD(lr=0.1, momentum=0.9), copy=False)
    store.apply({"w": torch.ones(1000)})
    assert torch.equal(values["w"], before)  # the store runs over its own copy: the old memory is left as it was
