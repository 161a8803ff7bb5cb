#!/usr/bin/env python3
"""The CTR example online: click events from a stream, training as they come, served as it trains.

Four kinds of process, all this script (``./scripts/demo_stream.sh`` runs them together):

- the **producer** (``--role=producer``) publishes click events (13 dense features, 26
  int64 ids, the click, the event's wall-clock time; :data:`EVENT`, 272 bytes) to a NATS
  JetStream stream at ``--events_per_second``, spread over ``--partitions``;
- the **cluster** (``--job_name=ps|worker``, the flags of ``ctr_dist.py``, so that
  ``psframe launch --num_ps 1 --num_workers 2 examples/ctr_stream.py -- FLAGS`` runs it):
  the workers train ``ctr_dist.py``'s wide & deep model, its tables dynamic (a row made for
  each id on first touch), with Adagrad, on ``trainer.stream(...)``: each event once, however
  workers and ps tasks die and restart (docs/guides/streams.md). The chief commits a full
  checkpoint every ``--save_secs`` and a delta every ``--delta_secs``;
- **psframe serve** follows the checkpoints with this script's factory::

      psframe serve --checkpoint_dir ckpt/ --model examples/ctr_stream.py:serving -- FLAGS

  and answers ``POST /v1/predict`` with ``{"inputs": {"dense": [[13 floats], ...], "ids":
  [[26 ints], ...]}}`` by click probabilities;
- the **client** (``--role=client --serve_url URL``) asks it for its status and for the
  probabilities of held-out events every ``--query_seconds``, and prints their AUC.

The events are ``ctr_data.py``'s generated click log (its planted truth: the held-out AUC has a
known ceiling). A worker that finds no event for ``--idle_timeout`` seconds finishes (default:
never); then each worker prints one JSON line (the chief's with the held-out AUC), and ps task
0 logs the offsets it committed.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
import time
import urllib.request
from pathlib import Path

import numpy
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ctr_data import CATEGORICAL, DENSE, auc, ceiling_auc, click_log
from ctr_dist import WideAndDeep, evaluate

import psframe
from psframe.errors import StreamError
from psframe.flags import add_cluster_flags, add_security_flags, cluster_from_flags, run, security_from_flags
from psframe.hooks import NanGuardHook
from psframe.streams import JetStream

log = logging.getLogger("ctr_stream")
FIRST_VERSION_TIMEOUT_S = 600.0  # how long the client waits for psframe serve's first version

# --8<-- [start:event]
EVENT = numpy.dtype([("time", "<f8"), ("click", "<f4"), ("dense", "<f4", (DENSE,)), ("ids", "<i8", (CATEGORICAL,))])
"""One click event's bytes on the stream: a NumPy record, little-endian, 272 bytes (no pickle)."""


def encode(times: numpy.ndarray, clicks: torch.Tensor, dense: torch.Tensor, ids: torch.Tensor) -> list[bytes]:
    """Events as the producer publishes them: one record of :data:`EVENT` each."""
    events = numpy.zeros(len(times), EVENT)
    events["time"], events["click"], events["dense"], events["ids"] = times, clicks, dense, ids
    raw = events.tobytes()
    return [raw[i : i + EVENT.itemsize] for i in range(0, len(raw), EVENT.itemsize)]


def decode(values: list[bytes]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, numpy.ndarray]:
    """A batch of events: dense (n, 13) float32, ids (n, 26) int64, clicks (n,) float32, times (n,)."""
    wrong = [len(v) for v in values if len(v) != EVENT.itemsize]
    if wrong:
        raise ValueError(f"a click event is {EVENT.itemsize} bytes; records of {wrong[:3]} bytes are not events")
    events = numpy.frombuffer(b"".join(values), EVENT)
    tensor = torch.from_numpy
    return tensor(events["dense"].copy()), tensor(events["ids"].copy()), tensor(events["click"].copy()), events["time"]


# --8<-- [end:event]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_flags(parser)
    add_security_flags(parser)
    parser.add_argument(
        "--role",
        default=None,
        choices=["producer", "client"],
        help="producer: publish click events; client: query a psframe serve (default: a cluster task)",
    )
    parser.add_argument("--broker_url", default="nats://127.0.0.1:4222", help="the NATS server with JetStream")
    parser.add_argument("--stream", default="clicks", help="the JetStream stream of click events")
    parser.add_argument("--partitions", type=int, default=4, help="the stream's partitions")
    parser.add_argument("--events_per_second", type=float, default=200.0, help="producer: the rate it publishes at")
    parser.add_argument("--events", type=int, default=0, help="producer: stop after this many events (0: never)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the click log, its planted truth and the model")
    parser.add_argument("--batch_size", type=int, default=128, help="events per worker step at most")
    parser.add_argument("--learning_rate", type=float, default=0.05, help="Adagrad learning rate (on the ps)")
    parser.add_argument("--embedding_dim", type=int, default=8, help="width of the deep part's vectors")
    parser.add_argument("--hidden_units", type=int, default=64, help="units of the deep part's hidden layer")
    parser.add_argument(
        "--max_rows_per_ps", type=int, default=None, help="the most rows of a table a ps task keeps (least used go)"
    )
    parser.add_argument(
        "--row_ttl_seconds", type=float, default=None, help="forget the rows not trained on for this many seconds"
    )
    parser.add_argument(
        "--idle_timeout",
        type=float,
        default=None,
        help="worker: finish once no event came for this many seconds (default: train until stopped)",
    )
    parser.add_argument("--checkpoint_dir", default=None, help="chief: save checkpoints here; ps: restore from here")
    parser.add_argument("--save_secs", type=float, default=60.0, help="chief: a full checkpoint every S seconds")
    parser.add_argument("--delta_secs", type=float, default=5.0, help="chief: a delta checkpoint every S seconds")
    parser.add_argument(
        "--log_seconds", type=float, default=10.0, help="producer, worker: log progress every S seconds"
    )
    parser.add_argument("--test_samples", type=int, default=2000, help="held-out events the chief and the client score")
    parser.add_argument(
        "--worker_timeout",
        type=float,
        default=10.0,
        help="ps: seconds of silence after which a worker is presumed dead (its partitions go to the others)",
    )
    parser.add_argument(
        "--connect_timeout", type=float, default=120.0, help="seconds to wait for the other tasks before failing"
    )
    parser.add_argument("--serve_url", default=None, help="client: psframe serve's URL (http://127.0.0.1:PORT)")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="client: query for this many seconds from the first version served"
    )
    parser.add_argument("--query_seconds", type=float, default=5.0, help="client: query every S seconds")
    return parser.parse_args(argv)


def stream_of(args: argparse.Namespace) -> JetStream:
    """The stream of click events, made on the broker if it is not there."""
    events = JetStream(args.broker_url, args.stream, args.partitions)
    events.create()
    return events


def build_model(args: argparse.Namespace, kind: type[WideAndDeep] = WideAndDeep) -> WideAndDeep:
    """ctr_dist's wide & deep model with dynamic tables (any int64 id)."""
    torch.manual_seed(args.seed)  # the chief's initial values are the ones that count
    return kind(None, args.embedding_dim, args.hidden_units, args.max_rows_per_ps, 1, args.row_ttl_seconds)


# ---- the producer

BROKER_PATIENCE_S = 120.0  # how long the producer tries again to publish an event while the broker is away


def publish(events: JetStream, partition: int, value: bytes, event_id: str) -> int:
    """Publish one event (its offset), trying again while the broker is away (:data:`BROKER_PATIENCE_S`
    at most). Each try names the event's id, so an event the broker stored but whose acknowledgement
    was lost is stored once (the broker's duplicate window: two minutes)."""
    deadline, away = time.monotonic() + BROKER_PATIENCE_S, None
    while True:
        try:
            offset = events.publish(partition, value, msg_id=event_id)
            if away is not None:
                log.info("producer: the broker is back after %.1f s", time.monotonic() - away)
            return offset
        except StreamError as e:
            if time.monotonic() >= deadline:
                raise
            if away is None:
                log.warning("producer: %s; publishing again every second, for %g s at most", e, BROKER_PATIENCE_S)
                away = time.monotonic()
            time.sleep(1.0)


def produce(args: argparse.Namespace) -> int:
    """Publish click events at --events_per_second (each event's time is when it is published)."""
    if not args.events_per_second > 0:
        raise psframe.PsframeError(f"--events_per_second must be > 0, got {args.events_per_second}")
    published, ends, chunk = 0, [0] * args.partitions, 0
    producer = secrets.token_hex(6)  # this producer's events' ids: <producer>-<its index>
    start = time.monotonic()
    next_log = start + args.log_seconds
    with stream_of(args) as events:
        log.info(
            "producer: publishing to %s, stream %r, at %g events/s",
            args.broker_url,
            args.stream,
            args.events_per_second,
        )
        while not args.events or published < args.events:
            samples = click_log(1000, buckets=None, seed=args.seed, split=2 + chunk)  # 0: ctr_dist's, 1: held out
            chunk += 1
            for i in range(len(samples)):
                if args.events and published >= args.events:
                    break
                late = time.monotonic() - (start + published / args.events_per_second)
                start += max(0.0, late - 1.0)  # more than a second late (the broker was away): no burst after
                time.sleep(max(0.0, -late))
                at = slice(i, i + 1)
                (value,) = encode(numpy.array([time.time()]), samples.clicks[at], samples.dense[at], samples.ids[at])
                partition = published % args.partitions
                ends[partition] = publish(events, partition, value, f"{producer}-{published}") + 1
                published += 1
                if time.monotonic() >= next_log:
                    log.info("producer: %d events published", published)
                    next_log = max(next_log + args.log_seconds, time.monotonic())
    print(json.dumps({"role": "producer", "published": published, "ends": ends}), flush=True)
    return 0


# ---- the cluster


def run_ps(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> int:
    psframe.Server(
        cluster,
        "ps",
        task_index,
        worker_timeout=args.worker_timeout,
        checkpoint_dir=args.checkpoint_dir,
        security=security_from_flags(args),
    ).join()
    return 0


def run_worker(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> int:
    model = build_model(args)
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index=task_index,
        optimizer=psframe.optim.Adagrad(lr=args.learning_rate),  # and, row by row, for the tables
        hooks=[NanGuardHook()],
        checkpointing=psframe.Checkpointing(args.checkpoint_dir, save_secs=args.save_secs, delta_secs=args.delta_secs)
        if args.checkpoint_dir
        else None,
        transport=psframe.Transport(connect_timeout=args.connect_timeout),
        security=security_from_flags(args),
    )
    trained, loss = 0, torch.tensor(float("nan"))
    with stream_of(args) as events, trainer:
        start = last = time.monotonic()
        next_log = start + args.log_seconds
        # --8<-- [start:stream]
        for records in trainer.stream(events, args.batch_size, idle_timeout=args.idle_timeout):
            dense, ids, clicks, times = decode([record.value for record in records])
            loss = F.binary_cross_entropy_with_logits(model(dense, ids), clicks)
            trainer.step(loss)  # commits the records' offsets on ps 0 with the update
            # --8<-- [end:stream]
            trained, last = trained + len(records), time.monotonic()
            if last >= next_log:
                log.info(
                    "worker %d: %d events trained (%.0f/s), global step %d, loss %.4f, %.1f s behind the stream",
                    task_index,
                    trained,
                    trained / (last - start),
                    trainer.global_step,
                    loss.item(),
                    time.time() - float(times[-1]),  # the newest event trained: how old it is
                )
                next_log = max(next_log + args.log_seconds, last)
        result = {
            "role": "worker",
            "task_index": task_index,
            "global_step": trainer.global_step,
            "events_trained": trained,
            "events_per_sec": round(trained / max(last - start, 1e-9), 1),  # until the last event, idle time not
            "recoveries": trainer.stats.recoveries,
        }
        if trainer.is_chief:  # the model as trained, on held-out events (the tables' rows come with the lookups)
            trainer.pull()
            result |= evaluate(model, click_log(args.test_samples, buckets=None, seed=args.seed, split=1))
    print(json.dumps(result), flush=True)
    return 0


# ---- serving


class ClickProbability(WideAndDeep):
    """The served model: :class:`WideAndDeep`'s parameters and tables, answering probabilities."""

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(super().forward(dense, ids))


# --8<-- [start:factory]
def to_inputs(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's ``{"dense": [[13 floats], ...], "ids": [[26 ints], ...]}`` as the model's arguments."""
    dense = torch.tensor(inputs["dense"], dtype=torch.float32)
    ids = torch.tensor(inputs["ids"], dtype=torch.int64)
    if dense.dim() != 2 or dense.shape[1] != DENSE or ids.shape != (dense.shape[0], CATEGORICAL):
        raise ValueError(
            f"dense must be n lists of {DENSE} numbers and ids n lists of {CATEGORICAL} integers, got "
            f"shapes {list(dense.shape)} and {list(ids.shape)}"
        )
    return dense, ids


def serving(argv: list[str] | None = None) -> tuple[WideAndDeep, object]:
    """``psframe serve --model examples/ctr_stream.py:serving -- FLAGS``: the model the workers
    train (built from the same flags), answering click probabilities."""
    return build_model(parse_args(argv or []), ClickProbability), to_inputs


# --8<-- [end:factory]


# ---- the client


def call(url: str, body: dict | None = None) -> dict:
    """The JSON answer of a GET (no body) or a POST; raises on an HTTP error or after 30 s."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def first_version(url: str, timeout: float) -> None:
    """Wait until psframe serve at ``url`` serves a version (the chief's first checkpoint), ``timeout`` at most."""
    deadline, said = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            state = call(url + "/v1/status")["state"]
        except OSError as e:
            state = f"psframe serve does not answer yet ({type(e).__name__})"
        if state == "serving":
            return
        if state != said:
            print(f"[client] {state}", flush=True)
            said = state
        time.sleep(0.5)
    raise psframe.PsframeError(f"psframe serve at {url} served no version within {timeout:g}s")


def query(args: argparse.Namespace) -> int:
    """From the first version on, ask psframe serve every --query_seconds for its status and for the
    probabilities of held-out events, for --seconds."""
    if not args.serve_url:
        raise psframe.PsframeError("the client queries a psframe serve: give it --serve_url http://HOST:PORT")
    test = click_log(args.test_samples, buckets=None, seed=args.seed, split=1)
    ceiling = ceiling_auc(test)  # no model can do better than the click log's planted truth
    url = args.serve_url.rstrip("/")
    first_version(url, FIRST_VERSION_TIMEOUT_S)
    end = time.monotonic() + args.seconds
    while True:
        status = call(url + "/v1/status")
        inputs = [
            {"dense": test.dense[i : i + 500].tolist(), "ids": test.ids[i : i + 500].tolist()}
            for i in range(0, len(test), 500)
        ]
        probabilities = torch.tensor(
            [p for batch in inputs for p in call(url + "/v1/predict", {"inputs": batch})["outputs"]]
        )
        print(
            f"[client] step {status['step']} (version {status['version']}: {status['deltas_applied']} deltas on "
            f"step {status['base_step']}, committed {status['age_seconds']:.1f} s ago); P(click) of 3 held-out "
            f"events {[round(p, 3) for p in probabilities[:3].tolist()]}; held-out AUC "
            f"{auc(probabilities, test.clicks):.4f} over {len(test)} events (the truth's: {ceiling:.4f})",
            flush=True,
        )
        if time.monotonic() + args.query_seconds > end:
            return 0
        time.sleep(args.query_seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role == "producer":
        return produce(args)
    if args.role == "client":
        return query(args)
    psframe.tune_process()  # the allocator settings of a process that moves tensors every step
    cluster, job_name, task_index = cluster_from_flags(args)
    if job_name == "ps":
        return run_ps(args, cluster, task_index)
    return run_worker(args, cluster, task_index)


if __name__ == "__main__":
    # An expected failure (no broker, no ps task came up, a bad flag...) or Ctrl-C ends the
    # task with one line saying what to do, and exit code 1 or 130.
    sys.exit(run(main))
