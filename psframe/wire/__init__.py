"""What travels between tasks, and how.

- ``psframe.proto`` (here, with its generated ``psframe_pb2``): the one
  contract between workers and ps tasks; ``scripts/gen_proto.py`` regenerates
  the code;
- :mod:`psframe.wire.codec`: tensors to and from message bytes;
- :mod:`psframe.wire.messages`: settings (optimizer, sync, variables) as
  messages, and the checks that two tasks agree on them;
- :mod:`psframe.wire.transport`: gRPC, the only package that imports it.
"""
