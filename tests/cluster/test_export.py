"""Serving snapshots and updates (psframe.export): from real checkpoints, through safetensors files, and the CLI.

The oracle of a snapshot is :func:`psframe.checkpoint.load` of the same
checkpoint; the oracle of an update chain is the export of the checkpoint it
ends at. Bit for bit in both cases.

This file holds the cluster tier's tests of the subject; `tests/unit/test_export.py`,
`tests/service/test_export.py` hold the other tiers'.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from psframe.export import export_checkpoint, read_snapshot
from tests.conftest import ROOT, psframe_command
from tests.unit.test_export import SAVE_EVERY, SUBPROCESS_TIMEOUT_S, TRAIN_STEPS, Feed, Run, assert_same, batch, trained  # noqa: F401


@pytest.mark.cluster
def test_psframe_export_runs_as_a_command(trained, tmp_path):
    out = tmp_path / "snapshot.safetensors"
    done = subprocess.run(
        psframe_command("export", trained.checkpoint_dir, str(out), "--max_row_age_seconds", "86400"),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote the snapshot of step {trained.steps[-1]}" in done.stdout
    assert_same(read_snapshot(str(out)), export_checkpoint(trained.checkpoint_dir))
    # The file is safetensors with its checksum in the header, for any reader.
    data = out.read_bytes()
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size])["__metadata__"]
    assert metadata["sha256"] == hashlib.sha256(data[8 + size :]).hexdigest()
