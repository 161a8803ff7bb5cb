"""How a psframe error crosses from one task to another: one codec for every path.

An error travels as two strings, its class name and its message
(:func:`encode_error`), and is rebuilt as the same class with the same
message on the other side (:func:`decode_error`). Every class of
:mod:`psframe.errors` can be rebuilt; a name this psframe does not know
becomes a :class:`~psframe.errors.RemoteError` naming it and the peer.

The two strings take one of two paths:

- **a call that ends with the error** (a unary call, or a stream ended by
  its handler): the message is the status's details, the class name goes in
  the trailing metadata under :data:`ERROR_METADATA_KEY`, and the status
  code comes from :func:`status_code` (:func:`abort` on the server,
  :func:`error_from_rpc` on the caller);
- **a PushPull reply that refuses its request** while the stream goes on:
  the reply header's ``error_class`` and ``error_message``. The stream's
  status stays OK, so no status code travels with it.

To add an error, add its class to :mod:`psframe.errors` (an edge module may
re-export it), and, if it is answered with another status than
``UNKNOWN``, a row to :data:`STATUS_OF`; both paths then carry it.

Not every failure is an error on the wire. A request whose tensors lie in a
shared region the ps task cannot use is answered with the typed reply field
``region_unusable`` (the worker sends the tensors in the message instead),
as an offered region the task declines is with ``region_refused``.
"""

from __future__ import annotations

import logging

import grpc

from psframe import errors
from psframe.errors import PsframeError

log = logging.getLogger(__name__)

# A failing call carries the psframe error's class name in this trailing
# metadata key, so the caller can raise the same class.
ERROR_METADATA_KEY = "psframe-error"

# The status code of a call that ends with an error: the first row whose
# class the error is an instance of; UNKNOWN for the rest.
STATUS_OF: tuple[tuple[type[PsframeError], grpc.StatusCode], ...] = (
    (errors.InvalidGradientError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.WireFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.OptimizerConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ClusterMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NotReadyError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.BarrierTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def encode_error(error: PsframeError) -> tuple[str, str]:
    """The two strings ``error`` travels as.

    Args:
        error: the psframe error a handler raised.

    Returns:
        ``(class name, message)``, which :func:`decode_error` turns back into ``error``'s class.

    Raises:
        TypeError: ``error`` is not a :class:`~psframe.errors.PsframeError` (a bug is not sent as one).
    """
    if not isinstance(error, PsframeError):
        raise TypeError(f"only a PsframeError travels as an error name; got {type(error).__name__}: {error}")
    return type(error).__name__, str(error)


def decode_error(name: str, message: str, peer: str = "a peer") -> PsframeError:
    """The psframe error a peer sent as ``(name, message)``.

    Args:
        name: the error's class name, as :func:`encode_error` gave it.
        message: its message.
        peer: who sent it (e.g. ``"/job:ps/task:0 at h0:2222"``), named by an error psframe does not know.

    Returns:
        An instance of the class named, with ``message``; a
        :class:`~psframe.errors.RemoteError` naming ``name`` and ``peer`` for
        a name that is not a class of :mod:`psframe.errors`.
    """
    return errors.error_from_name(name, message, peer)


def status_code(error: PsframeError) -> grpc.StatusCode:
    """The gRPC status code a call that ends with ``error`` is answered with (see :data:`STATUS_OF`)."""
    return next((code for cls, code in STATUS_OF if isinstance(error, cls)), grpc.StatusCode.UNKNOWN)


def abort(context: grpc.ServicerContext, error: BaseException, method: str) -> None:
    """End a call with ``error`` (raises, as ``context.abort`` does).

    A psframe error ends it with its status code, its class name in the
    trailing metadata and its message as the details; anything else is a
    bug, logged and answered ``INTERNAL``.
    """
    if isinstance(error, PsframeError):
        name, message = encode_error(error)
        context.set_trailing_metadata(((ERROR_METADATA_KEY, name),))
        context.abort(status_code(error), message)
    # A bug, not bad input: say so, keep serving.
    log.error("%s failed", method, exc_info=error)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


def error_from_rpc(error: grpc.RpcError, peer: str, timeout: float | None = None) -> PsframeError:
    """The psframe error for a failed call to ``peer``.

    Args:
        error: what gRPC raised.
        peer: the task called, as errors name it.
        timeout: the call's deadline in seconds, named by a timeout.

    Returns:
        The error the handler raised (its class name travels in the trailing
        metadata), or a named transport error: AuthenticationError,
        TaskUnavailableError, RpcTimeoutError, or RemoteError for the rest.
    """
    metadata = dict(error.trailing_metadata() or ())
    name = metadata.get(ERROR_METADATA_KEY)
    if name:
        return decode_error(str(name), error.details() or "", peer)
    code = error.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.AuthenticationError(
            f"{peer} refused the call as unauthenticated: the auth token is missing or not the cluster's "
            f"(give every task and command the same --auth_token_file, or PSFRAME_AUTH_TOKEN)"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.TaskUnavailableError(f"{peer} is unavailable: {error.details()}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.RemoteError(
            f"{peer} refused the call with RESOURCE_EXHAUSTED: {error.details()} (a message over the task's "
            f"max_message_bytes, or too many calls in flight from this host; see psframe.wire.transport.limits)"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.RpcTimeoutError(f"{peer} did not answer within {timeout}s")
    return errors.RemoteError(f"{peer} failed with {code.name}: {error.details()}")
