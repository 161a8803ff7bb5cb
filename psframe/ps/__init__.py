"""The ps side: the variables a ps task holds, their optimizers, and the service that serves them.

Its packages, bottom to top (each imports only those before it):

- :mod:`psframe.ps.store`: the variables and their optimizers, plain torch;
- :mod:`psframe.ps.protocol`: the rules between workers (pushes applied once,
  rounds, staleness, data ranges), no network;
- :mod:`psframe.ps.elastic`: ps tasks added or drained while training;
  beside it :mod:`psframe.ps.recovery`, a task's shard written and restored;
- :mod:`psframe.ps.service`: requests translated into calls on the above;
- :mod:`psframe.ps.serving`: ``psframe.Server``, and a task served from
  several processes.

Nothing here imports the worker side (:mod:`psframe.worker`). Every module,
with a line on what it holds: docs/modules.md.
"""
