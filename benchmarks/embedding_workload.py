"""What the embedding-table benchmarks train: a CTR-shaped model on power-law batches, shared with the RPC baseline.

26 categorical features looked up in one ``nn.Embedding(rows, 64)``, summed
per sample, then a linear head, trained with Adagrad; batches of 512 samples
whose ids follow a power law (Zipf over 10^4 ids, as click logs have them)
scattered over the table by one multiplicative hash, so each batch touches
about 3,500 distinct rows whatever the table's size. psframe's rows
(:mod:`benchmarks.suite.sparse`) and the torch.distributed.rpc baseline
(:mod:`benchmarks.baselines.rpc_sparse`) train exactly this.
"""

from __future__ import annotations

import torch

DIM = 64
FEATURES = 26
BATCH = 512
BATCHES = 8  # distinct batches, cycled
LEARNING_RATE = 0.05


class CtrModel(torch.nn.Module):
    """The model: a ``rows`` x 64 table (``sparse``: it gives sparse gradients), the looked-up rows summed
    per sample, and a linear head; the same initial values every time (seed 0)."""

    def __init__(self, rows: int, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(rows, DIM, sparse=sparse)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).sum(1)).squeeze(1)


VOCABULARY = 10**4  # the ids a batch draws from, whatever the table's size
HASH = 2654435761  # a prime: k -> k * HASH mod rows is a bijection for every table size here


def power_law_ids(rows: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of ids: the ``k``-th most frequent drawn about as often as ``1 / (k + 1)``
    (Zipf over :data:`VOCABULARY` ids), scattered over the table as hashed features are."""
    u = torch.rand(BATCH, FEATURES, generator=generator, dtype=torch.float64)
    ranks = torch.floor(torch.exp(u * torch.log(torch.tensor(float(VOCABULARY))))).long() - 1
    return (ranks * HASH) % rows


def batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The :data:`BATCHES` batches every run cycles through: ``(ids, targets)``, the same for every table size."""
    generator = torch.Generator().manual_seed(7)
    return [(power_law_ids(rows, generator), torch.rand(BATCH, generator=generator)) for _ in range(BATCHES)]
