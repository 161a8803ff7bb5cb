"""How long an asynchronous request holds a ps task's one lock: the ceiling that lock puts on updates.

    python -m benchmarks.experiments.store_lock

A ps task applies an asynchronous push and reads the reply's values under
one lock (the store's; across serving processes, one ``flock``), so that a
reply is one consistent version of the variables. Whatever the cores and
serving processes, the task then applies at most ``1 / hold`` requests a
second, ``hold`` being the time one request keeps the lock. TF's ps applies
updates without a lock by default (``use_locking=False``), at the price of
replies that may mix two updates; per-variable locks would sit between the two.

This measures ``hold`` in one process, with nothing else running, for the
requests psframe's workers send: the training benchmark's models
(:mod:`benchmarks.mlp_workload`) placed on one ps task and cut into requests
by psframe's own placement and step plan, with the trainer's defaults
(messages of at most ``DEFAULT_MAX_SHARD_BYTES``).
Under the lock a request runs the optimizer step on its variables
(``VariableStore.update``, ``torch.optim.SGD``) and copies the values it
pulls into the worker's shared region (``MessageEncoding.write``): exactly what the
ps's planned path (``ParameterServerService._push_pull_cached``) does.
Rows: the time held per request, the requests a step sends, and the
ceiling that follows, in requests/s and global steps/s.
"""

from __future__ import annotations

import sys
import time

import torch

import psframe
from benchmarks.common import single_thread, table_main
from benchmarks.formatting import format_number, markdown_table
from benchmarks.mlp_workload import MODELS, parameter_shapes
from psframe.cluster.placement import DEFAULT_MAX_SHARD_BYTES, VariableInfo, place
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.worker.plan.step_plan import Slot, StepPlan

REPEATS = 5  # the best of so many timed rounds


def requests_of(model_name: str) -> list[dict[str, tuple[int, ...]]]:
    """Each request of one async step of ``model_name`` with 1 ps task, as its worker plans it
    (psframe's placement and step plan, the trainer's defaults): shard name -> shape."""
    variables = [VariableInfo(name, shape, 4) for name, shape in parameter_shapes(model_name)]
    slots = [Slot(shard, None) for shard in place(variables, 1).shards]  # the plan reads the shards only
    plan = StepPlan.make(slots, 1, DEFAULT_MAX_SHARD_BYTES, sync=False)
    return [{slot.shard.name: tuple(slot.shard.shape) for slot in request.push} for request in plan.step]


def measure(model_name: str, rounds: int) -> dict:
    """The lock's hold time per request of ``model_name`` (the best of :data:`REPEATS` timings)."""
    requests = requests_of(model_name)
    store = VariableStore("/job:ps/task:0")
    store.create(
        {name: torch.randn(shape) for request in requests for name, shape in request.items()},
        psframe.optim.SGD(lr=0.01),
    )
    prepared = []
    for request in requests:
        names = list(request)
        variables = store.variables(names)
        layout = MessageEncoding(
            pb.PushPullReplyHeader, [(n, v.dtype, tuple(v.shape)) for n, v in zip(names, variables)]
        )
        region = bytearray(layout.payload_length)  # the reply part of a worker's region
        prepared.append(
            (
                variables,
                [torch.full_like(v, 1e-3) for v in variables],
                layout,
                layout.buffers([v.detach() for v in variables]),
                layout.targets(region, 0),
            )
        )

    def one_round() -> None:
        for variables, grads, layout, buffers, targets in prepared:
            with store.lock:
                store.update(variables, grads, True)
                layout.write(targets, buffers)

    one_round()  # the optimizer's state and the pages exist
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(rounds):
            one_round()
        best = min(best, (time.perf_counter() - started) / (rounds * len(prepared)))
    return {
        "model": model_name,
        "requests_per_step": len(prepared),
        "request_bytes": sum(v.nbytes for v in prepared[0][0]),
        "hold_us": best * 1e6,
        "max_requests_per_s": 1 / best,
        "max_steps_per_s": 1 / (best * len(prepared)),
    }


def run_store_lock_benchmarks(quick: bool = False) -> list[dict]:
    """One row per model of :data:`benchmarks.mlp_workload.MODELS`."""
    single_thread()
    torch.set_num_threads(1)
    rounds = {"mnist_mlp": 50 if quick else 1000, "large_mlp": 1 if quick else 5}
    return [measure(name, rounds[name]) for name in MODELS]


def store_lock_table(results: list[dict]) -> str:
    """Markdown table of :func:`run_store_lock_benchmarks` rows."""
    headers = [
        "model",
        "requests/step",
        "first request",
        "lock held per request",
        "ceiling: requests/s",
        "ceiling: global steps/s",
    ]
    rows = [
        [
            r["model"],
            r["requests_per_step"],
            f"{r['request_bytes'] / 2**10:,.1f} KiB",
            f"{format_number(r['hold_us'])} us",
            f"{r['max_requests_per_s']:,.0f}",
            format_number(r["max_steps_per_s"]),
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    # As psframe's own entry points do: the settings of a process that moves tensors every step.
    psframe.tune_process()
    return table_main(
        argv, __doc__, "a few rounds (smoke test)", lambda quick: store_lock_table(run_store_lock_benchmarks(quick))
    )


if __name__ == "__main__":
    sys.exit(main())
