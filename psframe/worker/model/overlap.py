"""Sending a step's messages while backward still runs.

Backward produces a model's gradients from its last layers to its first. A
step plan lists each ps task's requests in that order
(:class:`psframe.worker.model.replica.Replica`), so the first request's gradients
are complete long before backward ends. :class:`BackwardOverlap` hooks every
trainable parameter (``register_post_accumulate_grad_hook``: called once the
parameter's gradient of this backward is whole); once every parameter of a
request has its gradient, the request is handed to the step's
:class:`~psframe.worker.client.streams.Exchange`, which sends it if its turn on the
stream and the window allow. The rest go after backward, as without overlap.

What is sent is what would have been sent after backward, in the same order
on each stream, with the same push numbers: asynchronous and synchronous
training are unchanged (the tests compare them bit for bit). It is used only
where nothing may change the gradients between backward and the push: no
hook with a ``before_push`` (e.g. ``NanGuardHook``, which may drop them), no
embedding table (its rows go first on the stream, and are known only after
backward), a CPU replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.worker.client.streams import Exchange
from psframe.worker.plan.step_plan import Request


class BackwardOverlap:
    """The hooks that send a step's requests as backward completes their gradients.

    Args:
        requests: the step plan's requests, in the order each stream sends them.
        params: the trainable parameters of the model.
    """

    def __init__(self, requests: Sequence[Request], params: Sequence[torch.nn.Parameter]) -> None:
        index = {id(p): k for k, p in enumerate(params)}
        # For each parameter, the requests it pushes a part of; for each request, how many distinct
        # parameters it waits for.
        self._requests_of: list[list[int]] = [[] for _ in params]
        self._needs: list[int] = []
        for i, request in enumerate(requests):
            mine = {index[id(slot.param)] for slot in request.push if id(slot.param) in index}
            for k in mine:
                self._requests_of[k].append(i)
            self._needs.append(len(mine))
        self._missing: list[int] = []
        self._exchange: Exchange | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(k)) for k, p in enumerate(params)]

    def _hook(self, k: int):
        def ready(param: torch.Tensor) -> None:
            exchange = self._exchange
            if exchange is None:
                return
            for i in self._requests_of[k]:
                self._missing[i] -= 1
                if self._missing[i] == 0:
                    exchange.send_ready(i)

        return ready

    def begin(self, exchange: Exchange) -> None:
        """Send ``exchange``'s requests as the coming backward completes them."""
        self._missing = [n if n else -1 for n in self._needs]  # a request without parameters waits for finish
        self._exchange = exchange

    def end(self) -> None:
        """Backward is over: the hooks send nothing more."""
        self._exchange = None

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
