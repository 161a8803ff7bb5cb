#!/usr/bin/env python3
"""A torch.distributed.rpc parameter server for embedding tables: the baseline of :mod:`benchmarks.suite.sparse`.

What a PyTorch user writes without psframe, after the RPC parameter-server
tutorial: rank 0 (the ps) holds :class:`benchmarks.embedding_workload.CtrModel`'s table
and head, with ``torch.optim.Adagrad`` (which takes the table's sparse
gradient); rank 1 trains. Each step is two ``rpc_sync`` calls, as psframe's
are two round trips:

1. ``lookup(ids)``: the rows of the batch's distinct ids and the head's
   parameters;
2. ``push(ids, rows_grad, head_grads)``: the rows' gradients, sent as a
   ``torch.sparse_coo_tensor`` (what backward gives a ``sparse=True``
   embedding, coalesced), and the head's; the ps applies them.

TensorPipe over TCP on 127.0.0.1 only (transport ``uv``, channel ``basic``).
The trainer times its steps after warm-up (the median of a few windows) and
prints one JSON line.

    python -m benchmarks.baselines.rpc_sparse --port=29500 --rows=100000 --rank=0
    python -m benchmarks.baselines.rpc_sparse --port=29500 --rows=100000 --rank=1
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe listens on loopback only
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from benchmarks.common import emit, median
from benchmarks.embedding_workload import LEARNING_RATE, CtrModel, batches

PS_NAME = "ps"


class TableServer:
    """The model on rank 0: its table updated row by row, its head as a whole, under one lock."""

    def __init__(self, rows: int) -> None:
        self.model = CtrModel(rows, sparse=True)
        self.table = self.model.table.weight
        self.head = list(self.model.head.parameters())
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.optimizers = [
            torch.optim.Adagrad([self.table], lr=LEARNING_RATE),
            torch.optim.Adagrad(self.head, lr=LEARNING_RATE),
        ]
        self.lock = threading.Lock()

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with self.lock:
            return self.table.index_select(0, ids), [p.detach().clone() for p in self.head]

    def push(self, table_grad: torch.Tensor, head_grads: list[torch.Tensor]) -> None:
        with self.lock:
            self.table.grad = table_grad
            for p, g in zip(self.head, head_grads):
                p.grad = g
            for optimizer in self.optimizers:
                optimizer.step()


_SERVER: TableServer | None = None  # set on rank 0 before init_rpc


def lookup(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(runs on the ps) rows ``ids`` of the table, and the head."""
    return _SERVER.lookup(ids)


def push(table_grad: torch.Tensor, head_grads: list[torch.Tensor]) -> None:
    """(runs on the ps) apply one step's gradients."""
    _SERVER.push(table_grad, head_grads)


def train(args: argparse.Namespace) -> dict:
    model = CtrModel(args.rows, sparse=True)
    head = list(model.head.parameters())
    data = itertools.cycle(batches(args.rows))
    times = []
    for _ in range(args.warmup + args.steps):
        ids, target = next(data)
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows, values = rpc.rpc_sync(PS_NAME, lookup, args=(unique,))
        with torch.no_grad():
            for p, v in zip(head, values):
                p.copy_(v)
        rows.requires_grad_(True)
        logits = model.head(F.embedding(inverse, rows).sum(1)).squeeze(1)
        for p in head:
            p.grad = None
        F.mse_loss(torch.sigmoid(logits), target).backward()
        table_grad = torch.sparse_coo_tensor(unique.unsqueeze(0), rows.grad, (args.rows, rows.shape[1])).coalesce()
        rpc.rpc_sync(PS_NAME, push, args=(table_grad, [p.grad for p in head]))
        times.append(time.perf_counter())
    timed = times[args.warmup - 1 :]
    size = max(1, args.steps // args.windows)
    rates = [size / (timed[i + size] - timed[i]) for i in range(0, len(timed) - size, size)]
    return {"task": "trainer", "rows": args.rows, "steps_per_sec": median(rates), "window_rates": rates}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="rendezvous port on 127.0.0.1")
    parser.add_argument("--rank", type=int, required=True, help="0: the ps; 1: the trainer")
    parser.add_argument("--rows", type=int, required=True, help="rows of the table")
    parser.add_argument("--steps", type=int, default=300, help="timed steps")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    parser.add_argument("--windows", type=int, default=5, help="timing windows (the median is reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any RPC may take")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{args.port}",
        num_worker_threads=8,
        rpc_timeout=args.timeout,
        _transports=["uv"],
        _channels=["basic"],
    )
    global _SERVER
    if args.rank == 0:
        _SERVER = TableServer(args.rows)
        rpc.init_rpc(PS_NAME, rank=0, world_size=2, rpc_backend_options=options)
        rpc.shutdown(graceful=True, timeout=args.timeout)  # returns once the trainer has shut down
        emit({"task": "ps", "rows": args.rows})
        return 0
    rpc.init_rpc("trainer", rank=1, world_size=2, rpc_backend_options=options)
    try:
        result = train(args)
    finally:
        rpc.shutdown(graceful=True, timeout=args.timeout)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
