#!/usr/bin/env python3
"""A torch.distributed.rpc parameter server, the baseline for psframe.

The design of PyTorch's RPC parameter-server tutorials
(https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html and
the batch-RPC tutorial, rpc_async_execution): rank 0 is the ps and holds the
model with a ``torch.optim.SGD``; ranks 1..N are trainers. Each step a trainer
makes ONE ``rpc_sync`` to the ps that carries its gradients and returns the
updated parameters:

- async: the ps applies every trainer's gradients at once, under a lock, and
  answers with a copy of the parameters taken under that lock;
- sync (``--sync``, the batch tutorial's ``@rpc.functions.async_execution``):
  the ps adds up the gradients of the step, and when all N trainers sent
  theirs, averages them, steps once, and completes the future every trainer
  of that step is waiting on with the new parameters.

Trainers stop once the ps reports (warmup + steps) x N updates (async) or
warmup + steps (sync), so all are busy until the end; the ps times its
updates after warm-up (median of a few windows). TensorPipe runs over TCP on
127.0.0.1 only (transport ``uv``, channel ``basic``: no shared memory or
cross-memory-attach shortcuts, like a gRPC channel on loopback). Each rank
prints one JSON line.

    python -m benchmarks.baselines.rpc_ps --port=29500 --num_trainers=2 --rank=0 [--sync]
    python -m benchmarks.baselines.rpc_ps --port=29500 --num_trainers=2 --rank=1 [--sync]
    python -m benchmarks.baselines.rpc_ps --port=29500 --num_trainers=2 --rank=2 [--sync]
"""

from __future__ import annotations

import argparse
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

from benchmarks.common import NUM_WINDOWS, emit, timed_windows
from benchmarks.mlp_workload import (
    BATCH_SIZE,
    LEARNING_RATE,
    MODELS,
    batches,
    build_model,
    make_data,
    set_single_thread,
)

PS_NAME = "ps"


class ParameterServer:
    """The model and its optimizer on rank 0; trainers reach it through the functions below."""

    def __init__(self, model: torch.nn.Module, num_trainers: int, lr: float) -> None:
        self.params = [p for p in model.parameters()]
        for p in self.params:
            p.requires_grad_(False)
        self.optimizer = torch.optim.SGD(self.params, lr=lr)
        self.num_trainers = num_trainers
        self.lock = threading.Lock()
        self.updates = 0
        self.times: list[float] = []
        self.counts: list[int] = []
        # sync: gradients of the current step so far, and the future its trainers wait on
        self.pending = 0
        self.future: torch.futures.Future = torch.futures.Future()

    def _applied(self) -> None:
        self.updates += 1
        self.times.append(time.perf_counter())
        self.counts.append(self.updates)

    def apply_async(self, grads: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        with self.lock:
            for p, g in zip(self.params, grads):
                p.grad = g
            self.optimizer.step()
            self._applied()
            # A copy under the lock: the reply is written after we return, while
            # another trainer's update may already be changing the parameters.
            return self.updates, [p.detach().clone() for p in self.params]

    def apply_sync(self, grads: list[torch.Tensor]) -> torch.futures.Future:
        with self.lock:
            future = self.future
            if self.pending == 0:
                for p, g in zip(self.params, grads):
                    p.grad = g
            else:
                for p, g in zip(self.params, grads):
                    p.grad.add_(g)
            self.pending += 1
            if self.pending == self.num_trainers:
                for p in self.params:
                    p.grad.div_(self.num_trainers)
                self.optimizer.step()
                self.pending = 0
                self._applied()
                self.future = torch.futures.Future()
                # No copy: nothing changes the parameters before every trainer
                # of this step has its reply and sends the next gradients.
                future.set_result((self.updates, [p.detach() for p in self.params]))
            return future


_PS: ParameterServer | None = None  # set on rank 0 before init_rpc


def push_pull(grads: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    """(runs on the ps) apply one trainer's gradients now; return (updates, parameters)."""
    return _PS.apply_async(grads)


@rpc.functions.async_execution
def push_pull_sync(grads: list[torch.Tensor]) -> torch.futures.Future:
    """(runs on the ps) add this trainer's gradients to the step; answer when the step is applied."""
    return _PS.apply_sync(grads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master_addr", default="127.0.0.1", help="the ps's address (the rendezvous)")
    parser.add_argument("--port", type=int, required=True, help="rendezvous port on --master_addr")
    parser.add_argument("--rank", type=int, required=True, help="0 is the ps; 1..N the trainers")
    parser.add_argument("--num_trainers", type=int, default=2)
    parser.add_argument("--model", default="mnist_mlp", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps per trainer first")
    parser.add_argument("--sync", action="store_true", help="batched synchronous updates")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--windows", type=int, default=NUM_WINDOWS)
    parser.add_argument("--num_worker_threads", type=int, default=8, help="RPC threads per process")
    parser.add_argument("--transports", default="uv", help="TensorPipe transports, comma-separated")
    parser.add_argument("--channels", default="basic", help="TensorPipe channels, comma-separated")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any RPC or wait may take")
    return parser.parse_args(argv)


def run_ps(args: argparse.Namespace, options: rpc.TensorPipeRpcBackendOptions) -> dict:
    global _PS
    _PS = ParameterServer(build_model(args.model), args.num_trainers, args.learning_rate)
    rpc.init_rpc(PS_NAME, rank=0, world_size=1 + args.num_trainers, rpc_backend_options=options)
    rpc.shutdown(graceful=True, timeout=args.timeout)  # returns when every trainer has shut down
    per_round = 1 if args.sync else args.num_trainers
    timed = timed_windows(_PS.times, _PS.counts, args.warmup * per_round, args.windows)
    return {
        "task": "ps",
        "sync": args.sync,
        "model": args.model,
        "updates": _PS.updates,
        "global_steps_per_sec": timed["steps_per_sec"],
        "window_rates": timed["window_rates"],
        "overall_steps_per_sec": timed["overall_steps_per_sec"],
        "timed_global_steps": timed["steps"],
        "seconds": timed["seconds"],
        "window": timed["window"],
    }


def run_trainer(args: argparse.Namespace, options: rpc.TensorPipeRpcBackendOptions) -> dict:
    trainer = args.rank - 1
    x, y = make_data()
    model = build_model(args.model)
    params = list(model.parameters())
    per_round = 1 if args.sync else args.num_trainers
    warmup_updates = args.warmup * per_round
    last_update = (args.warmup + args.steps) * per_round
    function = push_pull_sync if args.sync else push_pull
    rpc.init_rpc(f"trainer{trainer}", rank=args.rank, world_size=1 + args.num_trainers, rpc_backend_options=options)
    times: list[float] = []
    updates: list[int] = []
    local_steps: list[int] = []
    try:
        # Every rank builds the model from the same seed, so the trainers start
        # from the ps's parameters without a first pull.
        for step, indices in enumerate(batches(len(x), args.batch_size, seed=1 + trainer), start=1):
            loss = F.cross_entropy(model(x[indices]), y[indices])
            loss.backward()
            count, values = rpc.rpc_sync(PS_NAME, function, args=([p.grad for p in params],))
            with torch.no_grad():
                for p, v in zip(params, values):
                    p.data = v  # take the received tensor as the parameter (as the tutorial's trainer)
                    p.grad = None
            times.append(time.perf_counter())
            updates.append(count)
            local_steps.append(step)
            if count >= last_update:
                break
        final_loss = loss.item()
    finally:
        rpc.shutdown(graceful=True, timeout=args.timeout)
    first = next((i for i, c in enumerate(updates) if c >= warmup_updates), len(updates) - 1)
    local = timed_windows(times[first:], local_steps[first:], 0, args.windows)
    return {
        "task": f"trainer{trainer}",
        "sync": args.sync,
        "model": args.model,
        "local_steps": len(local_steps),
        "updates_seen": updates[-1] if updates else 0,
        "local_steps_per_sec": local["steps_per_sec"],
        "final_loss": final_loss,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_single_thread()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.master_addr}:{args.port}",
        num_worker_threads=args.num_worker_threads,
        rpc_timeout=args.timeout,
        _transports=args.transports.split(","),
        _channels=args.channels.split(","),
    )
    emit(run_ps(args, options) if args.rank == 0 else run_trainer(args, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
