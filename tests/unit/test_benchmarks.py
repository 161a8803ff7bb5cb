"""Smoke test of the benchmark suite: ``python -m benchmarks.run --quick`` runs
end to end, prints every table and writes the report and its plots (the
scaling, security and hosts sections in tests of their own). The tests of the
report, of the sparse section's ps memory and of the CTR example's rows read
the same run (the ``quick_run`` fixture): no section runs twice.

No timing is asserted: speed goals live in benchmarks/, never in tests.

This file holds the unit tier's tests of the subject; `tests/cluster/test_benchmarks.py`,
`tests/hosts/test_benchmarks.py` hold the other tiers'.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.formatting import table_rows

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
SECTION_TIMEOUT_S = 120  # each section's own deadline, well inside TIMEOUT_S


def _run_quick_module(module: str, *flags: str, tf: bool = True) -> subprocess.CompletedProcess:
    """``python -m <module> --quick --timeout <section timeout> <flags>``, one thread a process;
    fails the test on a timeout. ``tf=False`` turns the TensorFlow baseline off."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if not tf:
        env["PSFRAME_TF_PYTHON"] = ""
    argv = [sys.executable, "-m", module, "--quick", "--timeout", str(SECTION_TIMEOUT_S), *flags]
    try:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # subprocess.run kills the child (by PID) first
        pytest.fail(f"{module} --quick took over {TIMEOUT_S}s; stderr:\n{e.stderr}")


def _run_quick(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.run --quick`` writing ``out``.

    The TensorFlow baseline is turned off (``PSFRAME_TF_PYTHON`` empty): the test
    environment has no TensorFlow, and a developer's ``.venv-tf`` must not make
    the run slower or its rows different. Its rows then say it is unavailable.
    """
    return _run_quick_module("benchmarks.run", "--out", str(out), *flags, tf=False)


@dataclass
class QuickRun:
    """One ``python -m benchmarks.run --quick`` of the sections but scaling, security and hosts (their
    own tests below): its process, its report, and its rows (``--json``; None if it wrote none)."""

    proc: subprocess.CompletedProcess
    out: Path
    results: dict | None

    def check(self) -> None:
        assert self.proc.returncode == 0, f"stdout:\n{self.proc.stdout}\nstderr:\n{self.proc.stderr[-5000:]}"

    def rows(self, section: str, kind: str) -> list[dict]:
        """The rows of ``kind`` in ``section``'s results."""
        self.check()
        assert self.results is not None and self.results[section], self.proc.stdout
        return [r for r in self.results[section] if r.get("kind") == kind]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> QuickRun:
    """The tests of the report's tables, of the sparse section's ps memory and of the CTR example's
    rows read one run: each of those sections runs once."""
    folder = tmp_path_factory.mktemp("quick")
    out, rows = folder / "benchmarks.md", folder / "benchmarks.json"
    proc = _run_quick(out, "--skip", "scaling,security,hosts", "--json", str(rows))
    return QuickRun(proc, out, json.loads(rows.read_text()) if rows.is_file() else None)


def test_training_rows_report_the_median_of_interleaved_runs(monkeypatch):
    from benchmarks.suite import training, training_tables

    order = []
    rates = iter([5.0, 1.0, 3.0, 9.0, 7.0, 8.0])  # per call, systems interleaved

    def fake_run_system(system, model, mode, steps, warmup, deadline):
        order.append(system)
        if system == "ddp_gloo" and len(order) > 4:
            raise RuntimeError("rank 1 died")
        return {
            "system": system,
            "model": model,
            "mode": mode,
            "global_steps_per_sec": next(rates),
            "samples_per_sec": 1.0,
            "steps": steps,
            "seconds": 1.0,
        }

    monkeypatch.setattr(training, "SYSTEMS", (("psframe", "async"), ("ddp_gloo", "-")))
    monkeypatch.setattr(training, "run_system", fake_run_system)
    rows = training.run_training_benchmarks(["mnist_mlp"], quick=True, timeout=60, repeats=3)
    assert order == ["psframe", "ddp_gloo"] * 3
    psframe_row, ddp_row = rows
    assert psframe_row["global_steps_per_sec"] == 5.0 and psframe_row["run_rates"] == [5.0, 3.0, 7.0]
    # A failed run is left out of the median, and its rate shows as nan.
    assert ddp_row["global_steps_per_sec"] == 1.0 and ddp_row["run_rates"][:2] == [1.0, 9.0]
    assert "5 / 3 / 7" in training_tables.training_table(rows).replace(".00", "")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        training.run_training_benchmarks(["mnist_mlp"], quick=True, repeats=0)


def test_training_repeats_may_differ_per_model(monkeypatch):
    from benchmarks.suite import training

    calls = []

    def fake_run_system(system, model, mode, steps, warmup, deadline):
        calls.append(model)
        return {
            "system": system,
            "model": model,
            "mode": mode,
            "global_steps_per_sec": 1.0,
            "samples_per_sec": 1.0,
            "steps": steps,
            "seconds": 1.0,
        }

    monkeypatch.setattr(training, "SYSTEMS", (("psframe", "async"), ("ddp_gloo", "-")))
    monkeypatch.setattr(training, "run_system", fake_run_system)
    rows = training.run_training_benchmarks(
        ["mnist_mlp", "large_mlp"], quick=True, timeout=60, repeats={"mnist_mlp": 3, "large_mlp": 1}
    )
    assert calls == ["mnist_mlp"] * 6 + ["large_mlp"] * 2
    assert [len(r["run_rates"]) for r in rows] == [3, 3, 1, 1]
    with pytest.raises(ValueError, match="no count for \\['large_mlp'\\]"):
        training.run_training_benchmarks(["mnist_mlp", "large_mlp"], quick=True, repeats={"mnist_mlp": 3})
    assert calls == ["mnist_mlp"] * 6 + ["large_mlp"] * 2  # refused before running anything


def test_cpu_in_window_interpolates_between_samples():
    from benchmarks.suite.processes import cpu_in_window

    trace = [[10.0, 1.0], [11.0, 1.5], [12.0, 2.5], [13.0, 2.5]]  # [perf_counter, CPU seconds]
    assert cpu_in_window(trace, [10.5, 12.0]) == pytest.approx(2.5 - 1.25)
    assert cpu_in_window(trace, [11.0, 11.5]) == pytest.approx(0.5)
    # A window ending after the last sample: the process was ending, its CPU stopped growing.
    assert cpu_in_window(trace, [12.5, 20.0]) == pytest.approx(0.0)
    assert cpu_in_window(trace, [10.0, 20.0]) == pytest.approx(1.5)
    # Nothing to measure from: a window opening before the first sample or after the last, or no samples.
    assert cpu_in_window(trace, [9.0, 12.0]) is None
    assert cpu_in_window(trace, [13.0, 14.0]) is None
    assert cpu_in_window([], [10.0, 11.0]) is None


def test_training_rows_compare_cpu_per_sample_with_the_rpc_ps():
    from benchmarks.suite import training_tables

    def row(system, mode, cpu_ms_per_step, samples_per_step=100):
        return {
            "system": system,
            "model": "mnist_mlp",
            "mode": mode,
            "global_steps_per_sec": 2.0,
            "samples_per_sec": 2.0 * samples_per_step,
            "steps": 10,
            "seconds": 1.0,
            "cpu_ms_per_step": cpu_ms_per_step,
        }

    rows = training_tables.training_ratios(
        [
            row("psframe", "async", 2.0),
            row("psframe", "sync", float("nan")),
            row("torch_rpc_ps", "async", 5.0, samples_per_step=200),
            row("torch_rpc_ps", "sync", 3.0),
        ]
    )
    # Per sample: 2 ms / 100 against 5 ms / 200.
    assert rows[0]["cpu_vs_torch_rpc_ps"] == pytest.approx(0.8)
    assert rows[1]["cpu_vs_torch_rpc_ps"] is None  # not measured: no ratio rather than nan
    assert rows[2]["cpu_vs_torch_rpc_ps"] == pytest.approx(1.0)
    assert "0.80x" in training_tables.training_table(rows)


def test_throughput_ratios_pair_the_runs_of_each_repeat():
    from benchmarks.suite.training_tables import paired_ratio

    def row(rates, samples_per_step):  # as training._median_run makes them: the median good run
        good = sorted(r for r in rates if r == r)
        median = good[(len(good) - 1) // 2]
        return {"global_steps_per_sec": median, "samples_per_sec": median * samples_per_step, "run_rates": rates}

    psframe, rpc = row([10.0, 20.0, 30.0], 100), row([20.0, 5.0, 25.0], 100)
    # Repeat by repeat 0.5, 4 and 1.2: the median is 1.2, where the medians' ratio (20/20) says 1.0.
    assert paired_ratio(psframe, rpc) == pytest.approx(1.2)
    # Samples per step count: a DDP step of 2 ranks is 200 samples.
    assert paired_ratio(psframe, row([20.0, 5.0, 25.0], 200)) == pytest.approx(0.6)
    # A failed repeat (nan) is left out; without repeats, the rows' samples/s are compared.
    assert paired_ratio(row([10.0, float("nan"), 30.0], 100), rpc) == pytest.approx((0.5 + 1.2) / 2)
    assert paired_ratio(
        {"global_steps_per_sec": 3.0, "samples_per_sec": 300.0}, {"global_steps_per_sec": 2.0, "samples_per_sec": 200.0}
    ) == pytest.approx(1.5)
    assert paired_ratio(psframe, {}) is None


# ---------------------------------------------------------------- scaling


def _cell(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


def test_security_costs_are_against_the_row_without_security_at_the_same_payload():
    from benchmarks.suite.security import add_costs

    rows = add_costs(
        [
            {"security": "none", "payload_bytes": 4, "round_trips_per_sec": 1000.0, "us_per_step": 1000.0},
            {"security": "token", "payload_bytes": 4, "round_trips_per_sec": 800.0, "us_per_step": 1250.0},
            {"security": "token", "payload_bytes": 8, "round_trips_per_sec": 500.0, "us_per_step": 2000.0},
        ]
    )
    assert [(r["us_over_none"], r["vs_none"]) for r in rows] == [(0.0, 1.0), (250.0, 0.8), (None, None)]
    assert [r["cpu_us_over_none"] for r in rows] == [None, None, None]  # no CPU times in these rows


def test_worker_counts_double_up_to_the_cores_left_beside_the_ps():
    from benchmarks.suite.scaling import worker_counts

    assert worker_counts(1) == [1, 2]
    assert worker_counts(2) == [1, 2]
    assert worker_counts(4) == [1, 2]
    assert worker_counts(8) == [1, 2, 4, 6]
    assert worker_counts(10) == [1, 2, 4, 8]
    assert worker_counts(16) == [1, 2, 4, 8, 14]


def test_request_plan_sends_every_byte_in_messages_of_at_most_4_mib():
    from benchmarks.mlp_workload import model_bytes
    from benchmarks.suite.scaling import echo_payload, step_plan_sizes

    assert model_bytes("mnist_mlp") == 318_040
    assert step_plan_sizes("mnist_mlp", 1) == [318_040]
    assert len(step_plan_sizes("mnist_mlp", 2)) == 2  # one message per ps task
    for num_ps in (1, 2):
        plan = step_plan_sizes("large_mlp", num_ps)
        assert sum(plan) == model_bytes("large_mlp") and max(plan) <= 4 * 2**20, plan
        assert len(plan) >= -(-model_bytes("large_mlp") // (4 * 2**20))
    assert echo_payload("mnist_mlp") == 318_040
    assert echo_payload("large_mlp") == round(model_bytes("large_mlp") / len(step_plan_sizes("large_mlp", 1)))


def test_scaling_ratios_compare_with_the_rpc_ps_and_the_echo_per_byte():
    from benchmarks.suite.scaling_tables import add_ratios, scaling_table

    def row(system, ps_tasks, rate, cpu_ms, request_bytes, workers=1):
        return {
            "model": "mnist_mlp",
            "system": system,
            "ps_tasks": ps_tasks,
            "workers": workers,
            "global_steps_per_sec": rate,
            "server_cpu_ms_per_request": cpu_ms,
            "request_bytes": request_bytes,
            "requests_per_step": 1,
            "per_worker_steps_per_sec": [rate],
        }

    rows = add_ratios(
        [
            row("psframe", 1, 300.0, 0.6, 1000),
            row("psframe", 2, 200.0, 0.3, 500),
            row("torch_rpc_ps", 1, 150.0, float("nan"), 1000),
            row("raw_echo", 1, 900.0, 0.5, 1000),
            row("psframe", 1, 100.0, 1.0, 1000, workers=2),
        ]
    )
    one_ps, two_ps, rpc, echo, other_n = rows
    assert one_ps["vs_torch_rpc_ps"] == pytest.approx(2.0) and one_ps["cpu_vs_raw_echo"] == pytest.approx(1.2)
    # Half the bytes per request: the echo's CPU per trip is halved too.
    assert two_ps["cpu_vs_raw_echo"] == pytest.approx(1.2)
    assert rpc["vs_torch_rpc_ps"] is None and rpc["cpu_vs_raw_echo"] is None  # not measured: no ratio
    assert echo["vs_torch_rpc_ps"] is None and echo["cpu_vs_raw_echo"] is None
    assert other_n["vs_torch_rpc_ps"] is None and other_n["cpu_vs_raw_echo"] is None  # nothing at N = 2
    table = scaling_table(rows)
    assert "1.20x" in table and "2.00x" in table


def test_a_system_is_one_entry_and_a_failed_run_costs_only_its_row():
    from benchmarks.suite import scaling

    calls = []

    def fake_run(case, deadline):
        calls.append((case.workers, case.ps_tasks))
        if case.ps_tasks == 3:
            raise RuntimeError("ps2 died")
        return {
            "global_steps_per_sec": 10.0 * case.workers,
            "per_worker_steps_per_sec": [10.0] * case.workers,
            "steps": 20,
            "seconds": 1.0,
            "window_rates": [],
            "requests_per_step": case.ps_tasks,
            "request_bytes": 100.0,
            "requests": 20 * case.ps_tasks,
            "server_cpu_seconds": 0.02 * case.ps_tasks,
            "processes": case.workers + case.ps_tasks,
        }

    systems = (scaling.System("new_ps", (1, 3), fake_run),)
    rows = scaling.run_scaling_benchmarks(["mnist_mlp"], quick=True, timeout=60, workers=[1, 4], systems=systems)
    assert calls == [(1, 1), (1, 3), (4, 1), (4, 3)]
    assert [(r["system"], r["workers"], r["ps_tasks"]) for r in rows] == [
        ("new_ps", 1, 1),
        ("new_ps", 1, 3),
        ("new_ps", 4, 1),
        ("new_ps", 4, 3),
    ]
    assert rows[0]["server_cpu_ms_per_request"] == pytest.approx(1.0)
    assert "ps2 died" in rows[1]["error"] and "error" not in rows[2]
    with pytest.raises(ValueError, match="worker counts"):
        scaling.run_scaling_benchmarks(["mnist_mlp"], workers=[0], systems=systems)


def test_echo_trips_are_counted_in_the_window_all_clients_timed():
    from benchmarks.suite.scaling_echo import common_window, trips_in_window

    window = common_window([[1.0, 5.0], [2.0, 6.0]])
    assert window == [2.0, 5.0]
    assert trips_in_window([1.5, 2.0, 2.5, 4.0, 5.0, 5.5], window) == 3
    assert common_window([[1.0, 2.0], [3.0, 4.0]]) is None


# ---------------------------------------------------------------- sparse: memory and the CTR example


def _table_after(text: str, caption: str) -> list[list[str]]:
    """The body rows of the first table after the line starting with ``caption``."""
    assert caption in text, text
    return table_rows("## here\n" + text.split(caption, 1)[1], "here")


def test_ctr_rows_read_the_chiefs_line_and_compare_with_the_single_process():
    from benchmarks.common import BenchmarkError
    from benchmarks.suite import ctr

    output = (
        "[ps0] INFO serving\n[worker0] 2026 INFO worker 0: local step 10\n"
        '[worker0] {"mode": "async", "global_step": 10, "auc": 0.8}\n[worker1] {"not": "the chief"}\n'
        '[worker0] {"mode": "async", "global_step": 12, "auc": 0.81}\n[launch] done\n'
    )
    assert ctr.result_line(output, "async") == {"mode": "async", "global_step": 12, "auc": 0.81}
    assert ctr.result_line('noise\n{"mode": "single_process"}\n', "single_process") == {"mode": "single_process"}
    with pytest.raises(BenchmarkError, match="no result line"):
        ctr.result_line("[worker1] {}\n", "async")
    case = ctr.CtrCase(train_steps=100, batch_size=8, train_samples=800, test_samples=100, hash_buckets=64)
    assert "--train_steps=50" in case.flags("sync") and "--sync_replicas" in case.flags("sync")
    assert "--train_steps=100" in case.flags("async") and "--sync_replicas" not in case.flags("async")
    rows = ctr.compare(
        [
            {"mode": m, "samples_per_sec": s, "auc": a}
            for m, s, a in (("single_process", 1000.0, 0.80), ("async", 500.0, 0.803), ("sync", 250.0, 0.79))
        ]
    )
    assert [r["vs_single"] for r in rows] == pytest.approx([1.0, 0.5, 0.25])
    assert [r["auc_diff"] for r in rows] == pytest.approx([0.0, 0.003, -0.01])
    assert all(r["vs_single"] is None for r in ctr.compare([{"mode": "async", "samples_per_sec": 1.0, "auc": 0.5}]))


# ---------------------------------------------------------------- the CTR example at batch 512, and the ps's row rate


def test_ctr_row_rate_ratios_pair_the_repeats_of_paths_timed_together():
    from benchmarks.suite.row_rate import RAW_CEILING, RAW_TORCH_OPTIM, UPDATE, add_ratios

    def row(path: str, repeats: list[float] | None, rate: float) -> dict:
        return {
            "operation": UPDATE,
            "path": path,
            "rows_per_s": rate,
            **({"repeat_rows_per_s": repeats} if repeats else {}),
        }

    rows = add_ratios(
        [
            row(RAW_TORCH_OPTIM, [1.0, 2.0, 4.0], 2.0),
            row(RAW_CEILING, [4.0, 8.0, 16.0], 8.0),
            row("psframe", [2.0, 2.0, 8.0], 2.0),  # paired: 0.5, 0.25, 0.5 of the ceiling
            row("psframe over gRPC", None, 4.0),  # not timed with them: against the medians
        ]
    )
    assert [r["vs_ceiling"] for r in rows] == pytest.approx([0.25, 1.0, 0.5, 0.5])
    assert [r["vs_torch_optim"] for r in rows] == pytest.approx([1.0, 4.0, 2.0, 2.0])


def test_ctr_throughput_compares_each_run_with_the_single_process_of_its_tables():
    from benchmarks.suite.ctr_throughput import compare

    rows = compare(
        [
            {"tables": t, "num_ps": ps, "samples_per_sec": s, "auc": a}
            for t, ps, s, a in (
                ("fixed", 0, 100.0, 0.80),
                ("fixed", 1, 50.0, 0.80),
                ("dynamic", 0, 40.0, 0.81),
                ("dynamic", 1, 30.0, 0.79),
            )
        ]
    )
    assert [r["vs_single"] for r in rows] == pytest.approx([1.0, 0.5, 1.0, 0.75])
    assert [r["auc_diff"] for r in rows] == pytest.approx([0.0, 0.0, 0.0, -0.02])


# ---------------------------------------------------------------- the store's lock


def test_store_lock_times_the_requests_the_trainer_plans():
    from benchmarks.experiments.store_lock import requests_of, run_store_lock_benchmarks, store_lock_table
    from benchmarks.suite.scaling import step_plan_sizes

    for model in ("mnist_mlp", "large_mlp"):
        planned = [sum(4 * math.prod(shape) for shape in request.values()) for request in requests_of(model)]
        assert planned == step_plan_sizes(model, 1), model
    rows = run_store_lock_benchmarks(quick=True)
    assert [(r["model"], r["requests_per_step"]) for r in rows] == [("mnist_mlp", 1), ("large_mlp", 21)]
    assert all(
        r["hold_us"] > 0 and r["max_steps_per_s"] * r["requests_per_step"] == pytest.approx(r["max_requests_per_s"])
        for r in rows
    )
    assert store_lock_table(rows).count("\n") == 3


def test_psframe_copies_a_gradient_once_into_a_message_and_never_out_of_one():
    """The copies benchmark's own rows: encoding copies the tensor's bytes once (the message is
    made of them), decoding makes views."""
    from benchmarks.suite.copies import psframe_rows

    (_, encode_peak, _), (_, decode_peak, decode_kept) = psframe_rows(4 << 20)
    assert 0.99 < encode_peak < 1.05
    assert decode_peak < 0.01 and decode_kept < 0.01


def test_the_handler_cpu_experiment_answers_async_and_sync_requests():
    """The handler's CPU experiment runs both paths to the end: every request answered without an
    error (a refused one would not take the path it times), the sync rounds all applied."""
    from benchmarks.experiments import handler_cpu
    from psframe.wire import encoding
    from psframe.wire import psframe_pb2 as pb

    service = handler_cpu._service(sync=False)
    reply = service.push_pulls.reply(handler_cpu._requests(0, 1, sync=False)[0])
    header = encoding.parse(reply, pb.PushPullReplyHeader).header
    assert not header.error_class and header.global_step == 1
    assert handler_cpu.cpu_per_request_us(sync=False, count=20) > 0
    assert handler_cpu.cpu_per_request_us(sync=True, count=20) > 0


def test_the_compact_rows_benchmark_weighs_each_storage_and_scores_the_int8_export(monkeypatch):
    """Each storage's rows hold what it says (16 bits a value for bfloat16 and float16, int8 plus a
    float32 scale for the export, Adagrad's float32 sums beside), and every run is scored."""
    from benchmarks.suite import compact_rows

    monkeypatch.setattr(
        compact_rows, "QUICK_FLAGS", ["--train_steps=20", "--train_samples=6000", "--test_samples=2000"]
    )
    rows = compact_rows.run_compact_rows(quick=True)
    dim = 8  # the example's --embedding_dim
    assert [(r["storage"], r["rows_bytes"], r["with_state_bytes"]) for r in rows] == [
        ("float32", 4 * dim, 8 * dim),
        ("bfloat16", 2 * dim, 6 * dim),
        ("float16", 2 * dim, 6 * dim),
        ("int8 export", dim + 4, None),
    ]
    assert [r["vs_float32"] for r in rows] == [1.0, 0.5, 0.5, (dim + 4) / (4 * dim)]
    for r in rows:
        assert 0.5 < r["auc"] <= 1.0 and r["auc_diff"] == pytest.approx(r["auc"] - rows[0]["auc"]), r
    assert "| int8 export |" in compact_rows.compact_rows_table(rows)


# ---------------------------------------------------------------- the disk tier's storage engines


def test_every_row_store_reads_back_the_bits_last_written(tmp_path):
    """Each engine of the row-store experiment, at a tiny size, goes through the experiment's phases
    (which check every batch read), then is read back whole: every row holds the bits written last,
    and the writes did change rows, so that an engine returning stale rows would fail."""
    import numpy as np

    from benchmarks.experiments import row_stores
    from benchmarks.experiments.row_store_engines import ENGINES, FIELDS, KeyValue

    settings = row_stores.Settings(rows=5000, dim=4, batch=256, seconds=0.05, directory=str(tmp_path))
    initial = row_stores.make_table(settings.rows, settings.dim)
    results = []
    for number, make in enumerate(ENGINES):
        truth = initial.copy()
        (tmp_path / str(number)).mkdir()
        engine = make(tmp_path / str(number), settings.rows, settings.dim)
        try:
            results.append(row_stores.measure(engine, truth, settings, row_stores.Memory()))
            assert all(results[-1]["phases"][phase].batches > 0 for phase in ("read", "write", "step")), engine.name
            assert np.count_nonzero(truth["stamp"] != initial["stamp"]) > settings.batch  # rows were rewritten
            everything = engine.read(np.arange(settings.rows))
            for name, column in zip(FIELDS, everything):
                assert np.asarray(column).tobytes() == truth[name].tobytes(), (engine.name, name)
            if isinstance(engine, KeyValue):  # keys sort as their ids do, negative ones too
                ids = np.array([-(2**63), -(2**40), -1, 0, 1, 2**40, 2**63 - 1])
                assert engine.keys(ids) == sorted(engine.keys(ids))
        finally:
            engine.close()
    assert [r["engine"] for r in results] == ["in RAM", "rocksdb", "rocksdb+lz4", "lmdb", "memmap"]
    assert len(row_stores.rates_table(results).splitlines()) == 2 + 4 * len(ENGINES)
    assert "Fastest disk engine" in row_stores.conclusion(results)


def test_the_row_store_experiment_fails_loudly_on_rows_it_did_not_write(tmp_path):
    """An engine that drops its writes (stale rows), one that flips a bit, key-value stores that lost
    rows: the experiment stops with RowMismatch, and its temporary directory goes all the same."""
    import numpy as np

    from benchmarks.experiments import row_stores
    from benchmarks.experiments.row_store_engines import Lmdb, Memmap, RocksDB, RowMismatch

    class DropsWrites(Memmap):
        def write(self, ids, columns):
            pass

    class FlipsABit(Memmap):
        def read(self, ids):
            weight, state, stamp = super().read(ids)
            state = state.copy()
            state.view(np.uint32)[len(ids) // 2, 0] ^= 1  # the float's lowest mantissa bit
            return weight, state, stamp

    class LmdbLosesRows(Lmdb):
        def finish_load(self):
            super().finish_load()
            with self.env.begin(write=True) as txn:
                for key in self.keys(np.arange(0, 5000, 2)):
                    txn.delete(key)

    class RocksDBLosesRows(RocksDB):
        def finish_load(self):
            super().finish_load()
            for key in self.keys(np.arange(0, 5000, 2)):
                self.db.delete(key)

    settings = row_stores.Settings(rows=5000, dim=4, batch=256, seconds=0.05, directory=str(tmp_path))
    for engine, message in (
        (DropsWrites, r"memmap: reading the last batch written gave \d+ of 256 rows with another weight"),
        (FlipsABit, r"memmap: a read gave 1 of 256 rows with another state than was written \(the first: id"),
        (LmdbLosesRows, r"lmdb: rows of 256 ids read, \d+ of them missing"),
        (RocksDBLosesRows, r"rocksdb: rows of 256 ids read, \d+ of them missing"),
    ):
        with pytest.raises(RowMismatch, match=message):
            row_stores.run(settings, engines=[engine])
        assert not list(tmp_path.iterdir())
