"""Factories for ``psframe evaluate`` in the tests: each returns ``(model, evaluate_fn)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.support.cluster_job import Model, data

FEATURES = 4


def linear_model() -> torch.nn.Module:
    """The model of tests/unit/test_evaluator.py's hand-written checkpoints."""
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def linear_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(32, FEATURES, generator=generator)
    return x, x.sum(1, keepdim=True)


def mse(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    x, y = data
    return {"mse": F.mse_loss(model(x), y).item()}


def linear(argv: list[str] | None = None):
    """``tests/support/evaluator_jobs.py:linear``; with arguments, it names them in a metric of their count."""
    data = linear_data()
    extra = {"args": float(len(argv))} if argv else {}
    return linear_model(), lambda model: {**mse(model, data), **extra}


def cluster_job():
    """``tests.support.evaluator_jobs:cluster_job``: ``cluster_job.py``'s model (without ``big``) and its loss."""
    torch.manual_seed(0)  # as cluster_job.py builds it
    return Model(0, 1024), lambda model: mse(model, data())


def not_a_pair():
    return torch.nn.Linear(1, 1)
