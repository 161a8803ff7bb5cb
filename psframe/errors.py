"""The exceptions psframe raises: one root, one named class per failure.

Every message says what was expected and what was found, so that a user can
fix the input without reading psframe's source.

Every class lives here, those the edges raise (``psframe launch``, Ray,
Spark) included, so that an error a peer names can be rebuilt whatever it
is (:func:`error_from_name`; :mod:`psframe.wire.transport.error_codec`
carries errors between tasks). The edge modules re-export theirs.
"""

from __future__ import annotations


class PsframeError(Exception):
    """Root of every error psframe raises on purpose."""


class ClusterSpecError(PsframeError, ValueError):
    """A cluster definition, task address, job name or task index is malformed."""


class ClusterMismatchError(PsframeError):
    """Two tasks of one job disagree about the cluster or the model."""


class PlacementError(PsframeError, ValueError):
    """A variable cannot be placed as asked (unknown ps task, bad device string)."""


class OptimizerConfigError(PsframeError, ValueError):
    """An optimizer name or keyword argument is not accepted by ``torch.optim``."""


class InvalidGradientError(PsframeError, ValueError):
    """A pushed tensor does not fit the variable it names; nothing was applied."""


class ShapeMismatchError(InvalidGradientError):
    """A pushed tensor has the wrong shape for its variable."""


class DtypeMismatchError(InvalidGradientError):
    """A pushed tensor has the wrong dtype for its variable."""


class UnknownVariableError(InvalidGradientError, KeyError):
    """A request names a variable the ps task does not hold."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class RowIdError(InvalidGradientError, IndexError):
    """A row id of an embedding table is negative, past its rows, or not an int64; nothing changed."""


class WireFormatError(PsframeError, ValueError):
    """Bytes received on the wire do not decode as a psframe message."""


class SharedRegionError(WireFormatError):
    """A request names a shared-memory region the ps task cannot use (not on its host,
    gone, or not as described); the worker sends the tensors in the message instead."""


class ConnectTimeoutError(PsframeError, TimeoutError):
    """A peer task did not come up (or become ready) before the deadline."""


class TaskUnavailableError(PsframeError, ConnectionError):
    """A peer task that was up stopped answering (it exited or the network failed)."""


class RpcTimeoutError(PsframeError, TimeoutError):
    """A call to a peer task got no answer within its deadline."""


class BarrierTimeoutError(PsframeError, TimeoutError):
    """A synchronous step did not gather enough gradients before the deadline."""


class PortInUseError(PsframeError, OSError):
    """The address a task must listen on is taken by another process."""


class NotReadyError(PsframeError):
    """The ps task holds no model yet: the chief has not initialised it."""


class TrainingFinishedError(PsframeError):
    """Every worker already finished: the ps tasks accept no more training."""


class DataRangeLostError(PsframeError):
    """A step's push said how far it read into a range of data that is no longer the worker's
    (it was presumed dead and the range went to another worker, or the ps task restored a
    checkpoint): nothing of that push was applied (:mod:`psframe.ps.protocol.data_ranges`)."""


class ServeRequestError(PsframeError):
    """A request to ``psframe serve`` that is answered with an HTTP error ``status`` and
    ``{"error": message}`` (:mod:`psframe.serve.http_api`)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class StreamError(PsframeError):
    """A stream's broker could not be reached, or refused a call (:mod:`psframe.streams`)."""


class LayoutChangedError(PsframeError):
    """The ps tasks moved to another layout (ps tasks added or drained while training,
    ``Trainer.reshard``): the push was refused with nothing applied. The worker takes the
    new cluster from ps 0, and sends its step there (:mod:`psframe.ps.elastic.relayout`)."""


class NotKeptHere(Exception):
    """Internal, not a failure: a push that carries data progress reached one of a ps task's serving
    processes, and the task's owner keeps the data queues; the serving process hands it the push
    as it came (nothing was applied). Never crosses the wire."""


class TaskStopped(SystemExit):
    """Not a failure: a signal asked the process to stop, it stopped, and said so in one line.

    A :class:`SystemExit` whose ``code`` is 128 + the signal's number (143 after
    SIGTERM), so that a script ends with that exit code and no traceback
    whether or not :func:`psframe.flags.run` wraps it. ``psframe.Server.join``
    raises it after SIGTERM, and ``psframe.Trainer.step`` once a worker given
    SIGTERM has finished its step (see the guide "Failures and exit codes");
    ``psframe launch`` given SIGTERM stops its tasks on it.
    """


class Interrupted(TaskStopped, KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the task, which said so in one line: exit code 130.

    A :class:`KeyboardInterrupt` too, so that ``except KeyboardInterrupt:`` in
    a script still catches it; uncaught, the script ends with 130 and no
    traceback. ``psframe.Server.join`` raises it.
    """


class CheckpointError(PsframeError):
    """A checkpoint cannot be written or read as asked."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum."""


class CheckpointCutError(CheckpointError):
    """A ps task could not take its part of a checkpoint at the cut the others took: the steps a
    worker had begun elsewhere did not arrive before the hold's deadline. The chief then saves
    without one cut (each part at its own instant) and says so."""


class SnapshotError(CheckpointError):
    """A serving snapshot or update (:mod:`psframe.export`) cannot be made, read or applied; nothing changed."""


class NanLossError(PsframeError, FloatingPointError):
    """The loss became NaN or infinite (raised by the NaN guard hook)."""


class SecurityConfigError(PsframeError, ValueError):
    """Security settings that cannot be used: a missing file, a key without its certificate, a bad token."""


class AuthenticationError(PsframeError):
    """A task refused a call as unauthenticated: the auth token is missing or not the cluster's."""


class RemoteError(PsframeError):
    """A peer failed in a way that has no more specific psframe error."""


# ---- the edges: starting a cluster on this machine, on Ray, on Spark


class LaunchError(PsframeError, ValueError):
    """The arguments given to :func:`psframe.launch.launch` cannot start a cluster."""


class RayRunError(PsframeError, RuntimeError):
    """A task of a :func:`psframe.ray.run` failed, its actor died, or a deadline passed; every actor was stopped."""


class RayConfigError(PsframeError, ValueError):
    """The arguments given to :func:`psframe.ray.run` cannot start a cluster."""


class SparkJobError(PsframeError, RuntimeError):
    """The Spark job running a psframe cluster failed, or ran past its timeout."""


def error_class(class_name: str) -> type[PsframeError] | None:
    """The psframe error class named ``class_name``, or None if psframe has none of that name."""
    cls = globals().get(class_name)
    return cls if isinstance(cls, type) and issubclass(cls, PsframeError) else None


def error_from_name(class_name: str, message: str, peer: str = "a peer") -> PsframeError:
    """The psframe error a peer reported by class name and message.

    Peers name the error they raised, so the caller raises the same class.

    Args:
        class_name: the error's class name, as the peer sent it.
        message: the error's message.
        peer: who reported it, for the message of an error psframe does not know.

    Returns:
        An instance of the class named, with ``message``; for a name psframe
        does not know (a newer peer, or a mangled reply), a :class:`RemoteError`
        whose message names the class, the peer and the message.
    """
    cls = error_class(class_name)
    if cls is None:
        named = repr(class_name) if class_name else "no error name"
        return RemoteError(f"{peer} failed with {named}, which is not a psframe error: {message}")
    return cls(message)


__all__ = [
    "AuthenticationError",
    "BarrierTimeoutError",
    "CheckpointCorruptError",
    "CheckpointCutError",
    "CheckpointError",
    "ClusterMismatchError",
    "ClusterSpecError",
    "ConnectTimeoutError",
    "DataRangeLostError",
    "DtypeMismatchError",
    "Interrupted",
    "InvalidGradientError",
    "LaunchError",
    "NanLossError",
    "NotReadyError",
    "OptimizerConfigError",
    "PlacementError",
    "PortInUseError",
    "PsframeError",
    "RayConfigError",
    "RayRunError",
    "RemoteError",
    "RowIdError",
    "RpcTimeoutError",
    "SecurityConfigError",
    "ServeRequestError",
    "ShapeMismatchError",
    "SharedRegionError",
    "SnapshotError",
    "SparkJobError",
    "StreamError",
    "TaskStopped",
    "TaskUnavailableError",
    "TrainingFinishedError",
    "UnknownVariableError",
    "WireFormatError",
]
