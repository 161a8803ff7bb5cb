"""What the tests of ``psframe serve`` share: its models, a training run that writes full and delta
checkpoints, copying checkpoints into the folder a server follows (whole, or damaged), and
JSON over HTTP with deadlines.

``tests.support.serve_jobs:ranker`` is a ``--model`` factory: ``(Ranker(), to_inputs)``.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import psframe
from psframe.checkpoint import files as checkpoint_files
from psframe.checkpoint.manifest import MANIFEST_NAME, Manifest

DIM = 4
ITEMS = 12
MAX_ROWS = 6  # per ps task: ids come faster than that, so rows are evicted (tombstones in deltas)
HTTP_TIMEOUT_S = 30.0


class Ranker(torch.nn.Module):
    """A dynamic table of users (capped), a fixed table of items and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = psframe.DynamicEmbedding(
            DIM, initializer=psframe.RowInitializer(std=0.3, seed=5), max_rows=MAX_ROWS
        )
        self.items = torch.nn.Embedding(ITEMS, DIM, sparse=True)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(users).mean(1), self.items(items)], 1)).squeeze(1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Users from a window sliding over hashed-looking ids (old ones fall out), items, targets."""
    g = torch.Generator().manual_seed(step)
    window = torch.arange(2 * step, 2 * step + 8)
    users = window[torch.randint(0, 8, (6, 3), generator=g)] * 0x9E3779B1 - 2**40
    return users, torch.randint(0, ITEMS // 2, (6,), generator=g), torch.rand(6, generator=g)


# --8<-- [start:factory]
def to_inputs(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's ``{"users": [[id, ...], ...], "items": [id, ...]}`` as the Ranker's arguments."""
    return torch.tensor(inputs["users"], dtype=torch.int64), torch.tensor(inputs["items"], dtype=torch.int64)


def ranker():
    """The ``--model`` factory of the tests: the Ranker, and its requests' inputs."""
    return Ranker(), to_inputs


# --8<-- [end:factory]


class Counter(torch.nn.Module):
    """Every row it trains, and its bias, equal the global step (see :func:`count_step`)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = psframe.DynamicEmbedding(DIM, initializer=psframe.RowInitializer("constant", value=0.0))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.users(ids).sum() + self.bias.sum()


COUNTED_IDS = torch.arange(0, 3000, dtype=torch.int64) * 7919 - 10**9  # rows of both ps tasks


def count_step(trainer: psframe.Trainer, model: Counter) -> None:
    """One step of SGD(lr=1) on ``-model(ids)``: each row looked up, and the bias, go up by exactly 1."""
    trainer.step(-model(COUNTED_IDS))


def train_ranker(trainer: psframe.Trainer, model: Ranker, steps: range) -> None:
    for step in steps:
        users, items, target = batch(step)
        trainer.step(F.mse_loss(model(users, items), target))


# ---- checkpoints copied into the folder a server follows


@dataclass(frozen=True)
class Saved:
    """A checkpoint the training run committed, in its own folder."""

    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def kind(self) -> str:
        return "full" if self.manifest.parent is None else "delta"


def publish(saved: Saved, served_dir: Path, damage: str | None = None) -> Path:
    """Copy a committed checkpoint into ``served_dir`` as the chief commits one: its shards, then
    its manifest. ``damage``: ``"flip"`` flips a byte in the middle of shard 0, ``"truncate"``
    cuts shard 0 in half (a half-written file the manifest still records whole)."""
    source = Path(saved.manifest.folder)
    target = served_dir / source.name
    target.mkdir(parents=True)
    for shard in sorted(source.glob("shard-*")):
        shutil.copyfile(shard, target / shard.name)
    first = target / saved.manifest.shards[0].file
    data = bytearray(first.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage is not None:
        raise ValueError(f"damage is 'flip' or 'truncate', got {damage!r}")
    first.write_bytes(bytes(data))
    shutil.copyfile(source / MANIFEST_NAME, target / MANIFEST_NAME)  # the commit, last
    return target


def committed(checkpoint_dir: str) -> list[Saved]:
    """Every checkpoint committed in ``checkpoint_dir``, full and delta, by step (a full one first at a tie)."""
    fulls = checkpoint_files.list_checkpoints(checkpoint_dir)
    deltas = checkpoint_files.list_checkpoints(checkpoint_dir, deltas=True)
    return [Saved(m) for m in sorted([*fulls, *deltas], key=lambda m: (m.step, m.parent is not None))]


# ---- HTTP


def call(url: str, path: str, body: Any = None, *, method: str | None = None, raw: bytes | None = None):
    """``(status, JSON answer)`` of a request: a POST of ``body`` as JSON (or of ``raw`` bytes), a GET without."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"))
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(what: str, done: Callable[[], Any], timeout: float = 60.0, interval: float = 0.02) -> Any:
    """Wait until ``done()`` is true (returning it), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = done()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout:g}s")


def status_at(url: str, step: int) -> Callable[[], dict | None]:
    """A check for :func:`wait_for`: the status once the server serves ``step``."""

    def check() -> dict | None:
        code, status = call(url, "/v1/status")
        return status if code == 200 and status.get("step") == step else None

    return check
