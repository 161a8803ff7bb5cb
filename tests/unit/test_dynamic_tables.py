"""Dynamic embedding tables: any int64 id, a row made on first touch, evicted by a cap or age.

The oracle of training is one process with an ``nn.Embedding(sparse=True)``
over the same ids numbered 0, 1, 2, ... in order of first use, whose rows
start as the dynamic table's initializer makes them: the ps tasks' dynamic
parts must train exactly as that table does.

This file holds the unit tier's tests of the subject; `tests/service/test_dynamic_tables.py` holds
the other tiers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.errors import PsframeError, RowIdError
from psframe.optim import OptimizerSpec
from psframe.optim.rows_kernels import SparseSGD
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.row_math import initial_rows, part_of
from psframe.tables.spec import DynamicTableSpec, Eviction, RowInitializer, dynamic_part

DIM = 4
INIT = RowInitializer(std=0.3, seed=7)
# Hashed-feature ids: huge, negative, clustered; 40 of them, sorted: the reference numbers
# them in the order of the ids, so that coalescing its gradient orders (and sums) repeated
# rows as the worker's does over the ids themselves.
VOCABULARY = torch.sort(
    torch.tensor([(k * 0x9E3779B1 + 12345) * (-1) ** k * 2**20 for k in range(40)], dtype=torch.int64)
).values


class Clicks(torch.nn.Module):
    """One table (dynamic, or an nn.Embedding for the reference) and a dense head."""

    def __init__(self, table: torch.nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(DIM, 1)
        self.users = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids).mean(1)).squeeze(1)


def batch(step: int, size: int = 8):
    """Ids with repeats, skewed to the front of the vocabulary."""
    g = torch.Generator().manual_seed(100 + step)
    positions = (torch.rand(size, 3, generator=g) ** 2 * len(VOCABULARY)).long()
    return VOCABULARY[positions], torch.rand(size, generator=g)


def reference_model():
    """The oracle: an nn.Embedding over the vocabulary's positions, rows made by INIT."""
    table = torch.nn.Embedding(len(VOCABULARY), DIM, sparse=True)
    with torch.no_grad():
        table.weight.copy_(initial_rows(INIT, VOCABULARY, (DIM,), torch.float32))
    return Clicks(table)


def positions_of(ids: torch.Tensor) -> torch.Tensor:
    lookup = {int(v): k for k, v in enumerate(VOCABULARY)}
    return torch.tensor([[lookup[int(i)] for i in row] for row in ids])


def reference_step(reference: Clicks, dense_opt, table_opt, step: int) -> None:
    """One step of the oracle on batch ``step`` (its table's gradient coalesced, as a worker's)."""
    ids, target = batch(step)
    dense_opt.zero_grad()
    table_opt.zero_grad()
    F.mse_loss(reference(positions_of(ids)), target).backward()
    reference.users.weight.grad = reference.users.weight.grad.coalesce()
    dense_opt.step()
    table_opt.step()


CASES = [
    # (table optimizer, the local class and kwargs)
    (psframe.optim.SGD(lr=0.2), (torch.optim.SGD, {"lr": 0.2})),
    (OptimizerSpec("SparseSGD", {"lr": 0.1, "momentum": 0.9}), (SparseSGD, {"lr": 0.1, "momentum": 0.9})),
    (psframe.optim.Adagrad(lr=0.1), (torch.optim.Adagrad, {"lr": 0.1})),
    (OptimizerSpec("SparseAdam", {"lr": 0.05}), (torch.optim.SparseAdam, {"lr": 0.05})),
]


# ---- the rows of one part, without a cluster


def spec(**eviction) -> DynamicTableSpec:
    return DynamicTableSpec(INIT, Eviction(**eviction))


def test_a_row_is_made_on_first_touch_from_the_id_alone():
    part = DynamicRows("t", (DIM,), torch.float32, spec(), psframe.optim.SGD(lr=1.0), slots=2)
    ids = torch.tensor([5, -(2**63), 2**63 - 1, 5])
    rows = part.read(ids)
    assert len(part) == 3 and part.slots == 4  # grew from 2 slots, repeated id made once
    assert torch.equal(rows[0], rows[3])
    alone = initial_rows(INIT, torch.tensor([2**63 - 1]), (DIM,), torch.float32)
    assert torch.equal(rows[2], alone[0])  # the same row whatever came with it
    other_seed = initial_rows(RowInitializer(std=0.3, seed=8), torch.tensor([5]), (DIM,), torch.float32)
    assert not torch.equal(rows[0], other_seed[0])
    # A peek (evaluation) makes nothing.
    peeked = part.read(torch.tensor([99]), create=False)
    assert len(part) == 3 and torch.equal(peeked, initial_rows(INIT, torch.tensor([99]), (DIM,), torch.float32))


def test_growing_keeps_rows_and_optimizer_state():
    part = DynamicRows("t", (DIM,), torch.float32, spec(), psframe.optim.Adagrad(lr=0.1), slots=1)
    first = torch.arange(3)
    part.apply(first, torch.ones(3, DIM))
    before = part.export()
    part.read(torch.arange(100, 200))  # grows to 128 slots
    after = part.export()
    held = torch.isin(after["ids"], first)
    assert torch.equal(after["rows"][held], before["rows"])
    assert torch.equal(after["state"]["sum"][held], before["state"]["sum"])
    assert torch.equal(after["state"]["sum"][~held], torch.zeros(100, DIM))  # new rows' state is fresh


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_capped_part_evicts_by_policy_and_remakes_evicted_rows_fresh(policy):
    part = DynamicRows(
        "t",
        (DIM,),
        torch.float32,
        spec(max_rows=3, policy=policy),
        OptimizerSpec("SparseSGD", {"lr": 0.5, "momentum": 0.9}),
    )
    one = torch.ones(1, DIM)
    part.apply(torch.tensor([1]), one)  # 1: updated at 1
    part.apply(torch.tensor([2]), one)  # 2: updated at 2
    part.apply(torch.tensor([2]), one)  # 2: at 3, twice
    part.apply(torch.tensor([1]), one)  # 1: at 4, twice
    part.apply(torch.tensor([3]), one)  # 3: at 5, once
    part.apply(torch.tensor([4]), one)  # a 4th row: one goes
    gone = {"lru": 2, "lfu": 3}[policy]  # the oldest update, or the fewest (3 and 4 tie: the older)
    kept = set(part.export()["ids"].tolist())
    assert len(kept) == 3 and gone not in kept and 4 in kept
    assert part.evicted == 1
    # Back again: its row starts over from the initializer, its momentum from zero.
    fresh = part.read(torch.tensor([gone]))
    assert torch.equal(fresh[0], initial_rows(INIT, torch.tensor([gone]), (DIM,), torch.float32)[0])
    momentum = part.export()["state"]["momentum_buffer"][part.export()["ids"] == gone]
    assert torch.equal(momentum, torch.zeros(1, DIM))


def test_rows_age_out():
    part = DynamicRows("t", (DIM,), torch.float32, spec(max_age=2), psframe.optim.SGD(lr=0.1))
    part.apply(torch.tensor([1, 2]), torch.ones(2, DIM))
    part.apply(torch.tensor([2]), torch.ones(1, DIM))
    part.apply(torch.tensor([2]), torch.ones(1, DIM))
    assert set(part.export()["ids"].tolist()) == {1, 2}  # 1 last updated 2 updates ago
    part.apply(torch.tensor([2]), torch.ones(1, DIM))
    assert set(part.export()["ids"].tolist()) == {2}


class FakeClock:
    """Wall-clock seconds a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_rows_not_seen_for_the_ttl_are_evicted_and_made_fresh_again():
    clock = FakeClock()
    part = DynamicRows("t", (DIM,), torch.float32, spec(ttl_seconds=80.0), psframe.optim.SGD(lr=0.1), wall_clock=clock)
    part.apply(torch.tensor([1, 2, 3]), torch.ones(3, DIM))
    clock.now += 50
    part.read(torch.tensor([2]))  # a training lookup keeps 2 alive
    part.apply(torch.tensor([3]), torch.ones(1, DIM))  # an update keeps 3 alive
    clock.now += 50  # 1 unseen for 100 s, 2 and 3 for 50 s
    part.read(torch.tensor([3]))
    assert part.export()["ids"].tolist() == [2, 3] and part.evicted == 1
    assert torch.equal(
        part.read(torch.tensor([1]), create=False), initial_rows(INIT, torch.tensor([1]), (DIM,), torch.float32)
    )
    clock.now += 90  # 2 unseen for 140 s, 3 for 90 s
    part.apply(torch.tensor([4]), torch.ones(1, DIM))
    assert part.export()["ids"].tolist() == [4]


def test_an_evaluation_s_lookup_does_not_keep_a_row_alive():
    clock = FakeClock()
    part = DynamicRows("t", (DIM,), torch.float32, spec(ttl_seconds=10.0), psframe.optim.SGD(lr=0.1), wall_clock=clock)
    part.apply(torch.tensor([7, 8]), torch.ones(2, DIM))
    clock.now += 8
    part.read(torch.tensor([7]), create=False)  # a peek: makes nothing, refreshes nothing
    part.read(torch.tensor([8]))
    clock.now += 8
    part.read(torch.tensor([8]))
    assert part.export()["ids"].tolist() == [8]


def test_when_rows_were_seen_survives_a_checkpoint_and_older_checkpoints_start_it_at_the_restore():
    clock = FakeClock()
    make = lambda: DynamicRows(  # noqa: E731
        "t", (DIM,), torch.float32, spec(ttl_seconds=60.0), psframe.optim.SGD(lr=0.1), wall_clock=clock
    )
    part = make()
    part.apply(torch.tensor([1]), torch.ones(1, DIM))
    clock.now += 40
    part.apply(torch.tensor([2]), torch.ones(1, DIM))
    saved = part.export()
    assert saved["seen"].tolist() == [1_000_000.0, 1_000_040.0]
    restored, older = make(), make()
    restored.load(saved)
    older.load({k: v for k, v in saved.items() if k != "seen"})  # written before rows were timed
    clock.now += 30  # 1 unseen for 70 s, 2 for 30 s; restored "now" in the older file: 0 s
    for copy in (restored, older):
        copy.read(torch.tensor([2]))
    assert restored.export()["ids"].tolist() == [2]
    assert older.export()["ids"].tolist() == [1, 2]


@pytest.mark.parametrize("ttl", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_a_bad_ttl_is_refused(ttl):
    with pytest.raises(PsframeError, match="ttl_seconds must be a finite number of seconds > 0"):
        Eviction(ttl_seconds=ttl)


def test_the_ttl_travels_in_the_table_s_definition():
    from psframe.wire import messages

    with_ttl = spec(max_rows=10, policy="lfu", ttl_seconds=3600.0)
    assert messages.dynamic_spec(messages.dynamic_def(with_ttl)) == with_ttl
    assert messages.dynamic_spec(messages.dynamic_def(spec())).eviction.ttl_seconds is None


def test_a_request_needing_more_rows_than_the_cap_changes_nothing():
    part = DynamicRows("t", (DIM,), torch.float32, spec(max_rows=2), psframe.optim.SGD(lr=0.1))
    part.read(torch.tensor([1, 2]))
    before = part.export()
    with pytest.raises(RowIdError, match="'t' keeps at most 2 rows.*raise its max_rows"):
        part.read(torch.tensor([3, 4, 5]))
    after = part.export()
    assert torch.equal(before["ids"], after["ids"]) and torch.equal(before["rows"], after["rows"])


def test_export_and_load_round_trip():
    part = DynamicRows("t", (DIM,), torch.float32, spec(max_rows=50), OptimizerSpec("SparseAdam", {"lr": 0.1}))
    ids = torch.randint(-(2**40), 2**40, (30,))
    part.apply(ids, torch.randn(30, DIM))
    copy = DynamicRows("t", (DIM,), torch.float32, spec(max_rows=50), OptimizerSpec("SparseAdam", {"lr": 0.1}))
    copy.load(part.export())
    part.apply(ids[:5], torch.ones(5, DIM))
    copy.apply(ids[:5], torch.ones(5, DIM))
    a, b = part.export(), copy.export()
    for key in ("ids", "rows", "updated", "updates"):
        assert torch.equal(a[key], b[key]), key
    assert a["clock"] == b["clock"] and torch.equal(a["state"]["exp_avg"], b["state"]["exp_avg"])


def test_parts_spread_patterned_ids_and_agree_with_the_placement():
    ids = torch.arange(0, 40_000) * 1000  # all multiples of 1000
    counts = torch.bincount(part_of(ids, 4), minlength=4)
    assert int(counts.max()) < 1.1 * int(counts.min())
    sample = [0, 1, -1, 2**63 - 1, -(2**63), 123456789]
    assert part_of(torch.tensor(sample), 3).tolist() == [dynamic_part(i, 3) for i in sample]


def test_a_dynamic_embedding_without_rows_says_how_to_train_it():
    with pytest.raises(PsframeError, match="psframe.Trainer.*psframe.DynamicTables"):
        psframe.DynamicEmbedding(DIM)(torch.tensor([1]))
    with pytest.raises(ValueError, match="mode"):
        psframe.DynamicEmbedding(DIM, mode="median")


def test_bad_pushes_and_pulls_of_a_dynamic_table_change_nothing():
    from psframe.errors import DtypeMismatchError, ShapeMismatchError, UnknownVariableError
    from psframe.ps.store import VariableStore
    from psframe.ps.store.table_parts import DynamicPart

    store = VariableStore("/job:ps/task:0")
    store.create(
        {"w": torch.zeros(2)},
        psframe.optim.SGD(lr=0.1),
        table_optimizer=psframe.optim.Adagrad(lr=0.1),
        dynamic={"users/part_0": DynamicPart(spec(), (DIM,), torch.float32)},
    )
    ids = torch.tensor([-5, 2**40])
    store.apply_rows([("users/part_0", ids, torch.ones(2, DIM))])
    before = store.export_dynamic()["users/part_0"]
    bad = [
        ([("users/part_0", ids, torch.ones(2, DIM + 1))], ShapeMismatchError, r"'users/part_0' have shape \(2, 5\)"),
        ([("users/part_0", ids, torch.ones(2, DIM, dtype=torch.float64))], DtypeMismatchError, "float64"),
        ([("users/part_0", ids.int(), torch.ones(2, DIM))], RowIdError, "int64"),
        ([("items/part_0", ids, torch.ones(2, DIM))], UnknownVariableError, "'items/part_0'"),
        # A good table first, a bad one after: the good one is not applied either.
        (
            [("users/part_0", ids, torch.ones(2, DIM)), ("users/part_0", ids[:1], torch.ones(2, DIM))],
            ShapeMismatchError,
            "users/part_0",
        ),
    ]
    for rows, error, message in bad:
        with pytest.raises(error, match=message):
            store.apply_rows(rows)
    with pytest.raises(RowIdError, match="int64"):
        store.read_rows("users/part_0", torch.tensor([1.5]))
    after = store.export_dynamic()["users/part_0"]
    for key in ("ids", "rows", "updated", "updates"):
        assert torch.equal(before[key], after[key]), key
    assert after["clock"] == before["clock"] and store.rejected_pushes == len(bad)


def test_the_id_index_finds_ids_across_merges_and_removals(monkeypatch):
    from psframe.tables.id_index import IdIndex

    monkeypatch.setattr(IdIndex, "MERGE_AT", 8)
    index, expected = IdIndex(), {}
    g = torch.Generator().manual_seed(5)
    for round_ in range(30):
        fresh = torch.unique(torch.randint(-(2**62), 2**62, (5,), generator=g))
        fresh = fresh[~torch.isin(fresh, torch.tensor(list(expected), dtype=torch.int64))]
        slots = torch.arange(fresh.numel()) + 100 * round_
        index.add(fresh, slots)
        expected.update(zip(fresh.tolist(), slots.tolist()))
        if round_ % 3 == 2:  # forget some, old and new
            gone = torch.tensor(list(expected)[::4], dtype=torch.int64)
            index.remove(gone)
            for i in gone.tolist():
                del expected[i]
        asked = torch.cat([torch.tensor(list(expected), dtype=torch.int64), torch.tensor([7, -7, 0])])
        want = [expected.get(i, -1) for i in asked.tolist()]
        assert index.find(asked).tolist() == want and len(index) == len(expected)
    assert index.nbytes() > 0  # merged at least once
