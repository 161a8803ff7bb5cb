"""The worker side: a replica of the model that trains against the ps tasks.

- :mod:`psframe.worker.trainer`: :class:`~psframe.worker.trainer.Trainer`, the training loop's API;
- :mod:`psframe.worker.replica`: the local model bound to the shards the ps tasks hold;
- :mod:`psframe.worker.slicer`: which message carries which shard, in which order;
- :mod:`psframe.worker.startup`: the chief's initialisation, and joining the model;
- :mod:`psframe.worker.client`: tensors to and from every ps task;
- :mod:`psframe.worker.streams`: the PushPull streams to the ps tasks, a step's exchange on them, and
  the numbers of the pushes;
- :mod:`psframe.worker.overlap`: sending a step's messages while backward still runs (opt-in);
- :mod:`psframe.worker.staging`: CPU or CUDA replicas and their host buffers;
- :mod:`psframe.worker.hooks`: hooks (public as :mod:`psframe.hooks`).

Nothing here imports the ps side (:mod:`psframe.ps`).
"""
