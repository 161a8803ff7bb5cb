"""Serving snapshots and updates (psframe.export): from real checkpoints, through safetensors files, and the CLI.

The oracle of a snapshot is :func:`psframe.checkpoint.load` of the same
checkpoint; the oracle of an update chain is the export of the checkpoint it
ends at. Bit for bit in both cases.

This file holds the service tier's tests of the subject; `tests/unit/test_export.py`,
`tests/cluster/test_export.py` hold the other tiers'.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import psframe.checkpoint
from psframe.export import apply_update, diff_snapshots, export_checkpoint, read_snapshot, read_update, write_update
from tests.unit.test_export import (  # noqa: F401
    DIM,
    MAX_ROWS,
    SAVE_EVERY,
    TRAIN_STEPS,
    Feed,
    Run,
    assert_same,
    batch,
    run_cli,
    trained,
)


@pytest.mark.service
def test_a_snapshot_of_a_real_run_is_what_checkpoint_load_reads_without_optimizer_state(trained):
    assert len(trained.steps) == TRAIN_STEPS // SAVE_EVERY
    for step in trained.steps:
        snapshot = export_checkpoint(trained.checkpoint_dir, step)
        loaded = psframe.checkpoint.load(trained.checkpoint_dir, step)
        assert snapshot.step == step
        assert sorted(snapshot.dense) == ["head.bias", "head.weight", "items.weight"]
        assert snapshot.dense["items.weight"].shape == (10, DIM)  # the fixed table whole, from both ps tasks
        for name, value in snapshot.dense.items():
            assert torch.equal(value, loaded[name]), name
        assert list(snapshot.tables) == ["users"]
        assert torch.equal(snapshot.tables["users"].ids, loaded["users.ids"])
        assert torch.equal(snapshot.tables["users"].rows, loaded["users.rows"])
    # Rows were evicted: the latest snapshot holds at most the caps of both ps tasks, fewer than were seen.
    latest = export_checkpoint(trained.checkpoint_dir)
    assert latest.step == trained.steps[-1]
    assert 0 < len(latest.tables["users"]) <= 2 * MAX_ROWS < trained.users_seen


@pytest.mark.service
def test_updates_between_checkpoints_keep_a_snapshot_equal_to_the_latest_export(trained, tmp_path):
    current = export_checkpoint(trained.checkpoint_dir, trained.steps[0])
    made = deleted = 0
    for k, step in enumerate(trained.steps[1:]):
        newer = export_checkpoint(trained.checkpoint_dir, step)
        update = diff_snapshots(current, newer)
        assert (update.base_step, update.step) == (current.step, step)
        change = update.tables["users"]
        made += int((~torch.isin(change.upsert.ids, current.tables["users"].ids)).sum())
        deleted += change.delete.numel()
        write_update(update, str(tmp_path / f"update-{k}.safetensors"))
        current = apply_update(current, read_update(str(tmp_path / f"update-{k}.safetensors")))
        assert_same(current, newer)
    assert made > 0 and deleted > 0, "the run should make and evict rows between checkpoints"
    assert_same(current, export_checkpoint(trained.checkpoint_dir))


@pytest.mark.service
def test_the_row_norm_filter_on_a_real_run_keeps_exactly_the_rows_at_or_above_it(trained):
    whole = export_checkpoint(trained.checkpoint_dir).tables["users"]
    norms = whole.rows.norm(dim=1)
    threshold = float(norms.median())
    kept = export_checkpoint(trained.checkpoint_dir, min_row_norm=threshold).tables["users"]
    assert torch.equal(kept.ids, whole.ids[norms >= threshold])
    assert 0 < len(kept) < len(whole)
    # Every row was seen during the run: all are younger than an hour now, and none will be in a day.
    later = export_checkpoint(trained.checkpoint_dir, max_row_age_seconds=3600.0).tables["users"]
    assert torch.equal(later.ids, whole.ids)
    gone = export_checkpoint(trained.checkpoint_dir, max_row_age_seconds=3600.0, now=time.time() + 86400.0)
    assert len(gone.tables["users"]) == 0 and gone.tables["users"].rows.shape == (0, DIM)


@pytest.mark.service
def test_the_cli_exports_a_snapshot_an_update_and_applies_updates(trained, tmp_path, capsys):
    first, last = trained.steps[0], trained.steps[-1]
    base, update, new = (str(tmp_path / name) for name in ("base.safetensors", "update.safetensors", "new"))
    code, out, _ = run_cli(capsys, trained.checkpoint_dir, base, "--step", str(first))
    assert code == 0 and f"wrote the snapshot of step {first} to {base} (3 dense variables" in out
    assert_same(read_snapshot(base), export_checkpoint(trained.checkpoint_dir, first))

    code, out, _ = run_cli(capsys, "--update_from", base, trained.checkpoint_dir, update)
    assert code == 0 and f"wrote the update from step {first} to step {last} to {update}" in out
    code, out, _ = run_cli(capsys, "--apply", base, update, "--out", new)
    assert code == 0 and f"wrote the snapshot of step {last} to {new} (1 updates applied)" in out
    assert_same(read_snapshot(new), export_checkpoint(trained.checkpoint_dir))

    small = str(tmp_path / "int8")
    code, _, _ = run_cli(capsys, trained.checkpoint_dir, small, "--int8_rows")
    whole, int8 = export_checkpoint(trained.checkpoint_dir).tables["users"], read_snapshot(small).tables["users"]
    assert code == 0 and int8.rows.dtype == torch.int8 and torch.equal(int8.ids, whole.ids)
    assert bool(((int8.values() - whole.rows).abs() <= int8.scales[:, None] / 2 + 1e-6).all())

    filtered = str(tmp_path / "filtered")
    code, _, _ = run_cli(capsys, trained.checkpoint_dir, filtered, "--min_row_norm", "1e9")
    assert code == 0 and len(read_snapshot(filtered).tables["users"]) == 0

    # Failures: one line naming what is wrong, exit code 1, nothing written.
    for argv, message in (
        ([trained.checkpoint_dir, str(tmp_path / "x"), "--step", "999"], "no committed checkpoint of step 999 in"),
        (["--apply", new, update, "--out", str(tmp_path / "x")], f"{update}: the update goes from step {first}"),
        (["--apply", base, update], r"--apply takes SNAPSHOT UPDATE\.\.\. \(in order\) and --out NEW"),
        (["--apply", base, update, "--out", str(tmp_path / "x"), "--step", "3"], "--apply takes no --step"),
        ([trained.checkpoint_dir], "give CHECKPOINT_DIR OUT"),
        (["--update_from", update, trained.checkpoint_dir, str(tmp_path / "x")], "is a psframe-update file, not a"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1, argv
        assert err.startswith("psframe export: error: ") and err.count("\n") == 1, err
        assert re.search(message, err), err
    assert not (tmp_path / "x").exists()
