"""Smoke test of the benchmark suite: ``python -m benchmarks.run --quick`` runs
end to end, prints every table and writes the report and its plots (the
scaling, security and hosts sections in tests of their own). The tests of the
report, of the sparse section's ps memory and of the CTR example's rows read
the same run (the ``quick_run`` fixture): no section runs twice.

No timing is asserted: speed goals live in benchmarks/, never in tests.

This file holds the cluster tier's tests of the subject; `tests/unit/test_benchmarks.py`,
`tests/hosts/test_benchmarks.py` hold the other tiers'.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.formatting import table_rows
from benchmarks.report import COPIES_MARKER, TITLES
from benchmarks.suite.scaling import SERVING_PROCESSES
from benchmarks.suite.sparse import CTR_CAPTION, MEMORY_CAPTION
from benchmarks.suite.training import PLOT_ORDER
from tests.conftest import ROOT
from tests.unit.test_benchmarks import (  # noqa: F401
    TIMEOUT_S,
    QuickRun,
    _cell,
    _run_quick,
    _run_quick_module,
    _table_after,
    quick_run,
)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_the_handler_cpu_comparison_runs_each_tree_s_handler_in_turn():
    """Its children load the experiment with a tree's psframe and answer every block they are given."""
    from benchmarks.experiments import handler_cpu

    runs = handler_cpu.compare(ROOT, ROOT, sync=True, pairs=2, block=5)
    assert {name: len(values) for name, values in runs.items()} == {"before": 2, "after": 2}
    assert all(value > 0 for values in runs.values() for value in values)


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_quick_run_prints_every_table_and_writes_the_report(quick_run):
    quick_run.check()
    out, stdout = quick_run.out, quick_run.proc.stdout

    raw = table_rows(stdout, TITLES["raw"])
    assert {(r[0], r[1]) for r in raw} >= {("raw gRPC", "unary"), ("raw gRPC", "stream")}, stdout

    transport = table_rows(stdout, TITLES["transport"])
    assert transport and all(r[0] == "psframe" for r in transport), stdout
    assert {r[1] for r in transport} == {"1", "2"}, stdout  # 1 and 2 ps tasks

    memory = table_rows(stdout, TITLES["memory"])
    assert memory and memory[0][0] == "psframe ps", stdout

    sparse = table_rows(stdout, TITLES["sparse"])
    # table rows, table, moved, ps tasks, steps/s, ...: 10^4 and 10^5 rows, as rows and whole on 2 ps
    # tasks, and 10^5 rows on 1 ps task, with and without prefetch, against the RPC parameter server.
    assert sorted((r[0], r[2], r[3]) for r in sparse) == sorted(
        [(n, way, "2") for n in ("10,000", "100,000") for way in ("rows", "dense")]
        + [("100,000", "rows", "1"), ("100,000", "rows+prefetch", "1"), ("100,000", "rpc", "1")]
    ), stdout
    assert all(float(r[4].replace(",", "")) > 0 for r in sparse), stdout
    assert all(r[8].endswith("x") for r in sparse if r[3] == "1"), stdout  # psframe's rows against the RPC ps
    # The ps tasks' memory of a 10^6-row table (quick), each against its limit; the CTR example's three modes.
    assert [(r[0], r[1]) for r in _table_after(stdout, MEMORY_CAPTION)] == [
        ("1,000,000", "0"),
        ("1,000,000", "1"),
    ], stdout
    ctr_rows = _table_after(stdout, CTR_CAPTION)
    assert [r[0] for r in ctr_rows] == ["single_process", "async", "sync"], stdout
    assert all(_cell(r[4]) > 0 and 0.5 < float(r[6]) <= 1.0 for r in ctr_rows), stdout

    training = table_rows(stdout, TITLES["training"])
    assert {r[0] for r in training} >= set(PLOT_ORDER), stdout
    # tf_ps: turned off by _run_quick, and its row says so (in the table's "unavailable" column).
    tf_rows = [r for r in training if r[0] == "tf_ps"]
    assert tf_rows and all("turned off (PSFRAME_TF_PYTHON" in " ".join(r) for r in tf_rows), stdout
    # The CPU psframe's processes spent per step was measured (column 10: "CPU ms/step"; its ps
    # outlives the timed window, so samples bracket it even in these short runs).
    assert all(float(r[9].replace(",", "")) > 0 for r in training if r[0] == "psframe"), stdout

    assert out.is_file() and out.with_suffix(".png").is_file()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = out.read_text()
    for title in TITLES.values():
        assert f"## {title}" in report
    assert "Skipped (`--skip`)" in report.split(f"## {TITLES['hosts']}")[1]
    assert COPIES_MARKER in report
    assert "`OMP_NUM_THREADS=1 python -m benchmarks.run --quick" in report


@pytest.mark.cluster
def test_a_forked_child_runs_its_command_line_as_python_would(tmp_path):
    from benchmarks.children import ForkServer

    code = "import os, sys; print(sys.argv[1:], os.environ['WHO'], os.getcwd(), flush=True); sys.exit(3)"
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:])\nraise ValueError('broken')\n")
    with ForkServer(preload=()) as server:  # nothing preloaded: this test costs no torch import
        child = server.start(
            [sys.executable, "-c", code, "a", "b"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={"WHO": "me"},
            cwd=tmp_path,
            text=True,
        )
        assert child.wait(timeout=30) == 3 and child.stdout.read() == f"['a', 'b'] me {tmp_path}\n"
        with open(tmp_path / "out", "w") as out:
            failing = server.start([sys.executable, str(script), "x"], stdout=out, stderr=subprocess.STDOUT)
        assert failing.wait(timeout=30) == 1
        assert (tmp_path / "out").read_text().startswith("__main__ ['x']\nTraceback")
        assert "ValueError: broken" in (tmp_path / "out").read_text()
        module = server.start([sys.executable, "-m", "this"], stdout=subprocess.PIPE, text=True)
        assert module.wait(timeout=30) == 0 and "Zen of Python" in module.stdout.read()
        sleeper = server.start([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL)
        assert sleeper.poll() is None
        sleeper.kill()
        assert sleeper.wait(timeout=30) == -9
        assert server.start(["sh", "-c", "true"]) is None  # not Python: Popen's to start
        assert server.reaped_cpu_seconds() >= 0


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_quick_scaling_section_runs_every_system_and_computes_the_ratios(tmp_path):
    out = tmp_path / "benchmarks.md"
    # Every other section has a test of its own (hosts too, which needs root: this one does not).
    proc = _run_quick(out, "--skip", "raw,transport,security,memory,training,sparse,hosts")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    rows = table_rows(proc.stdout, TITLES["scaling"])
    # model, system, ps tasks, workers, steps/s, vs rpc, per worker, requests/step, size, CPU ms, vs echo, load
    serving = f"psframe_k{SERVING_PROCESSES}"
    assert {(r[1], r[2], r[3]) for r in rows} == {
        (system, ps, n)
        for n in ("1", "2")
        for system, ps in (
            ("psframe", "1"),
            ("psframe", "2"),
            (serving, "1"),
            ("torch_rpc_ps", "1"),
            ("tf_ps", "1"),
            ("raw_echo", "1"),
        )
    }, proc.stdout
    for r in rows:
        if r[1] == "tf_ps":  # turned off by _run_quick: said so, not measured
            assert r[4] == "-" and r[-1].startswith("unavailable:"), r
            continue
        assert r[0] == "mnist_mlp" and _cell(r[4]) > 0, r
        assert _cell(r[9]) > 0, r  # the server's CPU in the window was measured
        if r[1] in ("psframe", serving):
            assert r[5].endswith("x") and r[10].endswith("x"), r  # both ratios computed
            assert r[7] == r[2], r  # the MNIST MLP: one message per ps task per step
        elif r[1] == "torch_rpc_ps":
            assert r[5] == "-" and r[10].endswith("x"), r
        else:
            assert r[5] == "-" and r[10] == "-", r
    report = out.read_text()
    assert f"## {TITLES['scaling']}" in report
    assert "(benchmarks-scaling.png)" in report and "usable cores" in report
    png = out.with_name("benchmarks-scaling.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_quick_security_section_times_a_step_with_every_setting(tmp_path):
    from benchmarks.suite.security import SETTINGS

    out = tmp_path / "benchmarks.md"
    proc = _run_quick(out, "--skip", "raw,transport,memory,training,scaling,sparse,hosts")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    rows = table_rows(proc.stdout, TITLES["security"])
    # payload, security, round trips/s, us/step, over none, CPU us/step, CPU over none, vs none, spread
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (size, setting) for size in ("4 KiB", "320 KiB") for setting in SETTINGS
    ), proc.stdout
    for r in rows:
        assert _cell(r[2]) > 0 and _cell(r[3]) > 0 and _cell(r[5]) > 0 and r[7].endswith("x"), r
        if r[1] == "none":
            assert (r[4], r[6], r[7]) == ("+0", "+0", "1.00x"), r
    assert f"## {TITLES['security']}" in out.read_text()


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_table_memory_holds_each_ps_task_against_its_rows_state_and_an_idle_ps(quick_run):
    from benchmarks.embedding_workload import DIM
    from benchmarks.suite import sparse
    from benchmarks.suite.memory import LIMIT_FACTOR

    rows = sparse.QUICK_MEMORY_ROWS  # the quick run's table (sparse.table_memory)
    results = quick_run.rows("sparse", "memory")
    assert [r["ps_task"] for r in results] == [0, 1], results
    assert all(r["rows"] == rows for r in results), results
    # mod partition: half the rows of 64 float32 on each ps task, and all of them together.
    assert [r["table_bytes"] for r in results] == [rows // 2 * DIM * 4] * 2, results
    pids = set()
    for r in results:
        # Adagrad's state exists on the ps: a sum per table entry, as large as the rows.
        assert 2 * r["table_bytes"] <= r["bytes_held"] < 2 * r["table_bytes"] + 1_000_000, r
        assert r["peak_source"] == "VmHWM" and 0 < r["baseline_rss"] <= r["peak_rss_after_init"] <= r["peak_rss"], r
        assert r["idle_rss"] > 0 and r["limit"] == pytest.approx(LIMIT_FACTOR * r["bytes_held"] + r["idle_rss"]), r
        assert r["within_limit"] == (r["peak_rss"] <= r["limit"]), r
        pids.add(r["pid"])
    assert len(pids) == 2, results  # each ps task's own process
    text = sparse.sparse_table(results)
    body = _table_after(text, sparse.MEMORY_CAPTION)
    assert [(r[0], r[1]) for r in body] == [(f"{rows:,}", "0"), (f"{rows:,}", "1")], text
    assert all(r[-1] in ("yes", "NO") for r in body), text


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_ctr_benchmark_runs_every_mode_on_the_same_samples(quick_run):
    from benchmarks.suite import ctr, sparse

    case = ctr.QUICK_CASE  # the quick run's (ctr.run_ctr_benchmarks, from the sparse section)
    rows = quick_run.rows("sparse", "ctr")
    assert [(r["mode"], r["num_ps"], r["num_workers"]) for r in rows] == [
        ("single_process", 0, 1),
        ("async", 2, 2),
        ("sync", 2, 2),
    ], rows
    single = rows[0]
    assert single["samples"] == case.samples, single
    for r in rows:
        # Async may run past the last step by the other worker's step in flight; sync stops on it.
        assert case.samples <= r["samples"] <= case.samples + 2 * case.batch_size, r
        assert r["samples_per_sec"] > 0 and r["run_seconds"] > 0, r
        assert 0.5 < r["auc"] <= r["ceiling_auc"] <= 1.0 and r["ceiling_auc"] == single["ceiling_auc"], r
        assert r["auc_diff"] == pytest.approx(r["auc"] - single["auc"]), r
        assert r["vs_single"] == pytest.approx(r["samples_per_sec"] / single["samples_per_sec"]), r
    text = sparse.sparse_table(rows)
    assert sparse.CTR_CAPTION in text and "| sync " in text and "+0.0000" in text, text


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_quick_ctr_run_prints_throughput_per_layout_and_the_ps_row_rate_against_raw_torch():
    from benchmarks.ctr import ROW_RATE_CAPTION, THROUGHPUT_CAPTION
    from benchmarks.suite.row_rate import RAW_CEILING, RAW_READ, RAW_TORCH_OPTIM, READ, UPDATE

    proc = _run_quick_module("benchmarks.ctr")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    stdout = proc.stdout
    assert f"os.cpu_count() = {os.cpu_count()}" in stdout and "OMP_NUM_THREADS=1" in stdout, stdout

    # tables, layout, processes (1 core each), samples, samples/s, vs single process, AUC, AUC - single, ceiling AUC
    throughput = _table_after(stdout, THROUGHPUT_CAPTION)
    layouts = [("single process", "1"), ("1 ps + 1 worker", "2"), ("1 ps + 2 workers", "3")]
    assert [(r[0], r[1], r[2]) for r in throughput] == [
        (tables, layout, processes) for tables in ("fixed", "dynamic") for layout, processes in layouts
    ], stdout
    for r in throughput:
        assert _cell(r[4]) > 0 and r[5].endswith("x") and 0.5 < float(r[6]) <= float(r[8]) <= 1.0, r
    assert all((r[5], r[7]) == ("1.00x", "+0.0000") for r in throughput if r[1] == "single process"), stdout

    # operation, path, where, rows/call, µs/call, rows/s per core, vs ceiling, vs torch.optim, spread
    rates = _table_after(stdout, ROW_RATE_CAPTION)
    assert [(r[0], r[2]) for r in rates] == [(READ, "in process")] * 3 + [(UPDATE, "in process")] * 4 + [
        (UPDATE, "gRPC, ps CPU")
    ] * 2, stdout
    paths = [r[1] for r in rates]
    assert paths[0] == RAW_READ and paths[3:5] == [RAW_TORCH_OPTIM, RAW_CEILING], stdout
    assert all(p.startswith("psframe") for p in paths[1:3] + paths[5:]), stdout
    assert all(_cell(r[5]) > 0 and r[6].endswith("x") for r in rates), stdout
    assert [r[7].endswith("x") for r in rates] == [r[0] == UPDATE for r in rates], stdout
    assert (rates[0][6], rates[4][6], rates[3][7]) == ("1.00x", "1.00x", "1.00x"), stdout  # each ceiling is itself


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_table_ten_times_its_ram_budget_trains_through_a_ps_process_to_the_in_ram_job_s_bits():
    """The tables-beyond-RAM benchmark at a small size: the tiered job's ps task holds most rows on
    disk, and every row read back (those trained and a sample of the others) and the head have
    the in-RAM job's bits."""
    from benchmarks.suite.tables_beyond_ram import run_tables_beyond_ram, tables_beyond_ram_table

    in_ram, tiered = run_tables_beyond_ram(rows=60_000, steps=8, timeout=500.0)
    assert (in_ram["job"], tiered["job"]) == ("in RAM", "disk tier")
    assert in_ram["identical"] and tiered["identical"] and tiered["rows_checked"] > 10_000
    assert in_ram["on_disk"] == 0 and tiered["on_disk"] >= 60_000 * 8 // 10
    assert tiered["budget"] * 10 <= 60_000 * 185 and in_ram["budget"] is None
    assert all(r["samples_per_s"] > 0 and r["peak_anon"] >= r["fixed_anon"] > 0 for r in (in_ram, tiered))
    assert "| disk tier |" in tables_beyond_ram_table([in_ram, tiered])


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_freshness_times_each_event_from_its_publication_to_the_row_psframe_serve_answers(tmp_path):
    """The freshness benchmark at a tiny size (the CTR example on a stream, psframe serve following it):
    every event of the window is found served, the latencies are ordered, lookups are answered, and
    the plot is written."""
    from benchmarks.suite.freshness import freshness_table, plot_freshness, run_freshness

    r = run_freshness(seconds=5.0, rate=20.0, delta_secs=2.0, timeout=500.0)
    assert 95 <= r["published"] <= 101 and r["served"] == r["published"] and r["not_served"] == 0, r
    assert 0 < r["p50"] <= r["p90"] <= r["p99"] <= r["max"], r
    assert r["trained_per_s"] > 0 and r["lookups_per_s"] > 0, r
    timeline = r["timeline"]
    assert all(s is None or s > p for p, s in zip(timeline["published"], timeline["served"]))
    assert timeline["versions"] and timeline["trained"][-1][1] >= r["published"]
    plot_freshness(r, tmp_path / "freshness.png")
    assert (tmp_path / "freshness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"| 0 of {r['published']:,} " in freshness_table(r)
