"""``psframe export``: write a serving snapshot of a checkpoint, or an update between snapshots,
as safetensors; or apply updates to a snapshot (``--apply``). The work is :mod:`psframe.export`'s.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psframe.export import SnapshotUpdate


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` and its flags to ``commands``."""
    export = commands.add_parser(
        "export",
        help="write a serving snapshot of a checkpoint, or an update between snapshots, as safetensors",
        usage="%(prog)s [--step N] [--min_row_norm X] [--max_row_age_seconds S] [--int8_rows] "
        "[--update_from OLD | --delta] "
        "CHECKPOINT_DIR OUT\n       %(prog)s --apply SNAPSHOT UPDATE... --out NEW",
        description="The snapshot of a checkpoint holds its parameters and its dynamic tables' rows, never "
        "optimizer state (see psframe.export). With --update_from, OUT is instead the update that takes the "
        "older snapshot OLD to this one; with --apply, the updates are applied to SNAPSHOT in order and the "
        "result written to NEW.",
    )
    export.add_argument(
        "paths", nargs="+", metavar="PATH", help="CHECKPOINT_DIR OUT, or with --apply: SNAPSHOT UPDATE..."
    )
    export.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the latest valid one)"
    )
    export.add_argument(
        "--min_row_norm", type=float, default=None, help="leave out table rows whose L2 norm is below this"
    )
    export.add_argument(
        "--max_row_age_seconds",
        type=float,
        default=None,
        help="leave out table rows not looked up or updated for more than this many seconds",
    )
    export.add_argument(
        "--update_from",
        default=None,
        metavar="OLD",
        help="write the update from the snapshot OLD (an earlier export) to this checkpoint's, not a snapshot",
    )
    export.add_argument(
        "--delta",
        action="store_true",
        help="write the update the delta checkpoint of --step (default: the last delta) makes: the rows it "
        "changed, the ids it evicted",
    )
    export.add_argument(
        "--int8_rows",
        action="store_true",
        help="write the dynamic tables' rows as int8 with one float32 scale per row (a quarter of float32's "
        "bytes; psframe.export.quantized); an update from OLD needs OLD written so too",
    )
    export.add_argument("--apply", action="store_true", help="apply updates to a snapshot instead")
    export.add_argument("--out", default=None, metavar="NEW", help="with --apply: where the new snapshot goes")
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Export a checkpoint (a snapshot, or an update with ``--update_from``/``--delta``), or apply updates."""
    from psframe import export
    from psframe.errors import SnapshotError

    if args.apply:
        others = (
            [
                f"--{n}"
                for n in ("step", "min_row_norm", "max_row_age_seconds", "update_from")
                if getattr(args, n) is not None
            ]
            + ["--delta"] * args.delta
            + ["--int8_rows"] * args.int8_rows
        )
        if others:
            raise ValueError(f"--apply takes no {', '.join(others)}: those are for exporting a checkpoint")
        if args.out is None or len(args.paths) < 2:
            raise ValueError(
                f"--apply takes SNAPSHOT UPDATE... (in order) and --out NEW; got {len(args.paths)} path(s) and "
                f"{'no --out' if args.out is None else '--out'}"
            )
        snapshot = export.read_snapshot(args.paths[0])
        for path in args.paths[1:]:
            update = export.read_update(path)  # its errors name the file
            try:
                snapshot = export.apply_update(snapshot, update)
            except SnapshotError as e:
                raise SnapshotError(f"{path}: {e}") from e
        export.write_snapshot(snapshot, args.out)
        print(f"wrote the snapshot of step {snapshot.step} to {args.out} ({len(args.paths) - 1} updates applied)")
        return 0
    if len(args.paths) != 2 or args.out is not None:
        raise ValueError(
            f"give CHECKPOINT_DIR OUT (got {len(args.paths)} paths{', and --out' if args.out else ''}); "
            "--out is for --apply"
        )
    checkpoint_dir, out = args.paths
    thresholds = {"min_row_norm": args.min_row_norm, "max_row_age_seconds": args.max_row_age_seconds}
    if args.delta and args.update_from is not None:
        raise ValueError("give --delta or --update_from, not both: each writes an update")
    as_written = export.quantized if args.int8_rows else lambda exported: exported
    if args.delta:
        return _wrote_update(as_written(export.export_delta(checkpoint_dir, args.step, **thresholds)), out)
    snapshot = as_written(export.export_checkpoint(checkpoint_dir, args.step, **thresholds))
    rows = sum(len(table) for table in snapshot.tables.values())
    if args.update_from is None:
        export.write_snapshot(snapshot, out)
        print(
            f"wrote the snapshot of step {snapshot.step} to {out} ({len(snapshot.dense)} dense variables, "
            f"{rows} rows in {len(snapshot.tables)} dynamic tables)"
        )
        return 0
    return _wrote_update(export.diff_snapshots(export.read_snapshot(args.update_from), snapshot), out)


def _wrote_update(update: SnapshotUpdate, out: str) -> int:
    from psframe import export

    export.write_update(update, out)
    upserts = sum(len(change.upsert) for change in update.tables.values())
    deletes = sum(change.delete.numel() for change in update.tables.values())
    print(
        f"wrote the update from step {update.base_step} to step {update.step} to {out} ({len(update.dense)} dense "
        f"variables, {upserts} rows made or changed, {deletes} deleted)"
    )
    return 0
