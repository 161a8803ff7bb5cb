"""A worker's calls to the ps tasks: named tensors in, named tensors out.

- :mod:`psframe.worker.client.ps_client`: ``PsClient``, the connections, the step path and the cut;
- :mod:`psframe.worker.client.control_calls`: waiting, the model, data ranges, the end;
- :mod:`psframe.worker.client.relayout_calls`: the calls of a live re-layout;
- :mod:`psframe.worker.client.streams`: one long-lived PushPull stream per ps task;
- :mod:`psframe.worker.client.operations`: what a worker asks and gets back, one encoder, and a
  planned request's work done once.

The only part of the worker side, with the replica's compression, that speaks the wire.
"""
