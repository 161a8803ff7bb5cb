"""What travels between tasks, and how.

- ``psframe.proto`` (here, with its generated ``psframe_pb2``): the one
  contract between workers and ps tasks; ``scripts/gen_proto.py`` regenerates
  the code;
- :mod:`psframe.wire.codec`: tensors to and from message bytes;
- :mod:`psframe.wire.messages`: settings (optimizer, sync, variables) as
  messages, and the checks that two tasks agree on them;
- :mod:`psframe.wire.encoding`: messages that carry the same tensors every step,
  their per-tensor work done once;
- :mod:`psframe.wire.row_tensors`: rows of embedding tables in a message's tensors;
- :mod:`psframe.wire.same_host`: tensor bytes through shared memory, for a
  worker and a ps task on one host;
- :mod:`psframe.wire.transport`: gRPC, the only package that imports it.
"""
