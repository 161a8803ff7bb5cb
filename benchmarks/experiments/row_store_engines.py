"""The storage engines :mod:`benchmarks.experiments.row_stores` compares, behind one small interface.

Each holds a table of ``rows`` rows, a row being ``dim`` float32 values,
``dim`` float32 of Adagrad's sum and an int64 change stamp, packed as one
record of ``8 * dim + 8`` bytes (:func:`row_dtype`): a disk tier always moves
a row whole, so an engine stores it whole. An engine is loaded once in id
order (:meth:`Engine.load`), then read and written in batches of sorted,
distinct ids, the rows going in and out as three columns (weight, state,
stamp), as a ps's tensors hold them.

- :class:`InRam`, the reference: three torch tensors, ``index_select`` / ``index_copy_``.
- :class:`RocksDB`: RocksDB through ``rocksdict``, raw bytes, a bounded block cache
  and write buffer (its RAM stays bounded whatever the table), the write-ahead
  log off (the disk tier is no checkpoint: a restarted ps restores its
  checkpoint), the load as one sorted SST file ingested (and read back once
  into the page cache, as the other engines' loads leave their rows), reads by
  ``multi_get``, writes by one ``WriteBatch``; compression off or LZ4.
- :class:`Lmdb`: LMDB through ``lmdb``, ``map_size`` sized to the data,
  ``writemap``, no sync, one write transaction per batch, reads by
  ``Cursor.getmulti``.
- :class:`Memmap`: ``numpy.memmap`` of one slab of rows whose slot is the id: no
  index at all, which fits a fixed table only (see the experiment's docstring).

The key-value engines key a row by 8 bytes, big-endian with the sign bit
flipped, so that their byte order is the ids' numeric order (negative hashed
ids included) and a batch of sorted ids is a forward walk. Their APIs take and
give one ``bytes`` per row; everything else is vectorised: rows become
``bytes`` through a numpy void view's ``tolist()`` and come back through one
``numpy.frombuffer`` over ``b"".join(values)``.
"""

from __future__ import annotations

import operator
from pathlib import Path

import lmdb
import numpy as np
import rocksdict
import torch

from benchmarks.common import MiB

FIELDS = ("weight", "state", "stamp")
SIGN = np.uint64(1 << 63)  # flipped in keys: negative ids sort before positive ones
ROCKSDB_CACHE = 64 * MiB  # the block cache, index and filter blocks included
ROCKSDB_WRITE_BUFFER = 16 * MiB  # per memtable, two at most
REFERENCE = "in RAM"


class RowMismatch(AssertionError):
    """An engine returned rows whose bits differ from the rows last written, or none."""


def row_dtype(dim: int) -> np.dtype:
    """One row as a packed record: weight, Adagrad's sum, change stamp."""
    return np.dtype([("weight", "<f4", (dim,)), ("state", "<f4", (dim,)), ("stamp", "<i8")])


def pack(dtype: np.dtype, columns: tuple) -> np.ndarray:
    """Three columns (weight, state, stamp) as packed rows."""
    rows = np.empty(len(columns[2]), dtype)
    for name, column in zip(FIELDS, columns):
        rows[name] = np.asarray(column)
    return rows


def allocated_bytes(directory: Path) -> int:
    """Bytes the files under ``directory`` take on disk: allocated blocks, so a sparse file counts what it uses."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


class Engine:
    """One way of storing a table's rows: loaded once in id order, then read and written in batches."""

    name = ""

    def __init__(self, directory: Path, rows: int, dim: int) -> None:
        self.directory = directory
        self.dtype = row_dtype(dim)

    def load(self, first: int, rows: np.ndarray) -> None:
        """Store ``rows``, the rows of ids ``first``, ``first + 1``, ... (called in id order)."""
        raise NotImplementedError

    def finish_load(self) -> None:
        """The load's last call came."""

    def warm(self) -> None:
        """Bring the loaded rows into the page cache if the load left them out (untimed)."""

    def read(self, ids: np.ndarray) -> tuple:
        """The rows of ``ids`` (sorted, distinct) as columns: weight, state, stamp."""
        raise NotImplementedError

    def write(self, ids: np.ndarray, columns: tuple) -> None:
        """Replace the rows of ``ids`` with ``columns`` (weight, state, stamp)."""
        raise NotImplementedError

    def disk_bytes(self) -> int:
        return allocated_bytes(self.directory)

    def close(self) -> None:
        """Release the engine's files and memory (the caller removes its directory)."""


class InRam(Engine):
    """The reference: three torch tensors, as a table held in RAM is."""

    name = REFERENCE

    def __init__(self, directory: Path, rows: int, dim: int) -> None:
        super().__init__(directory, rows, dim)
        self.columns = (torch.empty(rows, dim), torch.empty(rows, dim), torch.empty(rows, dtype=torch.int64))

    def load(self, first: int, rows: np.ndarray) -> None:
        for column, name in zip(self.columns, FIELDS):
            column[first : first + len(rows)] = torch.from_numpy(rows[name])

    def read(self, ids: np.ndarray) -> tuple:
        index = torch.from_numpy(ids)
        return tuple(column.index_select(0, index) for column in self.columns)

    def write(self, ids: np.ndarray, columns: tuple) -> None:
        index = torch.from_numpy(ids)
        for column, new in zip(self.columns, columns):
            column.index_copy_(0, index, torch.from_numpy(new))

    def close(self) -> None:
        del self.columns


class KeyValue(Engine):
    """An engine keyed by bytes: one ``bytes`` per row in and out, the rest vectorised."""

    def keys(self, ids: np.ndarray) -> list[bytes]:
        """8-byte keys whose byte order is the ids' numeric order."""
        return (ids.view(np.uint64) ^ SIGN).astype(">u8").view("V8").tolist()

    def values(self, rows: np.ndarray) -> list[bytes]:
        return rows.view(f"V{self.dtype.itemsize}").tolist()

    def columns(self, ids: np.ndarray, values: list) -> tuple:
        """The columns of the rows in ``values``; a row missing (None, or fewer values) is an error."""
        try:
            rows = np.frombuffer(b"".join(values), self.dtype)
        except TypeError:  # a None among the values: a key not found
            rows = np.empty(0, self.dtype)
        if len(rows) != len(ids):
            raise RowMismatch(f"{self.name}: rows of {len(ids)} ids read, {len(ids) - len(rows)} of them missing")
        return rows["weight"], rows["state"], rows["stamp"]


class RocksDB(KeyValue):
    """RocksDB with bounded RAM: a fixed block cache holding index and filters too, two small memtables."""

    def __init__(self, directory: Path, rows: int, dim: int, compression: str = "none") -> None:
        super().__init__(directory, rows, dim)
        self.name = "rocksdb" if compression == "none" else f"rocksdb+{compression}"
        self.options = rocksdict.Options(raw_mode=True)
        self.options.create_if_missing(True)
        self.options.set_compression_type(getattr(rocksdict.DBCompressionType, compression)())
        self.options.set_write_buffer_size(ROCKSDB_WRITE_BUFFER)
        self.options.set_max_write_buffer_number(2)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(rocksdict.Cache(ROCKSDB_CACHE))
        table.set_bloom_filter(10, False)  # a get skips the files whose filter says the key is not there
        # Index and filters in the block cache, cut in 4 KiB partitions (only their top level pinned), so
        # that their RAM is bounded too: a whole file's index and filter (about 1.5% of its bytes) would
        # be one block each, larger than a shard of the cache, thrown out and read again at every get.
        table.set_cache_index_and_filter_blocks(True)
        table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
        table.set_partition_filters(True)
        table.set_pin_top_level_index_and_filter(True)
        self.options.set_block_based_table_factory(table)
        self.db = rocksdict.Rdict(str(directory / "db"), self.options)
        self.write_options = rocksdict.WriteOptions()
        self.write_options.disable_wal = True
        self.sst_path = directory / "load.sst"
        self.sst: rocksdict.SstFileWriter | None = None

    def load(self, first: int, rows: np.ndarray) -> None:
        # Sorted rows make an SST file directly, which RocksDB then takes as is: no memtable, no compaction.
        if self.sst is None:
            self.sst = rocksdict.SstFileWriter(self.options)
            self.sst.open(str(self.sst_path))
        for key, value in zip(self.keys(np.arange(first, first + len(rows))), self.values(rows)):
            self.sst[key] = value

    def finish_load(self) -> None:
        assert self.sst is not None, "nothing was loaded"
        self.sst.finish()
        ingest = rocksdict.IngestExternalFileOptions()
        ingest.set_move_files(True)
        self.db.ingest_external_file([str(self.sst_path)], ingest)

    def warm(self) -> None:
        # SstFileWriter drops what it writes from the page cache (RocksDB's invalidate_page_cache),
        # which no other engine's load does: read the files once, so that every engine starts with
        # its rows in the page cache and the reads compare the engines, not a cold disk with RAM.
        for path in filter(Path.is_file, self.directory.rglob("*")):
            with open(path, "rb") as file:
                while file.read(MiB):
                    pass

    def read(self, ids: np.ndarray) -> tuple:
        return self.columns(ids, self.db.get(self.keys(ids)))  # a list of keys: one multi_get

    def write(self, ids: np.ndarray, columns: tuple) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, value in zip(self.keys(ids), self.values(pack(self.dtype, columns))):
            batch.put(key, value)
        self.db.write(batch, self.write_options)

    def disk_bytes(self) -> int:
        self.db.flush()  # the memtables' rows too
        return super().disk_bytes()

    def close(self) -> None:
        self.db.close()


class Lmdb(KeyValue):
    """LMDB: one B+tree in a memory-mapped file, written through the map, never synced."""

    name = "lmdb"

    def __init__(self, directory: Path, rows: int, dim: int) -> None:
        super().__init__(directory, rows, dim)
        # A leaf entry is the row, its key and 10 bytes of node header and pointer. Twice that
        # (pages left half full by splits, the copies of the pages a transaction changes) and a margin.
        entry = self.dtype.itemsize + 8 + 10
        self.env = lmdb.open(
            str(directory / "db"),
            map_size=2 * rows * entry + 64 * MiB,
            writemap=True,
            sync=False,
            metasync=False,
            readahead=False,  # random reads: reading ahead would fill RAM with the rows' neighbours
            meminit=False,
        )

    def load(self, first: int, rows: np.ndarray) -> None:
        with self.env.begin(write=True) as txn:
            items = zip(self.keys(np.arange(first, first + len(rows))), self.values(rows))
            _, added = txn.cursor().putmulti(items, append=True)  # in key order: no search, full pages
        if added != len(rows):
            raise RuntimeError(f"lmdb: the load wrote {added} of {len(rows)} rows")

    def read(self, ids: np.ndarray) -> tuple:
        with self.env.begin() as txn:
            pairs = txn.cursor().getmulti(self.keys(ids))  # (key, value) for each key found, in order
        return self.columns(ids, list(map(operator.itemgetter(1), pairs)))

    def write(self, ids: np.ndarray, columns: tuple) -> None:
        with self.env.begin(write=True) as txn:
            items = zip(self.keys(ids), self.values(pack(self.dtype, columns)))
            consumed, _ = txn.cursor().putmulti(items)
        if consumed != len(ids):
            raise RuntimeError(f"lmdb: a write took {consumed} of {len(ids)} rows")

    def close(self) -> None:
        self.env.close()


class Memmap(Engine):
    """One slab of packed rows in a mapped file, the id being the row's slot: a fixed table."""

    name = "memmap"

    def __init__(self, directory: Path, rows: int, dim: int) -> None:
        super().__init__(directory, rows, dim)
        self.slab = np.memmap(directory / "rows", self.dtype, mode="w+", shape=(rows,))

    def load(self, first: int, rows: np.ndarray) -> None:
        self.slab[first : first + len(rows)] = rows

    def read(self, ids: np.ndarray) -> tuple:
        rows = np.asarray(self.slab[ids])  # a gather: a copy, not a view of the map
        return rows["weight"], rows["state"], rows["stamp"]

    def write(self, ids: np.ndarray, columns: tuple) -> None:
        self.slab[ids] = pack(self.dtype, columns)  # one scatter of whole rows: each row's page once

    def close(self) -> None:
        del self.slab  # unmaps it


def rocksdb_lz4(directory: Path, rows: int, dim: int) -> RocksDB:
    return RocksDB(directory, rows, dim, "lz4")


ENGINES = (InRam, RocksDB, rocksdb_lz4, Lmdb, Memmap)  # the reference first: the others' ratios need it
