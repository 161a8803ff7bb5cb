"""Freshness: how long a click event takes from its publication to the rows ``psframe serve`` answers.

    python -m benchmarks.suite.freshness [--quick] [--seconds 90] [--rate 100] [--delta_secs 5]
        [--plot docs/benchmarks-freshness.png]

The CTR example on a stream (``examples/ctr_stream.py``) runs as processes of its own: a local
NATS broker (:mod:`psframe.streams.local_broker`), 1 ps task and 2 workers training on the
stream with dynamic tables, the chief committing a delta checkpoint every ``--delta_secs`` (a
full one every minute), and ``psframe serve`` following the folder (looking every 0.5 s). This
process publishes click events at ``--rate``, each stamped with its wall-clock time and
carrying, as its last categorical feature, an id no other event has: its row in the wide table
is made by the training step on it, so the first lookup that finds the row is when the event
reached the served model. The window measured opens 2 s after ``psframe serve`` serves its
first version and lasts ``--seconds``; events go on after it until every event of the window
is served, so that its last ones reach a delta as the others did. A thread asks ``POST
/v1/lookup`` for every event published and not yet found, every 0.25 s; ``--lookup_clients``
other threads look up 100 ids of the served table at a time, one request after the other,
through the window (the serving load).

Printed, of the events published in the window: the rate published and trained (the workers'
own counts, logged every second), event-to-served latency (p50, p90, p99, max: the time of the
answer that first held its row, less its time of publication; the poll adds up to 0.25 s), the
versions served and the lookups answered per second. The plot (``--plot``) shows the counts
published, trained and served over time, and each event's latency at its time of publication,
with the versions' switches.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import itertools
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy
import torch

from benchmarks.children import Children
from benchmarks.common import ROOT, BenchmarkError, Deadline, example_module
from benchmarks.formatting import format_number, markdown_table
from psframe.launch import pick_free_ports
from psframe.streams import JetStream
from psframe.streams.local_broker import LocalBroker

FULL = {"seconds": 60.0, "rate": 200.0}
QUICK = {"seconds": 8.0, "rate": 20.0}
PARTITIONS = 4
POOL_EVENTS = 200  # the serving load looks up the ids of the first events (their other features')
CHUNK = 1000  # events drawn from the click log at once
POLL_S = 0.25  # how often the events not yet served are looked up
LOOKUP_IDS = 100  # ids per request of the serving load
DRAIN_S = 60.0  # how long after the last event every event has to be served
TABLE = "wide"  # the wide part's table: a row of one number per id
EXAMPLE = ROOT / "examples" / "ctr_stream.py"
LOG_TIME = re.compile(r"^(?:\[\w+\] )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
TRAINED = re.compile(r"worker (\d): (\d+) events trained")
VERSION = re.compile(r"psframe serve: version (\d+) is step (\d+)")


def event_id(index: int) -> int:
    """The id of event ``index``: negative, which no id of the click log is."""
    return -1 - index


class Http:
    """JSON over one kept-alive HTTP connection, each request with a deadline."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self._connection = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body)
        self._connection.request("GET" if data is None else "POST", path, data, {"Content-Type": "application/json"})
        answer = self._connection.getresponse()
        return answer.status, json.loads(answer.read())

    def close(self) -> None:
        self._connection.close()


class Publisher(threading.Thread):
    """Publishes events ``0, 1, ...`` at ``rate`` until stopped, each with its time and its own id
    (:func:`event_id`); keeps each one's time of publication."""

    def __init__(self, url: str, rate: float) -> None:
        super().__init__(name="freshness-publisher", daemon=True)
        self.url, self.rate = url, rate
        self.ctr = example_module("ctr_stream")  # imported here, not in the thread
        self.times: list[float] = []  # of event i: time.time() as it was published
        self._first = self.ctr.click_log(CHUNK, buckets=None, seed=0, split=5)
        self.pool = sorted(set(self._first.ids[:POOL_EVENTS, :-1].flatten().tolist()))
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        ctr = self.ctr
        try:
            with JetStream(self.url, "clicks", PARTITIONS) as events:
                events.create()
                start, i = time.monotonic(), 0
                for chunk in itertools.count():
                    samples = self._first if chunk == 0 else ctr.click_log(CHUNK, buckets=None, seed=0, split=5 + chunk)
                    samples.ids[:, -1] = torch.arange(event_id(i), event_id(i + CHUNK), -1)  # each event's own id
                    for k in range(CHUNK):
                        if self.stop.wait(max(0.0, start + i / self.rate - time.monotonic())):
                            return
                        now, at = time.time(), slice(k, k + 1)
                        (value,) = ctr.encode(
                            numpy.array([now]), samples.clicks[at], samples.dense[at], samples.ids[at]
                        )
                        events.publish(i % PARTITIONS, value)
                        self.times.append(now)
                        i += 1
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            self.error = e


def poll_served(
    serve_url: str, publisher: Publisher, served: dict[int, float], until: threading.Event, errors: list
) -> None:
    """Look up the events published and not yet found every :data:`POLL_S`; note when each is found."""
    client, first = Http(serve_url), 0
    try:
        while not until.wait(POLL_S):
            while first in served:
                first += 1
            pending = [i for i in range(first, len(publisher.times)) if i not in served]
            if not pending:
                continue
            code, answer = client.call("/v1/lookup", {"table": TABLE, "ids": [event_id(i) for i in pending]})
            now = time.time()
            if code != 200:
                raise BenchmarkError(f"psframe serve answered a lookup with {code}: {answer}")
            for i, row in zip(pending, answer["rows"]):
                if row is not None:
                    served[i] = now
    except BaseException as e:  # noqa: BLE001 (reported by the main thread)
        errors.append(e)
    finally:
        client.close()


def lookup_load(serve_url: str, pool: list[int], seed: int, until: threading.Event, done: list, errors: list) -> None:
    """Look up :data:`LOOKUP_IDS` random ids of ``pool`` at a time, one request after the other; count them."""
    client = Http(serve_url)
    generator = numpy.random.default_rng(seed)
    try:
        while not until.is_set():
            ids = [pool[k] for k in generator.integers(0, len(pool), LOOKUP_IDS)]
            code, answer = client.call("/v1/lookup", {"table": TABLE, "ids": ids})
            if code != 200:
                raise BenchmarkError(f"psframe serve answered a lookup with {code}: {answer}")
            done.append(time.time())
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    finally:
        client.close()


def log_times(text: str, pattern: re.Pattern) -> list[tuple[float, re.Match]]:
    """``(time.time() of the line, match)`` of each logged line matching ``pattern``."""
    found = []
    for line in text.splitlines():
        stamp, match = LOG_TIME.match(line), pattern.search(line)
        if stamp and match:
            found.append((datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), match))
    return found


def trained_by(worker_logs: list[str]) -> list[tuple[float, int]]:
    """``(time, events trained by all workers so far)`` at each worker's progress line."""
    lines = sorted((t, int(m.group(1)), int(m.group(2))) for log in worker_logs for t, m in log_times(log, TRAINED))
    counts: dict[int, int] = {}
    out = []
    for t, worker, count in lines:
        counts[worker] = count
        out.append((t, sum(counts.values())))
    return out


def count_at(series: list[tuple[float, int]], at: float) -> int:
    """A step function's value at ``at``: the last count logged at or before it."""
    before = [count for t, count in series if t <= at]
    return before[-1] if before else 0


def run_freshness(
    seconds: float, rate: float, delta_secs: float = 5.0, lookup_clients: int = 1, timeout: float = 900.0
) -> dict:
    """Run the job and the measurement; the results, with the timeline the plot draws."""
    deadline = Deadline(timeout, "freshness benchmark")
    with tempfile.TemporaryDirectory(prefix="psframe-bench-fresh-") as folder, Children(Path(folder)) as children:
        broker = LocalBroker(Path(folder) / "nats").start()
        try:
            return _measure(children, broker, Path(folder), seconds, rate, delta_secs, lookup_clients, deadline)
        finally:
            children.kill_all()
            broker.stop()


def _measure(
    children: Children,
    broker: LocalBroker,
    folder: Path,
    seconds: float,
    rate: float,
    delta_secs: float,
    lookup_clients: int,
    deadline: Deadline,
) -> dict:
    ports = pick_free_ports(3)
    cluster = [f"--ps_hosts=127.0.0.1:{ports[0]}", f"--worker_hosts=127.0.0.1:{ports[1]},127.0.0.1:{ports[2]}"]
    flags = [
        f"--broker_url={broker.url}",
        f"--partitions={PARTITIONS}",
        f"--checkpoint_dir={folder / 'ckpt'}",
        "--save_secs=60",
        f"--delta_secs={delta_secs}",
        "--idle_timeout=20",  # the workers finish 20 s after the last event
        "--log_seconds=1",
    ]
    for job, index in (("ps", 0), ("worker", 0), ("worker", 1)):
        argv = [sys.executable, str(EXAMPLE), *cluster, f"--job_name={job}", f"--task_index={index}", *flags]
        children.start(f"{job}{index}", argv)
    serve_argv = [sys.executable, "-m", "psframe.cli", "serve", f"--checkpoint_dir={folder / 'ckpt'}"]
    children.start("serve", [*serve_argv, f"--model={EXAMPLE}:serving", "--poll_seconds=0.5"])
    serve_url = children.wait_for_output("serve", r"serving (http://127\.0\.0\.1:\d+)", deadline.remaining()).group(1)

    # Events from now until every event of the window is served: the window opens once psframe
    # serve serves a version (trained on the events before), and the events after it keep the
    # workers stepping, so that the last of the window reach a delta as the others did.
    publisher = Publisher(broker.url, rate)
    publisher.start()
    status = Http(serve_url)
    while status.call("/v1/status")[1].get("state") != "serving":
        deadline.check("waiting for psframe serve's first version")
        if publisher.error is not None:
            raise BenchmarkError(f"publishing failed: {publisher.error!r}") from publisher.error
        time.sleep(0.2)
    status.close()
    served: dict[int, float] = {}
    errors: list[BaseException] = []
    lookups: list[float] = []
    until, load_until = threading.Event(), threading.Event()
    threads = [threading.Thread(target=poll_served, args=(serve_url, publisher, served, until, errors), daemon=True)]
    threads += [
        threading.Thread(target=lookup_load, args=(serve_url, publisher.pool, k, load_until, lookups, errors))
        for k in range(lookup_clients)
    ]
    for thread in threads:
        thread.start()
    start = time.time() + 2.0  # the poll catches up with the events before the first version
    end = start + seconds
    window: list[int] = []
    try:
        while time.time() < end and publisher.error is None and not errors:
            deadline.check("publishing")
            time.sleep(0.2)
        load_until.set()
        window = [i for i, t in enumerate(publisher.times) if start <= t < end]
        drain = time.monotonic() + DRAIN_S
        while any(i not in served for i in window) and time.monotonic() < drain:
            if publisher.error is not None or errors:
                break
            deadline.check("waiting for the window's last events to be served")
            time.sleep(POLL_S)
    finally:
        until.set()
        load_until.set()
        publisher.stop.set()
        for thread in [*threads, publisher]:
            thread.join(30)
    if publisher.error is not None:
        raise BenchmarkError(f"publishing failed: {publisher.error!r}") from publisher.error
    if errors:
        raise BenchmarkError(f"a lookup failed: {errors[0]!r}") from errors[0]
    children.procs["serve"].terminate()
    for name in ("worker0", "worker1", "ps0"):  # the workers finish once the stream is idle, then the ps task
        code = children.wait_exit(name, deadline.remaining())
        if code != 0:
            raise BenchmarkError(f"{name} exited with {code}:\n{children.log_tail(name)}")
    times = numpy.array(publisher.times)
    latency = numpy.array([served[i] - times[i] for i in window if i in served])
    trained = trained_by([children.log_path(f"worker{k}").read_text() for k in range(2)])
    versions = [(t, int(m.group(2))) for t, m in log_times(children.log_path("serve").read_text(), VERSION)]
    return {
        "seconds": seconds,
        "rate": rate,
        "delta_secs": delta_secs,
        "published": len(window),
        "published_per_s": len(window) / seconds,
        "trained_per_s": (count_at(trained, end) - count_at(trained, start)) / seconds,
        "served": len(latency),
        "not_served": len(window) - len(latency),
        "p50": float(numpy.percentile(latency, 50)) if len(latency) else float("nan"),
        "p90": float(numpy.percentile(latency, 90)) if len(latency) else float("nan"),
        "p99": float(numpy.percentile(latency, 99)) if len(latency) else float("nan"),
        "max": float(latency.max()) if len(latency) else float("nan"),
        "versions": len([t for t, _ in versions if start <= t < end]),
        "lookup_clients": lookup_clients,
        "lookups_per_s": len([t for t in lookups if start <= t < end]) / seconds,
        "timeline": {
            "start": start,
            "end": end,
            "published": times.tolist(),
            "served": [served.get(i) for i in range(len(times))],
            "trained": trained,
            "versions": versions,
        },
    }


def freshness_table(r: dict) -> str:
    return markdown_table(
        [
            "events/s published",
            "events/s trained",
            "delta every",
            "p50",
            "p90",
            "p99",
            "max",
            "not served",
            "versions",
            "lookups/s",
        ],
        [
            [
                format_number(r["published_per_s"]),
                format_number(r["trained_per_s"]),
                f"{r['delta_secs']:g} s",
                f"{r['p50']:.2f} s",
                f"{r['p90']:.2f} s",
                f"{r['p99']:.2f} s",
                f"{r['max']:.2f} s",
                f"{r['not_served']:,} of {r['published']:,}",
                f"{r['versions']:,}",
                f"{format_number(r['lookups_per_s'])} ({LOOKUP_IDS} ids each, {r['lookup_clients']} client)",
            ]
        ],
    )


def plot_freshness(r: dict, path: Path) -> None:
    """Counts published, trained and served over time, and each event's latency, the window measured
    shaded (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = r["timeline"]
    t0 = timeline["published"][0]  # the first event
    published = numpy.array(timeline["published"]) - t0
    served = numpy.array([numpy.nan if t is None else t - t0 for t in timeline["served"]])
    window = (timeline["start"] - t0, timeline["end"] - t0)
    inside = (published >= window[0]) & (published < window[1])
    fig, (counts, latency) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    counts.plot(published, numpy.arange(1, len(published) + 1), label="published")
    trained = [(t - t0, count) for t, count in timeline["trained"]]
    counts.step([t for t, _ in trained], [c for _, c in trained], where="post", label="trained (the workers' counts)")
    found = numpy.sort(served[~numpy.isnan(served)])
    counts.plot(found, numpy.arange(1, len(found) + 1), label="served (its row found through psframe serve)")
    counts.set_ylabel("events since the first")
    counts.set_title(
        f"Freshness: {r['published_per_s']:.0f} events/s, a delta every {r['delta_secs']:g} s, "
        f"{r['lookups_per_s']:.0f} lookups/s of {LOOKUP_IDS} ids served meanwhile"
    )
    counts.legend(loc="upper left", fontsize=8)
    latency.scatter(published[~inside], (served - published)[~inside], s=3, color="0.6", label="an event")
    latency.scatter(published[inside], (served - published)[inside], s=3, label="an event of the window measured")
    for q, style in (("p50", "--"), ("p99", ":")):
        latency.axhline(r[q], color="k", linestyle=style, linewidth=1, label=f"{q} of the window: {r[q]:.2f} s")
    for t, _ in timeline["versions"]:
        latency.axvline(t - t0, color="tab:orange", alpha=0.3, linewidth=1)
    latency.set_xlabel("seconds since the first event (shaded: the window measured; orange: a new version served)")
    latency.set_ylabel("seconds from published to served")
    latency.set_xlim(0, float(numpy.nanmax(served)) + 1)
    latency.set_ylim(bottom=0)
    latency.legend(loc="upper right", fontsize=8)
    for ax in (counts, latency):
        ax.axvspan(*window, color="tab:blue", alpha=0.06)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['rate']:g} events/s for {QUICK['seconds']:g} s")
    parser.add_argument("--seconds", type=float, default=None, help=f"publish for this long ({FULL['seconds']:g})")
    parser.add_argument("--rate", type=float, default=None, help=f"events per second ({FULL['rate']:g})")
    parser.add_argument("--delta_secs", type=float, default=5.0, help="the chief's delta checkpoints' interval")
    parser.add_argument("--lookup_clients", type=int, default=1, help="threads looking up rows the whole while")
    parser.add_argument("--plot", default=None, help="write the timeline's plot here (a .png)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    load = os.getloadavg()
    result = run_freshness(
        args.seconds or size["seconds"], args.rate or size["rate"], args.delta_secs, args.lookup_clients
    )
    print(
        f"{os.cpu_count()} cores; load average (1/5/15 min) before: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, "
        "after: {:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg())
    )
    print(freshness_table(result))
    if args.plot:
        plot_freshness(result, Path(args.plot))
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1))
    if result["not_served"]:
        raise BenchmarkError(f"{result['not_served']} events were not served within {DRAIN_S:g} s of the last")
    return 0


if __name__ == "__main__":
    sys.exit(main())
