"""Rows on local disk, by int64 id: the store under a dynamic table's disk tier.

:class:`DiskRows` keeps fixed-width records (a row, its optimizer state, its
ages and stamps: :class:`RecordLayout`) in an LMDB file, keyed by id, with a
batch of ids read, written or deleted in one transaction. LMDB is a B+tree
in a memory-mapped file: its pages are the kernel's page cache, which the
kernel gives back under memory pressure, so a ps task's own memory stays its
RAM tier (measured against RocksDB and memory-mapped slabs in
``docs/decisions.md``). Keys are the ids' bytes in an order that is the ids'
numeric order, so :meth:`DiskRows.scan` reads the rows sorted by id.

The file is scratch, never a checkpoint: it is written without syncing
(``sync=False``), lives in a folder of its own named after the process, and
is removed when its table part closes; a ps task that starts removes the
folders of processes no longer running (a ``kill -9`` leaves one behind),
and a restart restores rows from the checkpoint, never from here.
"""

from __future__ import annotations

import contextlib
import operator
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy
import torch

from psframe.errors import PsframeError
from psframe.memory.scratch import remove_orphans

_SIGN = numpy.uint64(1 << 63)
_FOLDER_PREFIX = "psframe-rows-"
_INITIAL_MAP_BYTES = 64 << 20


def _lmdb():
    try:
        import lmdb
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise PsframeError(
            "a table with a RAM budget keeps its other rows on disk with LMDB: pip install 'psframe[disk]' "
            "(the lmdb package)"
        ) from e
    return lmdb


class RecordLayout:
    """How one slot's tensors (a row, its per-row state, ages, stamps) are laid out in one record of bytes.

    Args:
        columns: by name, a per-slot tensor (first dimension: the slots) whose rows go in each record.
    """

    def __init__(self, columns: Mapping[str, torch.Tensor]) -> None:
        self.fields: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
        offset = 0
        for name, column in columns.items():
            width = int(numpy.prod(column.shape[1:], dtype=numpy.int64)) * column.element_size()
            self.fields.append((name, column.dtype, tuple(column.shape[1:]), offset, width))
            offset += width
        self.width = offset

    def names(self) -> list[str]:
        return [name for name, *_ in self.fields]

    def pack(self, columns: Mapping[str, torch.Tensor], slots: torch.Tensor) -> numpy.ndarray:
        """The records of ``slots`` (uint8, one row of :attr:`width` bytes per slot)."""
        parts = [
            columns[name].index_select(0, slots).contiguous().view(torch.uint8).reshape(slots.numel(), width)
            for name, _, _, _, width in self.fields
        ]
        return torch.cat(parts, dim=1).numpy() if parts else numpy.zeros((slots.numel(), 0), numpy.uint8)

    def unpack(self, records: numpy.ndarray) -> dict[str, torch.Tensor]:
        """The tensors of ``records`` (uint8, ``(n, width)``), by column name: one row per record."""
        data = torch.from_numpy(records)
        count = data.shape[0]
        return {
            name: _view(data[:, offset : offset + width], dtype, count, shape)
            for name, dtype, shape, offset, width in self.fields
        }

    def unpack_into(self, columns: Mapping[str, torch.Tensor], slots: torch.Tensor, records: numpy.ndarray) -> None:
        """Write the tensors of ``records`` into ``columns`` at ``slots``."""
        with torch.no_grad():
            for name, values in self.unpack(records).items():
                columns[name].index_copy_(0, slots, values.to(columns[name].dtype))


def _view(raw: torch.Tensor, dtype: torch.dtype, count: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` (uint8 columns of records) as ``count`` rows of ``dtype`` and ``shape``: a view where
    the column is aligned for the dtype (no copy), else a copy."""
    try:
        return raw.view(dtype).reshape(count, *shape)
    except RuntimeError:  # not aligned in the record for a view of this dtype
        return raw.contiguous().view(dtype).reshape(count, *shape)


class DiskRows:
    """Fixed-width records by int64 id in an LMDB file of a folder of its own under ``base``.

    Not thread-safe: its table part's holder serialises calls.

    Args:
        base: the folder the store's folder goes in (default: ``PSFRAME_TABLE_DISK_DIR``, else the
            system's temporary folder).
        name: a name for the folder (the table part's), made safe for a file name.
    """

    def __init__(self, name: str, base: str | None = None) -> None:
        lmdb = _lmdb()
        root = Path(base or os.environ.get("PSFRAME_TABLE_DISK_DIR") or tempfile.gettempdir())
        root.mkdir(parents=True, exist_ok=True)
        remove_orphans(str(root), _FOLDER_PREFIX)  # left by processes killed with kill -9
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-{safe}-", dir=root))
        self._map_bytes = _INITIAL_MAP_BYTES
        self._env = lmdb.open(
            str(self.folder),
            map_size=self._map_bytes,
            subdir=True,
            writemap=True,  # written through the map: no copy into a write buffer
            sync=False,  # scratch: a crash loses nothing a checkpoint holds
            metasync=False,
            readahead=False,  # random reads: reading ahead would fill the page cache with neighbours
            meminit=False,
            lock=False,  # one process, its calls serialised
        )
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def nbytes_on_disk(self) -> int:
        """Bytes the file takes on disk (its allocated blocks)."""
        return sum(p.stat().st_blocks * 512 for p in self.folder.iterdir() if p.is_file())

    def put(self, ids: torch.Tensor, records: numpy.ndarray) -> int:
        """Store ``records`` (uint8, one per id) under ``ids`` (int64, distinct), replacing those
        held; how many ids were not held."""
        if not ids.numel():
            return 0
        items = list(zip(_keys(ids), records.view(f"V{records.shape[1]}").reshape(-1).tolist()))
        before = self._count
        self._write(lambda txn: txn.cursor().putmulti(items, overwrite=True))
        return self._count - before

    def delete(self, ids: torch.Tensor) -> int:
        """Forget the records of those of ``ids`` held; how many there were."""
        if not ids.numel() or not self._count:
            return 0
        before = self._count
        self._write(lambda txn: [txn.delete(key) for key in _keys(ids)])
        return before - self._count

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, numpy.ndarray]:
        """The records of those of ``ids`` (int64) held, left where they are: their ids (in ``ids``'
        order) and records."""
        if not ids.numel() or not self._count:
            return ids[:0], numpy.zeros((0, 0), numpy.uint8)
        with self._env.begin() as txn:
            found = txn.cursor().getmulti(_keys(ids))
        return _ids_of([key for key, _ in found]), _records(list(map(operator.itemgetter(1), found)))

    def scan(self, count: int) -> Iterator[tuple[torch.Tensor, numpy.ndarray]]:
        """Every record, in batches of at most ``count``, sorted by id: (ids, records)."""
        after: bytes | None = None
        while True:
            with self._env.begin() as txn:
                cursor = txn.cursor()
                if not (cursor.set_range(after) if after is not None else cursor.first()):
                    return
                if after is not None and cursor.key() == after and not cursor.next():
                    return
                batch = []
                for key, value in cursor:
                    batch.append((key, value))
                    if len(batch) == count:
                        break
            if not batch:
                return
            after = batch[-1][0]
            yield _ids_of([k for k, _ in batch]), _records([v for _, v in batch])
            if len(batch) < count:
                return

    def clear(self) -> None:
        """Forget every record."""
        self._write(lambda txn: txn.drop(self._env.open_db(txn=txn), delete=False))

    def close(self) -> None:
        """Close the file and remove its folder."""
        with contextlib.suppress(Exception):
            self._env.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _write(self, work):
        """Run ``work(txn)`` in a write transaction, growing the map (doubled) while it is full."""
        lmdb = _lmdb()
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    done = work(txn)
                self._count = self._env.stat()["entries"]
                return done
            except lmdb.MapFullError:
                self._map_bytes *= 2
                self._env.set_mapsize(self._map_bytes)


def _keys(ids: torch.Tensor) -> list[bytes]:
    """8-byte keys whose byte order is the ids' numeric order (the sign bit flipped, big-endian)."""
    return (ids.numpy().view(numpy.uint64) ^ _SIGN).astype(">u8").view("V8").tolist()


def _ids_of(keys: Sequence[bytes]) -> torch.Tensor:
    raw = numpy.frombuffer(b"".join(keys), dtype=">u8").astype(numpy.uint64) ^ _SIGN
    return torch.from_numpy(raw.view(numpy.int64).copy())


def _records(values: Sequence[bytes]) -> numpy.ndarray:
    if not values:
        return numpy.zeros((0, 0), numpy.uint8)
    return numpy.frombuffer(b"".join(values), dtype=numpy.uint8).reshape(len(values), -1).copy()


__all__ = ["DiskRows", "RecordLayout"]
