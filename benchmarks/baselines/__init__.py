"""The systems psframe is measured against, with no psframe code in them.

Each runs as processes of its own, started by the suite: the raw gRPC echo
(:mod:`.raw_grpc`), DDP over gloo and one process (:mod:`.ddp`), the
torch.distributed.rpc parameter servers (:mod:`.rpc_ps`, :mod:`.rpc_sparse`)
and TensorFlow's (:mod:`.tf_ps`, in the environment :mod:`.tf_env` finds).
This package imports nothing: the TensorFlow baseline runs in an environment
without torch.
"""
