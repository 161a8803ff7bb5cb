"""A worker's calls to the ps tasks: named tensors in, named tensors out.

- :mod:`psframe.worker.client.ps_client`: ``PsClient``, every call a worker makes;
- :mod:`psframe.worker.client.streams`: one long-lived PushPull stream per ps task;
- :mod:`psframe.worker.client.operations`: what a worker asks and gets back, one encoder;
- :mod:`psframe.worker.client.prepared`: a planned request, its work done once.

The only part of the worker side, with the replica's compression, that speaks the wire.
"""
