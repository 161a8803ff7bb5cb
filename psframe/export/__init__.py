"""A feed for serving: snapshots of a model without its optimizer state, and updates between them.

A recommendation model trains for weeks while it serves. Serving takes a
:class:`Snapshot` of a checkpoint once (every parameter whole, and the rows of
each dynamic embedding table; never optimizer state), then a stream of
:class:`SnapshotUpdate` records, each taking the snapshot of one step to a
later one::

    from psframe import export

    base = export.export_checkpoint("ckpt/")                 # the latest valid checkpoint
    export.write_snapshot(base, "s3://feed/base.safetensors")
    ...                                                      # training goes on; a newer checkpoint
    newer = export.export_checkpoint("ckpt/")
    export.write_update(export.diff_snapshots(base, newer), "s3://feed/update-1.safetensors")

    # the serving side
    model = export.read_snapshot("s3://feed/base.safetensors")
    model = export.apply_update(model, export.read_update("s3://feed/update-1.safetensors"))

:func:`apply_update` does not care how an update was made: from two
snapshots (:func:`diff_snapshots`), or from anything else that knows the
rows made, changed and evicted since the base step.

Files are safetensors (an open format that readers in many languages load
without running code), written atomically (a temporary name, then moved into
place) and through fsspec, so paths may be any fsspec URL. The tensors'
names::

    snapshot                         update
    dense/<name>                     dense/<name>           a parameter (an update: its new value)
    table/<name>/ids                 upsert/<name>/ids      int64 ids, sorted: a table's rows / rows made or changed
    table/<name>/rows                upsert/<name>/rows     their rows, row i of ids[i]
                                     delete/<name>/ids      int64 ids, sorted: rows gone (tombstones)
    table/<name>/scales              upsert/<name>/scales   int8 rows only: float32, one per row

and the header's metadata (safetensors' string to string map): ``format``
(``"psframe-snapshot"`` or ``"psframe-update"``), ``format_version``
(``"1"``; ``"2"`` for a file holding int8 rows, which :func:`quantized`
makes), ``step``, ``base_step`` (an update's) and ``sha256`` (of the bytes
after the header, checked on reading).
"""

from psframe.export.diff import apply_update, diff_snapshots
from psframe.export.files import FORMAT_VERSION, read_snapshot, read_update, write_snapshot, write_update
from psframe.export.from_checkpoint import export_checkpoint, export_delta
from psframe.export.quantized import quantized
from psframe.export.snapshot import Snapshot, SnapshotUpdate, TableRows, TableUpdate

__all__ = [
    "FORMAT_VERSION",
    "Snapshot",
    "SnapshotUpdate",
    "TableRows",
    "TableUpdate",
    "apply_update",
    "diff_snapshots",
    "export_checkpoint",
    "export_delta",
    "quantized",
    "read_snapshot",
    "read_update",
    "write_snapshot",
    "write_update",
]
