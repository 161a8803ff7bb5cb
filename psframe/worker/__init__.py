"""The worker side: a replica of the model that trains against the ps tasks.

Its packages, bottom to top (each imports only those before it):

- :mod:`psframe.worker.plan`: how the variables are cut into a step's messages;
- :mod:`psframe.worker.client`: the calls to the ps tasks, the only part that
  speaks the wire;
- :mod:`psframe.worker.model`: the replica and its embedding tables;
- :mod:`psframe.worker.session`: joining, following a re-layout, reading data;

and on top, what users meet: :mod:`psframe.worker.trainer` (``psframe.Trainer``),
:mod:`psframe.worker.hooks`, :mod:`psframe.worker.evaluator` and
:mod:`psframe.worker.model_state`.

Nothing here imports the ps side (:mod:`psframe.ps`). Every module, with a
line on what it holds: docs/modules.md.
"""
