"""The worker side: a replica of the model that trains against the ps tasks.

Its packages, bottom to top (each imports only those before it):

- :mod:`psframe.worker.plan`: how the variables are cut into a step's messages;
- :mod:`psframe.worker.client`: the calls to the ps tasks, the only part that
  speaks the wire;
- :mod:`psframe.worker.model`: the replica and its embedding tables;
- :mod:`psframe.worker.session`: the session with the ps tasks (the layout, and
  the failures it survives), joining, following a re-layout, reading data,
  checkpoints, in-graph replicas;

and on top, what users meet: :mod:`psframe.worker.trainer` (``psframe.Trainer``,
set up by :mod:`psframe.worker.trainer_setup`), :mod:`psframe.worker.hooks`
(with the chief's :mod:`psframe.worker.relayout_leader`),
:mod:`psframe.worker.evaluator` and :mod:`psframe.worker.model_state`.

Nothing here imports the ps side (:mod:`psframe.ps`). Every module, with a
line on what it holds: docs/modules.md.
"""
