"""Dynamic tables' admission (by count or by chance) and eviction by norm, and the counts of both.

A table that admits by count gives an id a row only once it was looked up
for training ``admit_after`` times; until then the id reads as its initial
row, its gradients are dropped, and it takes no memory. A row an update
leaves below ``min_norm`` is evicted. Each part counts the ids it admitted,
filtered and evicted; ``status`` and checkpoints carry the counts.

This file holds the unit tier's tests of the subject; `tests/service/test_admission.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.errors import PsframeError
from psframe.tables.admission import AdmissionFilter
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.row_math import initial_rows
from psframe.tables.spec import Admission, DynamicTableSpec, Eviction, RowInitializer
from psframe.wire import messages

DIM = 4
INIT = RowInitializer(std=0.3, seed=7)
VOCABULARY = torch.arange(40, dtype=torch.int64) * 7919 - 2**40


def spec(admission: Admission | None = None, **eviction) -> DynamicTableSpec:
    return DynamicTableSpec(INIT, Eviction(**eviction), admission or Admission())


def part(admission: Admission | None = None, **eviction) -> DynamicRows:
    return DynamicRows("t", (DIM,), torch.float32, spec(admission, **eviction), psframe.optim.SGD(lr=0.5))


def initial(ids: torch.Tensor) -> torch.Tensor:
    return initial_rows(INIT, ids, (DIM,), torch.float32)


# ---- the filter


def test_an_id_is_admitted_on_its_nth_lookup_counting_repeats_within_one():
    admission = AdmissionFilter(Admission(min_count=3, counters=1 << 10))
    ids = torch.tensor([11, 22, 33])
    assert admission.admit(ids, torch.tensor([1, 2, 3])).tolist() == [False, False, True]
    assert admission.admit(ids[:2], torch.tensor([1, 1])).tolist() == [False, True]
    assert admission.admit(ids[:1], torch.tensor([1])).tolist() == [True]


def test_shared_counters_never_admit_an_id_late():
    """A filter too small for its ids overestimates counts: it may admit an id early, never late."""
    admission = AdmissionFilter(Admission(min_count=4, counters=64))
    heavy = torch.arange(30, dtype=torch.int64) * 104729
    for _ in range(4):
        admission.admit(heavy, torch.ones(30, dtype=torch.int64))
    fresh = torch.arange(1, 2001, dtype=torch.int64) * -7919
    admitted_at = torch.full((2000,), -1)
    for sighting in range(4):
        admitted = admission.admit(fresh, torch.ones(2000, dtype=torch.int64))
        admitted_at[(admitted_at < 0) & admitted] = sighting
    assert bool((admitted_at >= 0).all())  # every id by its fourth sighting
    assert int((admitted_at == 0).sum()) > 0  # some at once: their counters are the heavy ids'


def test_admission_by_chance_is_reproducible_and_near_its_probability():
    ids = torch.arange(4000, dtype=torch.int64)
    ones = torch.ones(4000, dtype=torch.int64)
    first = AdmissionFilter(Admission(probability=0.25), seed=3).admit(ids, ones)
    again = AdmissionFilter(Admission(probability=0.25), seed=3).admit(ids, ones)
    other = AdmissionFilter(Admission(probability=0.25), seed=4).admit(ids, ones)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert 0.2 < float(first.float().mean()) < 0.3


# ---- a part


def test_ids_not_admitted_read_as_initial_rows_drop_their_gradients_and_take_no_memory():
    table = part(Admission(min_count=2, counters=1 << 10))
    ids = torch.tensor([5, 6, 6])  # 6 is seen twice in this lookup: admitted at once
    rows = table.read(ids)
    assert torch.equal(rows, initial(ids)) and len(table) == 1
    slots, nbytes = table.slots, table.nbytes()
    table.apply(ids, torch.ones(3, DIM))  # 5's gradient is dropped; 6's two are summed
    assert len(table) == 1 and table.slots == slots and table.nbytes() == nbytes
    rows = table.read(ids)  # 5's second lookup admits it, with its initial row
    assert torch.equal(rows[0], initial(ids[:1])[0])
    assert torch.equal(rows[1], initial(ids[1:2])[0] - 0.5 * 2)
    assert len(table) == 2
    assert table.counts() == {"admitted": 2, "filtered": 1, "evicted": 0}


def test_an_evaluation_s_lookup_counts_nothing_towards_admission():
    table = part(Admission(min_count=2, counters=1 << 10))
    for _ in range(3):
        table.read(torch.tensor([9]), create=False)
    table.read(torch.tensor([9]))
    assert len(table) == 0 and table.counts()["filtered"] == 1


def test_rows_an_update_leaves_below_the_norm_are_evicted_and_come_back_fresh():
    table = part(min_norm=0.5)
    ids = torch.tensor([1, 2])
    rows = table.read(ids)
    # Push row 1 to (nearly) zero: its gradient is its row over the learning rate.
    table.apply(ids[:1], rows[:1] / 0.5)
    assert len(table) == 1 and table.counts()["evicted"] == 1
    assert torch.equal(table.read(ids[:1]), initial(ids[:1]))  # made anew from the initializer
    assert table.counts() == {"admitted": 3, "filtered": 0, "evicted": 1}


def test_counts_and_admission_counters_survive_a_checkpoint():
    admission = Admission(min_count=2, counters=1 << 10)
    table = part(admission, max_rows=3)
    table.read(torch.tensor([1, 2, 1, 2]))
    table.read(torch.tensor([3, 4, 3, 4]))  # all four admitted; the cap evicts one
    table.read(torch.tensor([50]))  # seen once: not admitted yet
    saved = table.export()
    assert saved["counts"] == {"admitted": 4, "filtered": 1, "evicted": 1}
    restored = part(admission, max_rows=3)
    restored.load(saved)
    assert restored.counts() == table.counts()
    restored.read(torch.tensor([50]))  # its second lookup: admitted, the first remembered
    assert 50 in restored.export()["ids"].tolist()


def test_admission_by_chance_continues_the_same_draws_after_a_restore():
    admission = Admission(probability=0.5)
    table, ids = part(admission), torch.arange(100, dtype=torch.int64)
    table.read(ids[:50])
    restored = part(admission)
    restored.load(table.export())
    table.read(ids[50:])
    restored.read(ids[50:])
    assert torch.equal(table.export()["ids"], restored.export()["ids"])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_count": 0}, "min_count must be an int from 1 to 255"),
        ({"min_count": 256}, "min_count must be an int from 1 to 255"),
        ({"min_count": True}, "min_count must be an int from 1 to 255"),
        ({"probability": 0}, r"probability must be a number in \(0, 1\]"),
        ({"probability": 1.5}, r"probability must be a number in \(0, 1\]"),
        ({"probability": float("nan")}, r"probability must be a number in \(0, 1\]"),
        ({"min_count": 2, "probability": 0.5}, "by count or by probability, not both"),
        ({"counters": 1000}, "counters must be a power of two >= 64"),
        ({"counters": 32}, "counters must be a power of two >= 64"),
    ],
)
def test_a_bad_admission_is_refused(kwargs, message):
    with pytest.raises(PsframeError, match=message):
        Admission(**kwargs)


@pytest.mark.parametrize("min_norm", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_a_bad_min_norm_is_refused(min_norm):
    with pytest.raises(PsframeError, match="min_norm must be a finite number > 0"):
        Eviction(min_norm=min_norm)


def test_admission_and_min_norm_travel_in_the_table_s_definition():
    full = spec(Admission(min_count=5, counters=1 << 12), min_norm=0.01, ttl_seconds=60.0)
    assert messages.dynamic_spec(messages.dynamic_def(full)) == full
    chance = spec(Admission(probability=0.1))
    assert messages.dynamic_spec(messages.dynamic_def(chance)) == chance
    # A definition from before admission (fields 0) means the defaults.
    old = messages.dynamic_def(spec())
    for field in ("min_norm", "admit_after", "admit_probability", "admission_counters"):
        old.ClearField(field)
    assert messages.dynamic_spec(old) == spec()


def test_a_dynamic_embedding_takes_admission_and_norm_settings():
    table = psframe.DynamicEmbedding(DIM, admit_after=3, admission_counters=1 << 12, min_norm=0.1)
    assert table.spec.admission == Admission(min_count=3, counters=1 << 12)
    assert table.spec.eviction.min_norm == 0.1
    with pytest.raises(PsframeError, match="min_count"):
        psframe.DynamicEmbedding(DIM, admit_after=0)


# ---- on ps tasks


def batch(step: int, size: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    positions = (torch.rand(size, 3, generator=g) ** 2 * len(VOCABULARY)).long()
    return VOCABULARY[positions], torch.rand(size, generator=g)


def table(**settings) -> psframe.DynamicEmbedding:
    return psframe.DynamicEmbedding(DIM, initializer=INIT, **settings)
