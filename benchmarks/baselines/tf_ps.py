#!/usr/bin/env python3
"""A TensorFlow 1.x-style parameter server, the baseline psframe's design comes from.

TF's between-graph replication, as its distributed-training guide for TF 1.x
wrote it: every task starts a ``tf.compat.v1.train.Server`` of the same
``ClusterSpec`` (1 ps, N workers, on 127.0.0.1); every worker builds its own
graph under ``tf.compat.v1.train.replica_device_setter``, which puts the
variables (and their updates) on the ps and the rest on the worker, and runs
``GradientDescentOptimizer.minimize`` in a plain session on its own server:

- async: one ``session.run`` per worker step reads every variable from the
  ps, computes the gradients on the worker, and has the ps apply them at once
  (``ApplyGradientDescent``, TF's default ``use_locking=False``) and add 1 to
  ``global_step``. On the wire that is one ``RunGraph`` call to the ps plus a
  ``RecvTensor`` transfer per tensor that crosses (every variable to the worker,
  every gradient to the ps).

The model, its initial values and the data are the torch ones: the parent
(which has torch) writes them to an ``.npz`` file (``--inputs``; see
:func:`benchmarks.baselines.tf_env.write_inputs`) with the Linear weights in torch's
``(out, in)`` layout; here they are transposed to TF's ``(in, out)``. Batches
are drawn from that data with numpy (a new permutation each epoch, seeded by
the task index), not with torch's generator: the same data, another order.

The chief (worker 0) initialises the variables on the ps from those values;
the other workers wait until they are; then the workers meet at a file barrier
so that timing starts together. Every worker trains until ``global_step``
reaches (warmup + steps) x workers, so all are busy until the end; the chief
times the global steps after warm-up (median of a few windows). TF's ps serves
until killed (``server.join()`` never returns): here it waits, with a deadline,
for one "done" token from every worker in a queue on the ps (the TF 1.x idiom
for a ps that ends), then exits. One compute thread per process
(``intra_op``/``inter_op_parallelism_threads`` = 1). Each task prints one JSON
line, as :mod:`benchmarks.baselines.rpc_ps` does.

Every address in the cluster is 127.0.0.1, so all traffic stays on loopback;
TF's gRPC server itself offers no bind address and listens on the port on
every interface (``0.0.0.0``), for as long as the run lasts.

This runs in the TensorFlow environment (``scripts/env_tf.sh``), which has
neither torch nor psframe: it imports only numpy, tensorflow and
:mod:`benchmarks.common`.

    .venv-tf/bin/python -m benchmarks.baselines.tf_ps --ps_hosts=127.0.0.1:2222 \\
        --worker_hosts=127.0.0.1:2223,127.0.0.1:2224 --job_name=ps --task_index=0 --inputs=in.npz
    .venv-tf/bin/python -m benchmarks.baselines.tf_ps ... --job_name=worker --task_index=0 --inputs=in.npz
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Warnings and errors only: TF's start-up INFO lines would fill the logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# TF turns its oneDNN kernels on by default only on CPUs with AVX-512 VNNI or
# newer; elsewhere its matmuls take Eigen's path built for AVX, 2.8x slower than
# torch's on an AVX2 machine (large MLP, one process, one thread: 1.66 steps/s
# against 4.65 with oneDNN, and torch's 4.57). Compare PS designs, not kernels.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np
import tensorflow as tf

from benchmarks.common import NUM_WINDOWS, emit, file_barrier, timed_windows

v1 = tf.compat.v1
tf.get_logger().setLevel("ERROR")  # not the TF 1.x deprecation notices, at every start
DONE_QUEUE = "psframe_bench_done"  # shared name of the ps's queue of finished workers
POLL_S = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps_hosts", required=True, help="host:port (one ps task)")
    parser.add_argument("--worker_hosts", required=True, help="host:port,host:port,...")
    parser.add_argument("--job_name", required=True, choices=["ps", "worker"])
    parser.add_argument("--task_index", type=int, default=0)
    parser.add_argument("--inputs", required=True, help=".npz with the data and initial values (from the parent)")
    parser.add_argument("--model", default="mnist_mlp", help="the model's name, for the result")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps per worker first")
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--windows", type=int, default=NUM_WINDOWS)
    parser.add_argument("--barrier_dir", default=None, help="workers wait for each other here before timing")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds this task may run in all")
    return parser.parse_args(argv)


def session_config(job_name: str, task_index: int, timeout: float) -> v1.ConfigProto:
    """One compute thread; a worker talks to the ps and itself only; no blocking op waits past ``timeout``."""
    return v1.ConfigProto(
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=1,
        # Without filters a worker's session waits for every task, the other workers included.
        device_filters=["/job:ps", f"/job:{job_name}/task:{task_index}"],
        operation_timeout_in_ms=int(1000 * timeout),
        allow_soft_placement=False,
    )


def layer_sizes(inputs: dict) -> list[int]:
    """(784, 100, 10)... from the weights in ``inputs`` (``w0``, ``w1``... in torch's (out, in) layout)."""
    count = sum(1 for k in inputs if k.startswith("w"))
    weights = [inputs[f"w{i}"] for i in range(count)]
    return [weights[0].shape[1], *(w.shape[0] for w in weights)]


def build_graph(
    cluster: tf.train.ClusterSpec, task_index: int, sizes: list[int], learning_rate: float, num_workers: int
) -> dict:
    """The worker's graph: variables on the ps (``replica_device_setter``), the rest on this worker."""
    setter = v1.train.replica_device_setter(worker_device=f"/job:worker/task:{task_index}", cluster=cluster)
    with v1.device(setter):
        global_step = v1.train.get_or_create_global_step()
        x = v1.placeholder(tf.float32, [None, sizes[0]], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        inits, feeds = [], []
        h = x
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
            w = v1.get_variable(f"layer{i}/weight", [fan_in, fan_out], tf.float32, v1.zeros_initializer())
            b = v1.get_variable(f"layer{i}/bias", [fan_out], tf.float32, v1.zeros_initializer())
            h = tf.matmul(h, w) + b
            if i < len(sizes) - 2:
                h = tf.nn.relu(h)
            for var in (w, b):
                value = v1.placeholder(tf.float32, var.shape)
                feeds.append(value)
                inits.append(v1.assign(var, value))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        train_op = v1.train.GradientDescentOptimizer(learning_rate).minimize(loss, global_step=global_step)
        # The global step after this worker's update (and any other applied meanwhile).
        with tf.control_dependencies([train_op]):
            step_after = tf.identity(global_step)
        init = tf.group(*inits, v1.assign(global_step, 0))
        uninitialized = v1.report_uninitialized_variables()
    return {
        "x": x,
        "y": y,
        "loss": loss,
        "train": train_op,
        "step": step_after,
        "init": init,
        "init_feeds": feeds,
        "uninitialized": uninitialized,
        "done": _done_queue(num_workers).enqueue(task_index),
    }


def _done_queue(num_workers: int):
    with v1.device("/job:ps/task:0"):
        return v1.FIFOQueue(num_workers, tf.int32, shared_name=DONE_QUEUE, name="done_queue")


def run_ps(args: argparse.Namespace, cluster: tf.train.ClusterSpec, num_workers: int) -> dict:
    """Serve until every worker said it is done (TF's ps would serve until killed)."""
    config = session_config("ps", 0, args.timeout)
    server = v1.train.Server(cluster, job_name="ps", task_index=0, config=config)
    dequeue = _done_queue(num_workers).dequeue()
    done = []
    with v1.Session(server.target, config=config) as sess:
        for _ in range(num_workers):  # operation_timeout_in_ms bounds each wait
            done.append(int(sess.run(dequeue)))
    return {"task": "ps", "model": args.model, "done_workers": sorted(done)}


def run_worker(args: argparse.Namespace, cluster: tf.train.ClusterSpec, num_workers: int) -> dict:
    inputs = dict(np.load(args.inputs))
    x_all, y_all = inputs["x"], inputs["y"].astype(np.int64)
    sizes = layer_sizes(inputs)
    task = args.task_index
    config = session_config("worker", task, args.timeout)
    server = v1.train.Server(cluster, job_name="worker", task_index=task, config=config)
    graph = build_graph(cluster, task, sizes, args.learning_rate, num_workers)
    warmup_step = args.warmup * num_workers
    last_step = (args.warmup + args.steps) * num_workers
    sess = v1.Session(server.target, config=config)
    if task == 0:
        # torch's Linear weight is (out, in); TF's matmul(x, w) wants (in, out).
        values = [
            inputs[f"{kind}{i}"].T if kind == "w" else inputs[f"{kind}{i}"]
            for i in range(len(sizes) - 1)
            for kind in ("w", "b")
        ]
        sess.run(graph["init"], feed_dict=dict(zip(graph["init_feeds"], values)))
    else:
        _wait_until_initialized(sess, graph["uninitialized"], args.timeout)
    if args.barrier_dir:
        file_barrier(args.barrier_dir, f"worker{task}", num_workers, args.timeout)
    times: list[float] = []
    global_steps: list[int] = []
    rng = np.random.default_rng(1 + task)
    fetches = [graph["step"], graph["loss"]]
    local_step, step, loss = 0, 0, float("nan")
    while step < last_step:
        order = rng.permutation(len(x_all))
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            indices = order[start : start + args.batch_size]
            step, loss = sess.run(fetches, feed_dict={graph["x"]: x_all[indices], graph["y"]: y_all[indices]})
            local_step += 1
            times.append(time.perf_counter())
            global_steps.append(int(step))
            if step >= last_step:
                break
    sess.run(graph["done"])
    # This worker's own rate: its steps from the moment the global step passed warm-up.
    first = next((i for i, g in enumerate(global_steps) if g >= warmup_step), len(global_steps) - 1)
    local = timed_windows(times[first:], range(first + 1, len(times) + 1), 0, args.windows)
    result = {
        "task": f"worker{task}",
        "model": args.model,
        "local_steps": local_step,
        "global_step": int(step),
        "local_steps_per_sec": local["steps_per_sec"],
        "final_loss": float(loss),
    }
    if task == 0:
        timed = timed_windows(times, global_steps, warmup_step, args.windows)
        result.update(
            global_steps_per_sec=timed["steps_per_sec"],
            window_rates=timed["window_rates"],
            overall_steps_per_sec=timed["overall_steps_per_sec"],
            timed_global_steps=timed["steps"],
            seconds=timed["seconds"],
            window=timed["window"],
        )
    return result


def _wait_until_initialized(sess: v1.Session, uninitialized: tf.Tensor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        missing = sess.run(uninitialized)
        if not len(missing):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the chief did not initialise {len(missing)} variable(s) "
                f"({', '.join(m.decode() for m in missing[:3])}...) within {timeout:g}s"
            )
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> NoReturn:
    args = parse_args(argv)
    # The parent sends SIGUSR1 before killing a task that ran past its deadline: the
    # stacks go to stderr. And no task outlives its own deadline, whatever it waits on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    v1.disable_v2_behavior()  # graphs, sessions and TF 1.x variables
    ps_hosts, worker_hosts = args.ps_hosts.split(","), args.worker_hosts.split(",")
    if len(ps_hosts) != 1:
        raise SystemExit(f"--ps_hosts: this baseline runs one ps task, got {len(ps_hosts)}")
    cluster = tf.train.ClusterSpec({"ps": ps_hosts, "worker": worker_hosts})
    code = 1
    try:
        run = run_ps if args.job_name == "ps" else run_worker
        emit(run(args, cluster, len(worker_hosts)))
        code = 0
    except BaseException:  # noqa: BLE001 - reported here: the exit below skips Python's own report
        traceback.print_exc()
    finally:
        # A TF server cannot be stopped, and its threads would hold the interpreter
        # on the way out (or crash it): leave now, with the result printed or the error.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
