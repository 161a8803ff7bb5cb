"""Large tensors of a ps task and of a worker's tables are advised onto transparent huge pages.

What the advice leaves is read from ``/proc/self/smaps``: the mapping that
holds a tensor says ``THPeligible: 1`` once it is advised (in the kernel's
``madvise`` mode, a mapping is eligible only then). Whether the kernel then
found free huge pages is its business, so no test counts them.

This file holds the unit tier's tests of the subject; `tests/service/test_huge_pages.py`,
`tests/cluster/test_huge_pages.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.memory import HugePageMemory, huge_pages
from psframe.ps.store import VariableStore
from psframe.ps.store.table_parts import DynamicPart

ROWS = huge_pages.MIN_BYTES // (64 * 4)  # a 64-wide float32 table of exactly MIN_BYTES


def thp_mode() -> str:
    try:
        with open(huge_pages.THP_SETTING) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


needs_madvise_mode = pytest.mark.skipif(
    thp_mode() != "madvise",
    reason=f"transparent huge pages are {thp_mode()!r} here, not 'madvise': eligibility then does not show the advice",
)


def eligible(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding the middle of ``tensor``'s memory may get huge pages."""
    address = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds address {address:#x}")


def on_small_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, its memory advised off huge pages (MADV_NOHUGEPAGE): memory freed by
    an earlier test may lie in a mapping that was advised, and keep the advice."""
    start = -(-tensor.untyped_storage().data_ptr() // 4096) * 4096
    end = (tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes()) // 4096 * 4096
    assert huge_pages._madvise()(start, end - start, 15) == 0
    assert not eligible(tensor)
    return tensor


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    monkeypatch.delenv(huge_pages.OPT_OUT_VARIABLE, raising=False)
    huge_pages._madvise.cache_clear()
    yield
    huge_pages._madvise.cache_clear()


@needs_madvise_mode
def test_a_large_tensor_is_advised_before_its_first_touch_and_a_small_one_never():
    large = huge_pages.full((ROWS, 64), 1.5, torch.float32)
    assert eligible(large) and torch.all(large == 1.5)
    small = on_small_pages(torch.empty((ROWS // 4, 64)))  # 8 MiB: would round up to whole huge pages
    huge_pages.back([small])
    assert not eligible(small)
    copied = huge_pages.copy(large.t())  # not contiguous in, contiguous out
    assert copied.is_contiguous() and torch.equal(copied, large.t()) and eligible(copied)


@needs_madvise_mode
def test_back_moves_a_touched_tensor_in_place():
    tensor = on_small_pages(torch.randn(ROWS, 64))
    before, address = tensor.clone(), tensor.data_ptr()
    huge_pages.back([tensor, "not a tensor", torch.zeros(3)])
    assert eligible(tensor) and tensor.data_ptr() == address and torch.equal(tensor, before)


@needs_madvise_mode
def test_a_ps_store_keeps_a_large_table_and_its_optimizer_state_on_huge_pages():
    store = VariableStore("/job:ps/task:0", memory=HugePageMemory())  # what a ps task's service gives
    table = torch.randn(ROWS, 64)
    store.create(
        {"emb": table},
        psframe.optim.SGD(lr=0.1),
        tables=["emb"],
        table_optimizer=psframe.optim.Adagrad(lr=0.1, initial_accumulator_value=0.5).for_tables(),
    )
    variable = store.read(["emb"])[0]
    assert eligible(variable) and torch.equal(variable, table)
    store.apply_rows([("emb", torch.tensor([3, 3, 7]), torch.ones(3, 64))])
    state = store.optimizer_state()["emb"]["sum"]
    assert eligible(state)
    assert torch.all(state[3] == 4.5) and torch.all(state[7] == 1.5) and torch.all(state[0] == 0.5)


@needs_madvise_mode
def test_lazy_optimizer_state_and_grown_dynamic_rows_are_on_huge_pages():
    store = VariableStore("/job:ps/task:0", memory=HugePageMemory())  # what a ps task's service gives
    spec = psframe.DynamicEmbedding(64).spec
    store.create(
        {"emb": torch.zeros(ROWS, 64)},
        psframe.optim.SGD(lr=0.1),
        tables=["emb"],
        table_optimizer=psframe.optim.Adam(lr=0.1).for_tables(),
        dynamic={"users/part_0": DynamicPart(spec, (64,), torch.float32)},
    )
    assert store.optimizer_state() is None  # SparseAdam makes its state at the first step
    store.apply_rows(
        [("emb", torch.tensor([1]), torch.ones(1, 64)), ("users/part_0", torch.arange(ROWS), torch.ones(ROWS, 64))]
    )
    assert all(eligible(x) for x in store.optimizer_state()["emb"].values() if torch.is_tensor(x))
    part = store._model.table_parts.dynamic_rows("users/part_0")
    assert part.slots >= ROWS and eligible(part.weight)
    assert all(eligible(x) for x in part.optimizer.state[part.weight].values() if torch.is_tensor(x))


@needs_madvise_mode
def test_a_large_dense_variables_state_made_at_a_later_step_is_on_huge_pages():
    store = VariableStore("/job:ps/task:0", memory=HugePageMemory())  # what a ps task's service gives
    store.create({"small": torch.zeros(4), "big": torch.zeros(ROWS, 64)}, psframe.optim.SGD(lr=0.1, momentum=0.9))
    store.apply({"small": torch.ones(4)})  # the optimizer's first step: "big" has no state yet
    store.apply({"big": torch.ones(ROWS, 64)})
    buffer = store.optimizer_state()["big"]["momentum_buffer"]
    assert eligible(buffer) and torch.all(buffer == 1.0)
