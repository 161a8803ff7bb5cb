"""What following a delta costs ``psframe serve``, and how many lookups it answers.

    python -m benchmarks.experiments.serve_follow [--rows 200000] [--changed 10000] [--deltas 5]

Two ps tasks in this process train a model whose dynamic table holds ``--rows`` rows of 64
float32 (and a dense head); a full checkpoint is taken, then ``--deltas`` deltas, each after a
step that changes ``--changed`` rows. For each delta, the update of the served snapshot is made
two ways and applied (:func:`psframe.export.apply_update`): from the delta's own shards
(:func:`psframe.serve.delta_update.read_delta_update`, what ``psframe serve`` does) and with
:func:`psframe.export.export_delta` (the export of the parent and of the delta, compared). It
prints the medians of both and checks that they hold the same bits as the checkpoint's export.

Then a server (:class:`psframe.serve.process.ServeProcess`) follows the folder and
``--clients`` threads of this process look up ``--ids`` random ids at a time over kept-alive
HTTP connections for ``--seconds``: it prints the lookups per second (client and server share
this process and its interpreter lock: a floor, not a ceiling).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time

import torch

import psframe
from psframe.checkpoint import files as checkpoint_files
from psframe.export import apply_update, export_checkpoint, export_delta
from psframe.export.from_checkpoint import snapshot_of_shards
from psframe.launch import pick_free_ports
from psframe.serve.delta_update import PartLayout, read_delta_update
from psframe.serve.process import ServeProcess

DIM = 64


class Table(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = psframe.DynamicEmbedding(DIM, initializer=psframe.RowInitializer(std=0.1, seed=1))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids)).square().mean()


def write_run(folder: str, rows: int, changed: int, deltas: int) -> None:
    ports = pick_free_ports(3)
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:2]], "worker": [f"127.0.0.1:{ports[2]}"]})
    servers = [psframe.Server(cluster, "ps", k, serving_processes=1) for k in range(2)]
    try:
        model = Table()
        checkpointing = psframe.Checkpointing(folder, save_steps=10**9, keep=3)
        with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1), checkpointing=checkpointing) as t:
            for start in range(0, rows, 50_000):  # every row made
                t.step(model(torch.arange(start, min(rows, start + 50_000))))
            t.save_checkpoint()
            generator = torch.Generator().manual_seed(0)
            for _ in range(deltas):
                t.step(model(torch.randperm(rows, generator=generator)[:changed]))
                t.save_delta()
    finally:
        for server in servers:
            server.stop(grace=0.1)


def measure_deltas(folder: str) -> tuple[list[float], list[float]]:
    base = checkpoint_files.list_checkpoints(folder)[-1]
    deltas = checkpoint_files.list_checkpoints(folder, deltas=True)
    start = time.perf_counter()
    shards = psframe.checkpoint.Chain(base).read_shards()
    print(f"reading the full checkpoint ({len(shards)} shards): {time.perf_counter() - start:.2f}s")
    served = snapshot_of_shards(shards, base)
    layout = PartLayout.of_shards(shards)
    own, exported = [], []
    for delta in deltas:
        start = time.perf_counter()
        ours = apply_update(served, read_delta_update(delta, layout, served))
        own.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = apply_update(served, export_delta(folder, delta.step))
        exported.append(time.perf_counter() - start)
        for name, table in theirs.tables.items():
            assert torch.equal(ours.tables[name].ids, table.ids) and torch.equal(ours.tables[name].rows, table.rows)
        served = ours
    expected = export_checkpoint(folder)
    assert torch.equal(served.tables["users"].rows, expected.tables["users"].rows), "not the export's bits"
    return own, exported


def measure_lookups(folder: str, rows: int, clients: int, ids: int, seconds: float) -> float:
    done = [0] * clients
    with ServeProcess(folder, poll_seconds=1.0) as served:
        deadline = time.monotonic() + 120
        while served.holder.current() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        stop = time.monotonic() + seconds

        def client(k: int) -> None:
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            generator = torch.Generator().manual_seed(k)
            while time.monotonic() < stop:
                body = json.dumps(
                    {"table": "users", "ids": torch.randint(0, rows, (ids,), generator=generator).tolist()}
                )
                connection.request("POST", "/v1/lookup", body, {"Content-Type": "application/json"})
                answer = connection.getresponse()
                answer.read()
                assert answer.status == 200
                done[k] += 1
            connection.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=seconds + 60)
        return sum(done) / (time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--changed", type=int, default=10_000)
    parser.add_argument("--deltas", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--ids", type=int, default=100, help="ids per lookup")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        write_run(folder, args.rows, args.changed, args.deltas)
        own, exported = measure_deltas(folder)
        print(
            f"one delta of {args.changed} changed rows on a table of {args.rows} rows x {DIM}: "
            f"from its own shards {statistics.median(own) * 1000:.0f} ms, "
            f"with export_delta {statistics.median(exported) * 1000:.0f} ms "
            f"({statistics.median(exported) / statistics.median(own):.1f}x), medians of {len(own)}"
        )
        rate = measure_lookups(folder, args.rows, args.clients, args.ids, args.seconds)
        print(f"lookups of {args.ids} ids, {args.clients} client threads: {rate:.0f}/s ({rate * args.ids:.0f} ids/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
