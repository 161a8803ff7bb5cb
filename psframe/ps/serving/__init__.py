"""A ps task as a process serves it: its gRPC server, and several processes on one port.

- :mod:`psframe.ps.serving.server`: ``psframe.Server``, TF's ``tf.train.Server``;
- :mod:`psframe.ps.serving.serving_processes`: one task served from several processes;
- :mod:`psframe.ps.serving.shared_service`: the service over a model in shared memory;
- :mod:`psframe.ps.serving.shared_store`: the memory those processes share;
- :mod:`psframe.ps.serving.store_memory`: that memory as a store's memory policy.

These wrap the service (:mod:`psframe.ps.service`), which knows nothing of them.
"""
