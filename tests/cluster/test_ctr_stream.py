"""The CTR example on a stream, end to end as real processes: a NATS broker, the producer, 1 ps + 2
workers, ``psframe serve`` following their checkpoints and a client's queries; mid-run, a worker or
the ps task killed with SIGKILL and started again with the same flags, or the broker restarted.

This file holds the cluster tier's tests of the subject; `tests/unit/test_ctr_stream.py` holds the
other tiers'.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from psframe.checkpoint import files as checkpoint_files
from psframe.streams.local_broker import LocalBroker
from tests.conftest import ROOT, free_cluster, psframe_command
from tests.support.serve_jobs import call, wait_for

sys.path.insert(0, str(ROOT / "examples"))

from ctr_data import click_log

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "examples" / "ctr_stream.py"
EVENTS = 1500  # by each of two producers, the second once the killed worker is back
URL_LINE = re.compile(r"psframe serve: serving (http://127\.0\.0\.1:\d+) ")


def trained(output: str) -> int:
    """The events a worker said it trained, the last time it said so (0 before)."""
    return max((int(n) for n in re.findall(r"worker \d: (\d+) events trained", output)), default=0)


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lost", ["worker1", "ps0", "broker"])
def test_each_event_is_trained_once_through_a_task_or_the_broker_lost_and_served_as_it_trains(
    processes, tmp_path, lost
):
    """``lost``: worker 1 or ps task 0 killed with SIGKILL and started again with the same flags, or
    the broker stopped and started again on its port and store."""
    broker = LocalBroker(tmp_path / "nats").start()
    serve = None
    try:
        cluster, ckpt = free_cluster(1, 2), tmp_path / "ckpt"
        stream = [f"--broker_url={broker.url}", "--partitions=4"]
        flags = [
            *stream,
            f"--checkpoint_dir={ckpt}",
            "--save_secs=10",
            "--delta_secs=2",
            "--batch_size=64",
            "--idle_timeout=15",  # the workers finish 15 s after the last event
            "--worker_timeout=5",  # a killed worker's partitions go to the other after 5 s
            "--log_seconds=0.5",
            "--test_samples=500",
        ]
        processes.start_cluster(cluster, *flags, script=EXAMPLE)
        processes.start(
            "serve",
            psframe_command("serve", f"--checkpoint_dir={ckpt}", f"--model={EXAMPLE}:serving", "--poll_seconds=0.5"),
        )
        serve = processes.procs.pop("serve")  # it serves until stopped: not one of the processes that end
        for worker in ("worker0", "worker1"):  # events from when both train: each worker gets half
            processes.wait_for_output(worker, "connected to 1 ps tasks", 240)
        publish = [sys.executable, str(EXAMPLE), "--role=producer", *stream, f"--events={EVENTS}"]
        processes.start("producer", [*publish, "--events_per_second=150"])

        processes.wait_until("worker1", lambda out: trained(out) >= 200, "train 200 events", 240)
        processes.wait_for_output("worker0", "committed in", 120)  # a checkpoint to restore from
        chief_at_loss = trained(processes.procs["worker0"].output)
        if lost == "broker":
            broker.restart()
        else:
            victim = processes.procs.pop(lost)
            victim.popen.kill()  # SIGKILL, by its PID, mid-stream
            victim.popen.wait(timeout=30)
            restarted = processes.start_task(cluster, lost[:-1], int(lost[-1]), *flags, script=EXAMPLE)
            processes.wait_for_output(lost, "worker 1 connected" if lost == "worker1" else "serving at", 240)
        # More events once it is back (a restarted worker takes partitions again and trains on them).
        processes.start("producer_again", [*publish, "--events_per_second=300"])

        url = wait_for("psframe serve's line with its URL", lambda: URL_LINE.search(serve.output), 120).group(1)
        status = wait_for("a version of step > 0", lambda: (s := call(url, "/v1/status")[1]).get("step") and s, 240)
        held_out = click_log(8, buckets=None, seed=0, split=1)
        code, answer = call(
            url, "/v1/predict", {"inputs": {"dense": held_out.dense.tolist(), "ids": held_out.ids.tolist()}}
        )
        assert code == 200 and answer["step"] >= status["step"] > 0, answer
        probabilities = torch.tensor(answer["outputs"])
        assert probabilities.shape == (8,) and ((probabilities > 0) & (probabilities < 1)).all(), answer

        procs = processes.wait(timeout=400)  # the producer, the ps task and both workers exit 0
        produced = [last_json(procs[name].output) for name in ("producer", "producer_again")]
        assert [p["published"] for p in produced] == [EVENTS, EVENTS], produced
        ends = [max(ends) for ends in zip(*(p["ends"] for p in produced))]  # each partition's last event, + 1
        # ps 0 committed every partition's offset up to its end: every event trained, none twice
        committed = re.search(r"stream 'clicks' committed up to offsets \[([\d, ]+)\]", procs["ps0"].output)
        assert committed, procs["ps0"].output[-3000:]
        assert [int(x) for x in committed.group(1).split(",")] == ends
        chief = last_json(procs["worker0"].output)
        assert chief["events_trained"] > chief_at_loss and 0.5 < chief["auc"] <= chief["ceiling_auc"], chief
        if lost == "worker1":
            again = last_json(restarted.output)
            assert again["task_index"] == 1 and again["events_trained"] > 0, again
        if lost == "ps0":  # it came back from the checkpoint, and the workers went on from there: a worker
            # may learn it from a step sent again (a recovery), a push it refused, or its next ask for partitions
            assert re.search(r"restored \d+ variables from checkpoint step", restarted.output), restarted.output

        # psframe serve follows to the newest checkpoint committed (the chief's last, full), and
        # took deltas on the way
        newest = max(m.step for m in checkpoint_files.list_checkpoints(str(ckpt)))
        wait_for(f"serving step {newest}", lambda: call(url, "/v1/status")[1].get("step") == newest, 60)
        assert re.search(r"version \d+ is step \d+ \(full checkpoint \d+ and [1-9]\d* deltas\)", serve.output), (
            serve.output
        )
        served = [int(step) for step in re.findall(r"version \d+ is step (\d+)", serve.output)]
        assert served == sorted(served), served  # never back to an older step, a ps task restored or not
    finally:
        if serve is not None and serve.popen.poll() is None:
            serve.popen.terminate()
            serve.popen.wait(timeout=30)
        broker.stop()
