"""The trainer guide's two ways to split data that carries state from step to step (truncated
backpropagation through time), run as written: a contiguous piece per worker, and ``DataRanges``
of whole sequences. Two workers of a recurrent model, in threads, against ps tasks in this process.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
import torch.nn.functional as F

import psframe
from tests.conftest import ROOT

GUIDE = ROOT / "docs" / "guides" / "trainer.md"
SECTION = "## Data that carries state from step to step"
BATCH, BPTT, VOCAB = 4, 7, 50


def snippets() -> list[str]:
    """The section's Python blocks: the contiguous pieces (with ``windows``), then the ranges."""
    text = GUIDE.read_text()
    start = text.index(SECTION)
    section = text[start : text.index("\n## ", start + len(SECTION))]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, f"{SECTION} should show two Python blocks, found {len(blocks)}"
    return blocks


class LanguageModel(torch.nn.Module):
    """An LSTM over token ids: ``model(x, state)`` gives the logits and the state after ``x``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.rnn = torch.nn.LSTM(8, 16, batch_first=True)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, state=None):
        hidden, state = self.rnn(self.emb(x), state)
        return self.out(hidden), state


def run_on_two_workers(code: str, data: dict) -> list[psframe.Trainer]:
    """``code`` run by workers 0 and 1 at once, each with its own trainer; their trainers, once done."""
    done: list[psframe.Trainer | None] = [None, None]
    errors: list[BaseException] = []
    with psframe.local_cluster(num_ps=1, num_workers=2) as local:

        def worker(index: int) -> None:
            try:
                model = LanguageModel()
                trainer = psframe.Trainer(model, local.cluster, task_index=index, optimizer=psframe.optim.SGD(lr=0.1))
                names = {"trainer": trainer, "model": model, "F": F, "psframe": psframe, "batch_size": BATCH}
                exec(code, {**names, "bptt": BPTT, **data})
                done[index] = trainer
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors
    assert all(t is not None for t in done)
    return [t for t in done if t is not None]


@pytest.mark.service
def test_each_worker_reads_its_own_contiguous_piece_in_order():
    tokens = torch.randint(0, VOCAB, (1000,), generator=torch.Generator().manual_seed(1))
    trainers = run_on_two_workers(snippets()[0], {"tokens": tokens})
    # Each worker: 500 tokens in 4 lanes of 125, windows of 7 over the 124 inputs: 18 steps.
    assert [t.stats.local_step for t in trainers] == [18, 18]
    assert trainers[0].global_step == 36 or trainers[1].global_step == 36


@pytest.mark.service
def test_data_ranges_of_whole_sequences_train_each_sequence_once_a_step_per_batch():
    sequences = torch.randint(0, VOCAB, (40, 37), generator=torch.Generator().manual_seed(2))
    windows = snippets()[0].split("\npiece =")[0]  # the guide's windows(), which the second block uses
    trainers = run_on_two_workers(windows + "\n" + snippets()[1], {"sequences": sequences})
    # 40 sequences in batches of 16: 3 steps in all (16, 16, 8), whichever worker took the range.
    assert sum(t.stats.local_step for t in trainers) == 3
