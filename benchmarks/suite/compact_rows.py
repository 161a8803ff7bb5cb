"""Compact rows on the CTR example: bytes per row and held-out AUC of float32, bfloat16 and
float16 rows, and of the float32 rows exported as int8 for serving.

    python -m benchmarks.suite.compact_rows [--quick]

``examples/ctr_dist.py`` with ``--dynamic_tables``, trained in one process
(``psframe.DynamicTables``: the rows updated as a ps task updates them, the
same code) on the same samples with the same seed, once per row storage:

- **float32**: the reference;
- **bfloat16**, **float16**: ``--row_storage``, rows kept in 16 bits, updated
  in float32 and rounded stochastically; Adagrad's sums stay float32;
- **int8 export**: the float32 run's tables written as a serving snapshot with
  int8 rows and a scale per row (``psframe.export.quantized``, through a
  safetensors file), and the held-out samples scored by a model whose lookups
  read that snapshot's ``TableRows.values()`` (an id it lacks reads as its
  initial row, as the tables give it), as a server would.

*bytes per row* is measured on the deep table's rows (``--embedding_dim``
floats): what the storage holds per row, without and with the table
optimizer's per-row state (none is exported for serving). *vs float32* is the
rows' bytes over float32's. *AUC - float32* is the held-out AUC's difference
from the float32 run's, on the same held-out samples.
"""

from __future__ import annotations

import sys
import tempfile
from types import ModuleType

import torch

from benchmarks.common import example_module, single_thread, table_main
from benchmarks.formatting import format_number, format_ratio, markdown_table
from benchmarks.suite.psframe_internals import DynamicRows, initial_rows, is_row_state
from psframe import export

STORAGES = ("float32", "bfloat16", "float16")
# The example's defaults (3,000 steps of 256 from 800,000 samples) for the full run; a smoke test's
# quick run is small.
FULL_FLAGS = ["--train_steps=3000", "--batch_size=256", "--train_samples=800000", "--test_samples=50000"]
QUICK_FLAGS = ["--train_steps=60", "--batch_size=256", "--train_samples=20000", "--test_samples=4000"]


def row_bytes(part: DynamicRows) -> tuple[float, float]:
    """Bytes per row a table part holds: of its rows, and of its rows with their per-row optimizer state."""
    rows = part.weight.element_size() * part.weight[0].numel()
    state = part.optimizer.state.get(part.weight, {}) if part.optimizer is not None else {}
    per_row_state = sum(
        value.element_size() * value[0].numel() for value in state.values() if is_row_state(value, part.weight.shape)
    )
    return float(rows), float(rows + per_row_state)


def train(ctr: ModuleType, flags: list[str], storage: str) -> dict:
    """Train the example in one process with ``storage`` rows; its row (and the model and tables, for the export)."""
    args = ctr.parse_args(["--single_process", "--dynamic_tables", f"--row_storage={storage}", *flags])
    model, tables, wall = ctr.train_single_process(args)
    test = ctr.data_of(args, 1)
    rows, with_state = row_bytes(tables.rows["deep"])
    return {
        "storage": storage,
        "rows_bytes": rows,
        "with_state_bytes": with_state,
        "samples_per_sec": args.train_steps * args.batch_size / wall,
        "auc": ctr.held_out_metrics(model, test)["auc"],
        "model": model,
        "tables": tables,
        "test": test,
    }


def int8_export(ctr: ModuleType, reference: dict) -> dict:
    """Score the held-out samples with the reference's tables exported as int8 rows (through a file)."""
    model, tables = reference["model"], reference["tables"]
    held = {name: part.export() for name, part in tables.rows.items()}
    snapshot = export.Snapshot(0, {}, {name: export.TableRows(h["ids"], h["rows"]) for name, h in held.items()})
    with tempfile.TemporaryDirectory(prefix="psframe-bench-int8-") as folder:
        path = f"{folder}/serving.safetensors"
        export.write_snapshot(export.quantized(snapshot), path)
        served = export.read_snapshot(path)
    for name, module in tables.modules.items():
        module.attach(lambda ids, _create, table=served.tables[name], m=module: served_rows(table, m, ids))
    try:
        auc = ctr.held_out_metrics(model, reference["test"])["auc"]
    finally:
        for name, module in tables.modules.items():  # back to the trained tables
            module.attach(lambda ids, create, part=tables.rows[name]: part.read(ids, create=create))
    deep = served.tables["deep"]
    return {
        "storage": "int8 export",
        "rows_bytes": float(deep.rows[0].numel() * deep.rows.element_size() + deep.scales.element_size()),
        "with_state_bytes": None,
        "samples_per_sec": None,
        "auc": auc,
    }


def served_rows(table: export.TableRows, module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The rows of ``ids`` as a server reads them from ``table``: int8 times scale, an id not there
    as its initial row."""
    values = table.values()
    at = torch.searchsorted(table.ids, ids).clamp_(max=max(len(table) - 1, 0))
    found = table.ids[at] == ids if len(table) else torch.zeros_like(ids, dtype=torch.bool)
    rows = initial_rows(module.spec.initializer, ids, (module.embedding_dim,), torch.float32)
    rows[found] = values[at[found]]
    return rows


def run_compact_rows(quick: bool = False) -> list[dict]:
    """One row per storage of :data:`STORAGES`, and the int8 export's, each with ``vs_float32``
    (rows' bytes over float32's) and ``auc_diff`` (AUC minus float32's)."""
    single_thread()
    ctr = example_module("ctr_dist")
    flags = QUICK_FLAGS if quick else FULL_FLAGS
    runs = [train(ctr, flags, storage) for storage in STORAGES]
    runs.append(int8_export(ctr, runs[0]))
    reference = runs[0]
    rows = []
    for run in runs:
        rows.append(
            {key: run[key] for key in ("storage", "rows_bytes", "with_state_bytes", "samples_per_sec", "auc")}
            | {
                "vs_float32": run["rows_bytes"] / reference["rows_bytes"],
                "auc_diff": run["auc"] - reference["auc"],
            }
        )
    return rows


def compact_rows_table(rows: list[dict]) -> str:
    """Markdown table of :func:`run_compact_rows` rows."""
    headers = ["rows", "bytes per row", "vs float32", "bytes per row with Adagrad", "samples/s", "AUC", "AUC - float32"]
    return markdown_table(
        headers,
        [
            [
                r["storage"],
                format_number(r["rows_bytes"]),
                format_ratio(r["vs_float32"]),
                "-" if r["with_state_bytes"] is None else format_number(r["with_state_bytes"]),
                "-" if r["samples_per_sec"] is None else format_number(r["samples_per_sec"]),
                f"{r['auc']:.4f}",
                f"{r['auc_diff']:+.4f}",
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    return table_main(
        argv, __doc__, "60 steps of 256 samples", lambda quick: compact_rows_table(run_compact_rows(quick))
    )


if __name__ == "__main__":
    sys.exit(main())
