"""The ``psframe`` command starts without importing torch where it needs none.

``psframe --version``, ``--help``, a command's ``--help``, ``psframe status``
and ``psframe ping`` (which only ask tasks over gRPC) run in a fresh Python, and
torch must not be among its modules when they are done: importing torch is
most of the start-up time of a process (seconds on a busy machine).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import psframe
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster  # each test runs a fresh Python

# Runs the command with the arguments given, then prints the exit code and whether torch was loaded.
PROGRAM = """
import sys
from psframe.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # --version and --help exit through argparse
    code = e.code
print("exit", code, "torch", "torch" in sys.modules)
"""


def run_command(*argv: str) -> tuple[int, bool, str]:
    """The command's exit code, whether it imported torch, and its output."""
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    )
    *output, last = done.stdout.strip().splitlines()
    _, code, _, loaded = last.split()
    return int(code), loaded == "True", "\n".join(output)


@pytest.mark.parametrize(
    "argv",
    [("--version",), ("--help",), ("status", "--help"), ("ping", "--help"), ("launch", "--help")],
    ids=" ".join,
)
def test_version_and_help_start_without_torch(argv):
    code, loaded, output = run_command(*argv)
    assert code == 0, output
    assert not loaded, f"psframe {' '.join(argv)} imported torch"
    assert output  # it printed the version or the help


def test_status_and_ping_of_a_training_cluster_start_without_torch(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    trainer = psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.Adam(lr=0.01),  # the ps tasks report an optimizer and sync settings
        sync=psframe.SyncReplicas(replicas_to_aggregate=1),
        transport=psframe.Transport(connect_timeout=20.0, rpc_timeout=30.0),
    ).connect()
    try:
        trainer.step(model(torch.ones(2, 4)).sum())
        code, loaded, output = run_command("status", f"--cluster_spec={cluster.to_string()}", "--timeout", "10")
        pinged = run_command("ping", cluster.task_address("ps", 1), "--timeout", "10")
    finally:
        trainer.close()
    assert pinged[:2] == (0, False), pinged
    assert "is /job:ps/task:1 (ready, global step 1, " in pinged[2]
    assert code == 0, output
    assert not loaded, "psframe status imported torch"
    rows = {line.split()[0]: line.split() for line in output.splitlines()[1:3]}
    assert rows["/job:ps/task:0"][2:5] == ["ps", "ready", "1"]  # role, state, global step
    assert rows["/job:ps/task:1"][2:5] == ["ps", "ready", "1"]
    assert "/job:worker/task:0" in output


def test_every_public_name_of_psframe_loads_on_first_use():
    code = (
        "import sys, psframe; loaded = 'torch' in sys.modules; "
        "names = [n for n in psframe.__all__ if getattr(psframe, n) is None]; "
        "print(loaded, names, psframe.checkpoint.__name__, sorted(set(psframe._LAZY) - set(psframe.__all__)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    )
    # torch not loaded by the import; every name (and a module of psframe) there when asked; none unlisted
    assert done.stdout.split() == ["False", "[]", "psframe.checkpoint", "[]"]
