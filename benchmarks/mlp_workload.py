"""What the training benchmarks train: two MLPs on fixed synthetic data, shared by psframe and its peers.

psframe's task (:mod:`benchmarks.suite.train_psframe`), the baselines
(:mod:`benchmarks.baselines.ddp`, :mod:`benchmarks.baselines.rpc_ps`, and
the TensorFlow one through :func:`benchmarks.baselines.tf_env.write_inputs`)
and the sections that count a step's bytes all take the model, its initial
values, the data and the hyperparameters from here, so every system trains
the same thing. torch is imported inside the functions: a process that only
counts bytes does not load it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterator

# Layer sizes of each model; every one is Linear-ReLU-...-Linear.
MODELS: dict[str, tuple[int, ...]] = {
    "mnist_mlp": (784, 100, 10),
    "large_mlp": (784, 4096, 4096, 10),  # 20.0M parameters, 80 MB of float32
}
BATCH_SIZE = 100
LEARNING_RATE = 0.01
NUM_EXAMPLES = 10_000
DATA_SEED = 1234
MODEL_SEED = 0


def model_bytes(model: str) -> int:
    """Bytes of the model's float32 parameters: what one push (or pull) of the whole model moves."""
    sizes = MODELS[model]
    return 4 * sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(sizes, sizes[1:]))


def parameter_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """The name and shape of each parameter :func:`build_model` makes, in order
    (``Sequential`` of Linear and ReLU: the Linears at even indices)."""
    sizes = MODELS[model]
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        shapes += [(f"{2 * i}.weight", (fan_out, fan_in)), (f"{2 * i}.bias", (fan_out,))]
    return shapes


def set_single_thread() -> None:
    """One compute thread in this process, and stacks on SIGUSR1 (call first in every child)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The parent sends SIGUSR1 before killing a child that ran past its
    # deadline: the stacks in its stderr say where it was stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran
        pass


def build_model(name: str):
    """The model ``name`` (see :data:`MODELS`), initialised from :data:`MODEL_SEED`."""
    import torch

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    sizes = MODELS[name]
    torch.manual_seed(MODEL_SEED)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    return torch.nn.Sequential(*layers)


def make_data():
    """The fixed synthetic data set: :data:`NUM_EXAMPLES` random inputs and labels 0..9."""
    import torch

    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.rand(NUM_EXAMPLES, MODELS["mnist_mlp"][0], generator=generator)
    y = torch.randint(0, 10, (NUM_EXAMPLES,), generator=generator)
    return x, y


def batches(num_examples: int, batch_size: int, seed: int) -> Iterator:
    """Endless mini-batches of indices, reshuffled every epoch (seed: the worker's rank)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(num_examples, generator=generator)
        for start in range(0, num_examples - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
