"""Smoke test of the benchmark suite: ``python -m benchmarks.run --quick`` runs
end to end, prints every table and writes the report and its plots (the
scaling, security and hosts sections in tests of their own). The tests of the
report, of the sparse section's ps memory and of the CTR example's rows read
the same run (the ``quick_run`` fixture): no section runs twice.

No timing is asserted: speed goals live in benchmarks/, never in tests.

This file holds the hosts tier's tests of the subject; `tests/unit/test_benchmarks.py`,
`tests/cluster/test_benchmarks.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest

from benchmarks.formatting import table_rows
from benchmarks.report import TITLES
from tests.unit.test_benchmarks import TIMEOUT_S, _run_quick


@pytest.mark.hosts
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_quick_hosts_section_trains_every_system_across_test_hosts(tmp_path):
    """1 ps host + 2 worker hosts at 100 Mbit/s: each row against the link's limit (no timed assertion:
    the fraction is printed, and is positive)."""
    from tests.support.hosts import require_hosts

    require_hosts()
    out = tmp_path / "benchmarks.md"
    proc = _run_quick(out, "--skip", "raw,transport,security,memory,training,scaling,sparse")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    rows = table_rows(proc.stdout, TITLES["hosts"])
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("100 Mbit/s", "mnist_mlp", system) for system in ("psframe", "psframe_bf16", "torch_rpc_ps", "tf_ps")
    ], proc.stdout
    measured = {r[2]: r for r in rows}
    for system in ("psframe", "psframe_bf16", "torch_rpc_ps"):
        assert float(measured[system][3]) > 0 and float(measured[system][4]) == pytest.approx(39.30, abs=0.01)
        assert float(measured[system][5]) > 0  # its fraction of the limit
    assert measured["psframe"][6].endswith("x")  # against the RPC ps (tf_ps is turned off here)
    assert "turned off" in measured["tf_ps"][3]
