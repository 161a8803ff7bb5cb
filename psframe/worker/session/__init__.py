"""A worker's session with the ps tasks: its layout and the failures it survives, joining,
following a re-layout, reading data, checkpoints.

- :mod:`psframe.worker.session.arguments`: the Trainer's arguments, resolved and checked;
- :mod:`psframe.worker.session.stats`: what a worker counts, and ``trainer.stats``;
- :mod:`psframe.worker.session.layout_maker`: the model's replica on a placement, and a client;
- :mod:`psframe.worker.session.startup`: joining the model, at start-up and after a lost ps task;
- :mod:`psframe.worker.session.relayout`: a worker's side of a live re-layout;
- :mod:`psframe.worker.session.session`: the layout a worker is on, one way to survive
  lost ps tasks and re-layouts (``Session.call``), a step's push, the values received and
  the global step;
- :mod:`psframe.worker.session.data_reader`: data read in ranges;
- :mod:`psframe.worker.session.checkpointer`: the chief's checkpoints, full and delta;
- :mod:`psframe.worker.session.in_graph`: one process driving replicas on several devices.
"""
