"""Raw torch on an embedding table's rows, one thread: the ceiling of a ps task's row path.

What a ps task does to a table for each request, done by plain torch with no
psframe code, over one ``rows`` x ``dim`` float32 table (the suite's
:mod:`benchmarks.suite.row_rate` holds psframe's own path against these):

- **read** the rows of a batch's distinct ids: ``weight.index_select(0, ids)``;
- **update** them with Adagrad and read them back, two ways:

  - :class:`TorchAdagrad`: ``torch.optim.Adagrad`` on the sparse gradient of
    those rows, as a PyTorch user steps an ``nn.Embedding(sparse=True)``
    (the gradient is coalesced inside the step);
  - :class:`RowAdagrad`: the same update by gathering the rows and their
    sums of squares, computing, and scattering them back
    (``index_select`` / ``index_copy_``), the operations in torch's order:
    the fastest raw torch knows for the rows of distinct ids, and the
    ceiling. :func:`same_bits` says whether it gives ``torch.optim``'s bits
    on this machine.

    python -m benchmarks.baselines.torch_rows   # prints whether both updates agree, bit for bit
"""

from __future__ import annotations

import sys

import torch

LEARNING_RATE = 0.05
EPS = 1e-10  # torch.optim.Adagrad's default


def read(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A copy of rows ``ids`` of ``weight``."""
    return weight.index_select(0, ids)


class TorchAdagrad:
    """``torch.optim.Adagrad`` over one table, stepped with the sparse gradient of a batch's rows.

    Args:
        weight: the table's initial values (copied).
        lr: the learning rate.
    """

    def __init__(self, weight: torch.Tensor, lr: float = LEARNING_RATE) -> None:
        self.weight = weight.clone().requires_grad_()
        self.optimizer = torch.optim.Adagrad([self.weight], lr=lr, foreach=False)

    def update_and_read(self, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """One step with the gradients ``grads`` of rows ``ids``; the rows' new values."""
        self.weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, self.weight.shape, check_invariants=False)
        # Said outright (torch warns when the step makes its own sparse tensors with the checks left implicit).
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            self.optimizer.step()
        self.weight.grad = None
        return self.weight.detach().index_select(0, ids)

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table and its sums of squares."""
        return self.weight.detach(), self.optimizer.state[self.weight]["sum"]


class RowAdagrad:
    """Adagrad on the rows of distinct ids, by gathers and scatters of the rows.

    Args:
        weight: the table's initial values (copied).
        lr: the learning rate.
    """

    def __init__(self, weight: torch.Tensor, lr: float = LEARNING_RATE) -> None:
        self.weight = weight.clone()
        self.sums = torch.zeros_like(weight)
        self.lr = lr

    def update_and_read(self, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """One step with the gradients ``grads`` of rows ``ids`` (distinct); the rows' new values."""
        sums = self.sums.index_select(0, ids).add_(grads.pow(2))
        self.sums.index_copy_(0, ids, sums)
        rows = self.weight.index_select(0, ids).add_(grads / sums.sqrt_().add_(EPS), alpha=-self.lr)
        self.weight.index_copy_(0, ids, rows)
        return rows

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table and its sums of squares."""
        return self.weight, self.sums


def same_bits(rows: int = 1_000, dim: int = 8, steps: int = 5) -> bool:
    """Whether :class:`RowAdagrad` ends on :class:`TorchAdagrad`'s bits after ``steps`` steps of
    random rows (random values from a private generator)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, dim, generator=generator)
    theirs, ours = TorchAdagrad(weight), RowAdagrad(weight)
    for _ in range(steps):
        ids = torch.unique(torch.randint(0, rows, (rows // 2,), generator=generator))
        grads = torch.randn(ids.numel(), dim, generator=generator)
        theirs.update_and_read(ids, grads)
        ours.update_and_read(ids, grads)
    return all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(theirs.values(), ours.values()))


def main() -> int:
    torch.set_num_threads(1)
    print(f"gathers and scatters give torch.optim.Adagrad's bits: {'yes' if same_bits() else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
