"""The MNIST example across test hosts, through network partitions (tests/support/hosts.py).

Every task runs on a host of its own (a network namespace with its own
``/dev/shm``: every byte crosses the bridge), and links are cut (the host
loses carrier), black-holed (frames dropped, carrier up), made to flap, or a
ps task is SIGKILLed on its host and started again there. Oracles: every
process exits 0 unless the scenario says otherwise, the chief's test
accuracy is >= 97%, and each worker that lost a link is stepping again after
the heal -- the time from the heal to its next step is printed (``-s``) for
the record; the figures are in docs/decisions.md. Exactness after cuts
(each push applied once, SGD with a known gradient) is
tests/unit/test_exactly_once.py's and this module's last tests.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import sys
import time

import pytest

from tests.conftest import CLUSTER_JOB, MNIST_FLAGS, MNIST_STEPS, ROOT
from tests.support.host_jobs import HostJob, line_time
from tests.support.hosts import host_set  # noqa: F401  (a fixture, found by name)

# Each scenario bounds its own waits; the chief's takes 45 s of partition alone.
pytestmark = [pytest.mark.hosts, pytest.mark.mnist, pytest.mark.timeout(600)]

# The ps presumes a silent non-chief dead after this; the chief, after ten times it.
WORKER_TIMEOUT = 20.0
BASE_FLAGS = [
    "--log_every=200",
    f"--worker_timeout={WORKER_TIMEOUT}",
    "--connect_timeout=120",
    *MNIST_FLAGS,
]


def _job(host_set, tmp_path, mnist_dir, num_workers: int = 3, flags: tuple[str, ...] = ()) -> HostJob:
    names = ["ps0", *[f"w{i}" for i in range(num_workers)]]
    hosts = host_set(names)
    placement = {"ps0": "ps0", **{f"worker{i}": f"w{i}" for i in range(num_workers)}}
    return HostJob(hosts, placement, tmp_path, flags=[f"--data_dir={mnist_dir}", *BASE_FLAGS, *flags])


def _record(scenario: str, **figures: float | None) -> None:
    shown = ", ".join(f"{k} {'-' if v is None else f'{v:.3g}s'}" for k, v in figures.items())
    print(f"[hosts] {scenario}: {shown}", flush=True)


def _partition(job: HostJob, host: str, seconds: float, how: str = "cut") -> float:
    """Cut (or black-hole) ``host`` for ``seconds``, heal it; when it was healed (``time.time()``)."""
    getattr(job.hosts, how)(host)
    time.sleep(seconds)
    healed = time.time()
    job.hosts.heal(host)
    return healed


def _check_result(job: HostJob) -> dict:
    result = job.result("worker0")
    assert result["test_accuracy"] >= 0.97, result
    assert result["global_step"] >= MNIST_STEPS, result
    return result


# The example's default steps and batch, for scenarios that happen while others train (a worker
# cut, re-layouts): the job must outlast them by far, or a cut worker finds training over when
# it comes back, and a re-layout starts after the end.
LONG_RUN = ("--train_steps=6000", "--batch_size=100")


def test_a_worker_cut_for_15s_steps_again_after_the_heal(host_set, tmp_path, mnist_dir):
    job = _job(host_set, tmp_path, mnist_dir, flags=LONG_RUN)
    job.start_all()
    job.wait_for("worker1", r"local step 400,", timeout=120)
    healed = _partition(job, "w1", 15)
    job.wait(timeout=240)
    resumed = job.stepping_after("worker1", healed)
    _record("worker cut 15 s (async)", resumed=resumed)
    assert resumed is not None, job.report()
    assert "the ps tasks are back" in job.output("worker1")  # its stream died, and it came back
    _check_result(job)


@pytest.mark.parametrize("how", ["cut", "black_hole"])
def test_the_ps_host_cut_for_15s_every_worker_steps_again(host_set, tmp_path, mnist_dir, how):
    job = _job(host_set, tmp_path, mnist_dir)
    job.start_all()
    job.wait_for("worker0", r"local step 400,", timeout=120)
    healed = _partition(job, "ps0", 15, how)
    job.wait(timeout=240)
    resumed = {task: job.stepping_after(task, healed) for task in ("worker0", "worker1", "worker2")}
    _record(f"ps host {how} 15 s", **resumed)
    assert all(v is not None for v in resumed.values()), job.report()
    _check_result(job)


def test_sync_with_a_backup_worker_cut_steps_go_on_meanwhile(host_set, tmp_path, mnist_dir):
    job = _job(
        host_set,
        tmp_path,
        mnist_dir,
        flags=(
            "--sync_replicas",
            "--replicas_to_aggregate=2",
            "--total_num_replicas=3",
            "--sync_timeout=60",
            *LONG_RUN,
        ),
    )
    job.start_all()
    job.wait_for("worker2", r"local step 200,", timeout=120)
    cut = time.time()
    healed = _partition(job, "w2", 15)
    job.wait(timeout=300)
    # Rounds went on without the cut worker: the chief logged progress during the cut.
    during = [
        line
        for line in job.output("worker0").splitlines()
        if "local step" in line and cut + 2 < (line_time(line) or 0) < healed
    ]
    assert during, job.report()
    resumed = job.stepping_after("worker2", healed)
    _record("sync R=2/N=3, worker 2 cut 15 s", resumed=resumed)
    assert resumed is not None, job.report()
    assert _check_result(job)["sync_replicas"] is True


def test_bounded_staleness_holds_a_fast_chief_to_a_worker_on_a_slow_link(host_set, tmp_path, mnist_dir):
    """Worker 1's link is capped at 40 Mbit/s (a third of the chief's steps/s, or less): with
    --staleness_bound=1 neither worker is ever counted more than one step ahead of the other."""
    job = _job(host_set, tmp_path, mnist_dir, num_workers=2, flags=("--staleness_bound=1", "--train_steps=600"))
    job.hosts.cap("w1", 40)
    job.start_all()
    job.wait(timeout=300)
    chief = job.result("worker0")["steps_ahead"]
    done = re.search(r"steps ahead of the slowest worker: (\{.*\})", job.output("worker1"))
    assert done, job.report()
    worker = json.loads(done.group(1))
    print(f"[hosts] bounded staleness 1, worker 1 at 40 Mbit/s: steps ahead, chief {chief}, worker 1 {worker}")
    assert chief and max(int(k) for k in chief) <= 1, chief
    assert worker and max(int(k) for k in worker) <= 1, worker


@pytest.mark.timeout(900)  # its waits: 120 s, 360 s, 300 s
def test_sync_chief_cut_for_45s_comes_back_and_reports(host_set, tmp_path, mnist_dir):
    """The other workers finish while the chief is cut for over twice worker_timeout: the ps waits
    for the chief (it never ends a job without it), the chief comes back, writes its final
    checkpoint and prints its result."""
    checkpoints = tmp_path / "ckpt"
    job = _job(
        host_set,
        tmp_path,
        mnist_dir,
        flags=(
            "--sync_replicas",
            "--replicas_to_aggregate=2",
            "--total_num_replicas=3",
            "--sync_timeout=60",
            f"--checkpoint_dir={checkpoints}",
            "--save_checkpoint_steps=2000",
        ),
    )
    job.start_all()
    job.wait_for("worker0", r"local step 200,", timeout=120)
    # The situation is built, not raced: the chief stays cut until the other two workers have
    # finished and the ps says it waits for the chief alone (however long their last rounds take
    # on this machine), and for 45 s at least. A ps that ended training meanwhile exits, which
    # fails the wait.
    cut = time.monotonic()
    job.hosts.cut("w0")
    job.wait_for("ps0", r"waiting for the chief", timeout=360)
    time.sleep(max(0.0, cut + 45 - time.monotonic()))
    healed = time.time()
    job.hosts.heal("w0")
    job.wait(timeout=300)
    resumed = job.stepping_after("worker0", healed)
    _record("sync R=2/N=3, chief cut 45 s and more", resumed=resumed)
    assert resumed is not None, job.report()
    assert "training is over" not in job.output("ps0").split("waiting for the chief")[0]
    assert not re.search(r"\[0\] presumed dead", job.output("ps0"))
    result = _check_result(job)
    assert "checkpoint of global step" in job.output("worker0")
    final = max(int(m) for m in re.findall(r"checkpoint of global step (\d+) committed", job.output("worker0")))
    assert final == result["global_step"]


def test_a_flapping_ps_link_8_cuts_of_1_to_3s(host_set, tmp_path, mnist_dir):
    job = _job(host_set, tmp_path, mnist_dir)
    job.start_all()
    job.wait_for("worker0", r"local step 400,", timeout=120)
    rng = random.Random(0)
    for _ in range(8):
        healed = _partition(job, "ps0", rng.uniform(1.0, 3.0))
        time.sleep(rng.uniform(0.5, 1.5))
    job.wait(timeout=300)
    resumed = {task: job.stepping_after(task, healed) for task in ("worker0", "worker1", "worker2")}
    _record("ps link flapping, 8 cuts of 1-3 s", **resumed)
    _check_result(job)


def test_a_ps_killed_on_its_host_and_started_again_there(host_set, tmp_path, mnist_dir):
    checkpoints = tmp_path / "ckpt"
    job = _job(host_set, tmp_path, mnist_dir, flags=(f"--checkpoint_dir={checkpoints}", "--save_checkpoint_steps=500"))
    job.start_all()
    job.wait_for("worker0", r"checkpoint of global step \d+ committed", timeout=120)
    job.procs["ps0"].send_signal(signal.SIGKILL)
    job.procs["ps0"].wait(timeout=10)
    job.returncodes.clear()
    restarted = time.time()
    job.start("ps0")
    job.wait(timeout=240)
    assert re.search(r"restored \d+ variables from checkpoint step", job.output("ps0")), job.report()
    resumed = {task: job.stepping_after(task, restarted) for task in ("worker0", "worker1", "worker2")}
    _record("ps SIGKILLed and started again on its host", **resumed)
    assert all(v is not None for v in resumed.values()), job.report()
    _check_result(job)


def test_a_worker_whose_host_never_comes_back_fails_naming_the_ps(host_set, tmp_path, mnist_dir):
    job = _job(host_set, tmp_path, mnist_dir)
    job.start_all("--connect_timeout=20")
    job.wait_for("worker1", r"local step 400,", timeout=120)
    job.hosts.cut("w1")
    cut = time.monotonic()
    job.wait(timeout=180, expect={"worker1": 1})
    # Noticed within the keepalive (10 s), then 20 s of waiting: well within the deadline above.
    gave_up = time.monotonic() - cut
    _record("worker host gone for good", gave_up=gave_up)
    assert re.search(r"ConnectTimeoutError: .*waited [\d.]+s for /job:ps/task:0 at ", job.output("worker1")), (
        job.output("worker1")[-3000:]
    )
    _check_result(job)


def test_every_task_on_its_own_host_with_tls_and_a_token(host_set, tmp_path, mnist_dir):
    """No two tasks share a host (nor /dev/shm): every tensor crosses the network, in TLS."""
    trustme = pytest.importorskip("trustme")  # the test extra installs it
    job = _job(host_set, tmp_path, mnist_dir, num_workers=2)
    ca = trustme.CA()
    leaf = ca.issue_cert(*[job.hosts.address(name) for name in job.hosts.names])
    files = {"ca": ca.cert_pem, "cert": leaf.cert_chain_pems[0], "key": leaf.private_key_pem}
    flags = []
    for name, blob in files.items():
        path = tmp_path / f"{name}.pem"
        blob.write_to_path(str(path))
        path.chmod(0o600)
        flags.append(f"--tls_{name}_file={path}")
    token = tmp_path / "token"
    token.write_text("a-token-of-the-cross-host-test-0123456789\n")
    token.chmod(0o600)
    job.start_all(*flags, f"--auth_token_file={token}")
    job.wait(timeout=240)
    assert "(auth token, mutual TLS)" in job.output("ps0"), job.output("ps0")[-2000:]
    _check_result(job)


def _elastic_job(host_set, tmp_path, mnist_dir, flags: tuple[str, ...]) -> HostJob:
    """ps0 with --max_workers=3; workers 0 and 1 start in a cluster of two, worker 2 joins later."""
    return _job(
        host_set,
        tmp_path,
        mnist_dir,
        num_workers=3,
        flags=("--max_workers=3", "--worker_timeout=5", "--log_every=100", "--train_steps=1500", *flags),
    )


def _log_time(job: HostJob, task: str, pattern: str) -> float:
    """When ``task`` logged its first line matching ``pattern`` (``time.time()``)."""
    for line in job.output(task).splitlines():
        if re.search(pattern, line) and line_time(line) is not None:
            return line_time(line)
    pytest.fail(f"{task} never logged {pattern!r}:\n{job.report()}")


def test_elastic_async_a_worker_joins_from_its_host_and_one_drains(host_set, tmp_path, mnist_dir):
    """Worker 1 leaves after 300 of its steps (drained: its last push applied); worker 2, on a
    host of its own, joins the running job with a grown --worker_hosts; the job ends when every
    member finished, every process exits 0. The ps task serves from two processes."""
    job = _elastic_job(host_set, tmp_path, mnist_dir, ())
    job.start("ps0", "--serving_processes=2", workers=2)  # the workers' slots in shared memory too
    job.start("worker0", workers=2)
    job.start("worker1", "--max_local_steps=300", workers=2)
    job.wait_for("worker0", r"local step 100,", timeout=120)
    started = time.time()
    job.start("worker2")
    job.wait(timeout=300)
    joined = _log_time(job, "ps0", r"worker 2 joined at step")
    first_step = _log_time(job, "worker2", r"worker 2 connected to 1 ps tasks")
    _record(
        "elastic async, worker 2 joins",
        process_start_to_joined=joined - started,
        joined_to_training=first_step - joined,
    )
    ps_log = job.output("ps0")
    assert "worker 1 finished" in ps_log and "worker 2 finished" in ps_log, job.report()
    assert re.search(r"worker 2 done after \d+ local steps", job.output("worker2")), job.report()
    assert job.result("worker0")["test_accuracy"] >= 0.9


def test_elastic_sync_a_worker_joins_and_a_killed_one_is_left_behind(host_set, tmp_path, mnist_dir):
    """Sync rounds of all live workers: worker 2 joins at a round boundary; worker 1 is SIGKILLed,
    and the rounds go on without it once it has been silent for --worker_timeout (5 s)."""
    job = _elastic_job(host_set, tmp_path, mnist_dir, ("--sync_replicas", "--sync_timeout=60"))
    job.start("ps0", workers=2)
    job.start("worker0", workers=2)
    job.start("worker1", workers=2)
    job.wait_for("worker0", r"local step 100,", timeout=120)
    job.start("worker2")
    job.wait_for("worker2", r"local step 100,", timeout=120)
    killed = time.time()
    job.procs["worker1"].send_signal(signal.SIGKILL)
    job.wait(timeout=300, expect={"worker1": -signal.SIGKILL})
    ps_log = job.output("ps0")
    assert re.search(r"workers \[2\] take part in the sync rounds from step \d+", ps_log), job.report()
    left = _log_time(job, "ps0", r"workers \[1\] left the sync rounds")
    _record("elastic sync, worker 1 killed", rounds_go_on_after=left - killed)
    assert "presumed dead" in ps_log, job.report()
    result = _check_sync_result(job)
    assert result["test_accuracy"] >= 0.9


def _check_sync_result(job: HostJob) -> dict:
    result = job.result("worker0")
    assert result["sync_replicas"] is True and result["global_step"] >= 1500, result
    return result


def _seen(path) -> tuple[collections.Counter[int], list[int]]:
    """A worker's seen file: the examples of its applied steps, and those of a step it began last
    and never saw applied (a worker killed mid-step: that step may or may not have been applied)."""
    applied: collections.Counter[int] = collections.Counter()
    pending: list[int] = []
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("B "):
            pending = [int(i) for i in line[2:].split(",")]
        elif line == "A":
            applied.update(pending)
            pending = []
    return applied, pending


def test_data_read_exactly_once_with_a_worker_killed_and_one_added(host_set, tmp_path):
    """Three hosts of workers read 2 epochs of 4,000 examples in ranges: worker 1 is SIGKILLed
    mid-range, worker 2 joins the running job from its own host. Every example is trained on
    once an epoch: the batches whose steps were applied, over all workers, are the epochs (the
    killed worker's last batch, begun and never seen applied, counts if no other worker took it)."""
    names = ["ps0", "w0", "w1", "w2"]
    hosts = host_set(names)
    placement = {"ps0": "ps0", "worker0": "w0", "worker1": "w1", "worker2": "w2"}
    examples, epochs = 4000, 2
    flags = [
        "--max_workers=3",
        "--worker_timeout=3",
        f"--data_ranges={examples}",
        f"--epochs={epochs}",
        "--step_delay=0.01",
    ]
    job = HostJob(hosts, placement, tmp_path, script=CLUSTER_JOB, flags=flags)
    seen = {task: tmp_path / f"{task}.seen" for task in placement}
    # Two serving processes: a push that says how far it read is answered by the one that keeps the queue.
    job.start("ps0", "--serving_processes=2", workers=2)
    for task in ("worker0", "worker1"):
        job.start(task, f"--seen_file={seen[task]}", workers=2)
    job.wait_for("worker1", r"local step 60 ", timeout=120)
    job.procs["worker1"].send_signal(signal.SIGKILL)
    killed = time.time()
    job.start("worker2", f"--seen_file={seen['worker2']}")
    job.wait(timeout=300, expect={"worker1": -signal.SIGKILL})
    total: collections.Counter[int] = collections.Counter()
    for task in ("worker0", "worker2"):
        applied, pending = _seen(seen[task])
        assert not pending, f"{task} ended with a batch never applied"
        assert applied, f"{task} trained on nothing:\n{job.report()}"
        total += applied
    applied, pending = _seen(seen["worker1"])
    total += applied
    if pending and all(total[i] < epochs for i in pending):  # its last step was applied before the kill
        total.update(pending)
    assert total == collections.Counter({i: epochs for i in range(examples)}), (
        f"examples trained other than {epochs} times: "
        f"{sorted((i, n) for i, n in total.items() if n != epochs)[:20]}; "
        f"missing: {sorted(set(range(examples)) - set(total))[:20]}"
    )
    taken_back = _log_time(job, "ps0", r"presumed dead")
    _record("data exactly once, worker 1 killed", range_back_after=taken_back - killed)


def test_a_ps_task_added_from_its_own_host_and_drained_while_training(host_set, tmp_path, mnist_dir):
    """The job starts with one ps task; ``psframe reshard`` (run on worker 0's host) adds ps 1, started
    on a host of its own, and later drains it: the model's parts move there and back through the
    bridge while both workers train; ps 1's process exits 0 once drained, and the rest at the end."""
    hosts = host_set(["ps0", "ps1", "w0", "w1"])
    placement = {"ps0": "ps0", "ps1": "ps1", "worker0": "w0", "worker1": "w1"}
    job = HostJob(
        hosts,
        placement,
        tmp_path,
        flags=[f"--data_dir={mnist_dir}", *BASE_FLAGS, "--log_every=100", *LONG_RUN],
    )
    one_ps = job.cluster_flags(ps_tasks=1)
    both = job.cluster_flags()[0].removeprefix("--ps_hosts=")

    def reshard(cluster_flags: list[str], new_ps_hosts: str) -> str:
        done = hosts.run(
            "w0",
            [sys.executable, "-m", "psframe.cli", "reshard", *cluster_flags, f"--new_ps_hosts={new_ps_hosts}"],
            timeout=180,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, done.stderr[-3000:] + job.report()
        return done.stdout

    job.start("ps0", ps_tasks=1)
    job.start("worker0", ps_tasks=1)
    job.start("worker1", ps_tasks=1)
    job.wait_for("worker0", r"local step 300,", timeout=120)
    job.start("ps1")
    added = reshard(one_ps, both)
    job.wait_for("worker0", r"local step 1500,", timeout=120)
    drained = reshard(job.cluster_flags(), job.addresses["ps0"])
    job.wait(timeout=300)  # every process exits 0, the drained ps task too
    # The chief takes a re-layout one stage a step: stage k of n, each with its pause.
    stages = re.findall(r"stage (\d+) of (\d+): paused ([\d.]+) s", job.output("worker0"))
    ends = [i for i, (k, n, _) in enumerate(stages) if k == n]
    assert len(ends) == 2, job.report()  # two re-layouts, each to its last stage
    moves = [stages[: ends[0] + 1], stages[ends[0] + 1 : ends[1] + 1]]
    asked = [float(re.search(r"re-laid out ([\d.]+)s after asking", out).group(1)) for out in (added, drained)]
    for scenario, move, took in zip(("ps task added", "ps task drained"), moves, asked):
        pauses = [float(p) for _, _, p in move]
        _record(f"{scenario} ({len(move)} stages)", longest_stage=max(pauses), paused=sum(pauses), asked_to_done=took)
    assert "is drained" in job.output("ps1"), job.report()
    followed = [
        float(t) for t in re.findall(r"worker 1: follows the re-layout .* in ([\d.]+) s", job.output("worker1"))
    ]
    assert followed, job.report()
    _record("worker 1 rerouted", longest=max(followed), median=sorted(followed)[len(followed) // 2])
    result = job.result("worker0")
    assert result["test_accuracy"] >= 0.97 and result["global_step"] >= 6000, result
