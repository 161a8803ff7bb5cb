"""Delta checkpoints: only what changed since the last checkpoint, and chains of them on a full one.

The oracle: a full checkpoint followed by deltas restores, bit for bit, what
a full checkpoint taken at the same instant holds — dense variables, fixed
and dynamic tables, optimizer state, ages, counts and pushes — with rows
made and evicted in between.

This file holds the unit tier's tests of the subject; `tests/service/test_delta_checkpoints.py`
holds the other tiers'.
"""

from __future__ import annotations

import pytest

import psframe


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="delta_steps or delta_secs, not both"):
        psframe.Checkpointing("d", delta_steps=2, delta_secs=1.0)
    with pytest.raises(ValueError, match="delta_steps"):
        psframe.Checkpointing("d", delta_steps=0)
    with pytest.raises(ValueError, match="delta_secs must be a finite number"):
        psframe.Checkpointing("d", delta_secs=float("inf"))


def test_the_ledger_holds_pushes_until_each_worker_reaches_its_target():
    from psframe.ps.protocol.ledger import PushLedger

    ledger = PushLedger(2)
    ledger.record(0, 1, ends_step=True)
    ledger.record(1, 1, ends_step=False)  # worker 1 has begun its first step here
    assert ledger.admits(0) and not ledger.held()
    assert ledger.hold(60.0) == [1, 1] and ledger.held()
    assert not ledger.admits(0) and not ledger.admits(1)
    ledger.set_targets([1, 1])  # another ps task had begun nothing more
    assert not ledger.admits(0) and ledger.admits(1) and not ledger.reached()
    ledger.record(1, 2, ends_step=True)  # the rest of worker 1's step
    assert ledger.reached() and not ledger.admits(1)
    ledger.release()
    assert ledger.admits(0) and ledger.admits(1) and not ledger.held()
    # A hold past its deadline holds nothing: a chief lost between hold and save stalls no one.
    ledger.hold(0.0)
    assert not ledger.held() and ledger.admits(0) and ledger.admits(1)
