"""A worker's session with the ps tasks: joining, following a re-layout, reading data.

- :mod:`psframe.worker.session.arguments`: the Trainer's arguments, resolved and checked;
- :mod:`psframe.worker.session.startup`: joining the model, at start-up and after a lost ps task;
- :mod:`psframe.worker.session.relayout`: a worker's side of a live re-layout;
- :mod:`psframe.worker.session.data_reader`: data read in ranges;
- :mod:`psframe.worker.session.in_graph`: one process driving replicas on several devices.
"""
