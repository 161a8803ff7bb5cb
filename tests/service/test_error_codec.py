"""psframe.wire.transport.error_codec: one codec for the errors tasks answer with.

Every class of psframe.errors crosses both paths keeping its class and its
message: a unary call that ends with it (status code + trailing metadata),
and a PushPull reply that refuses its request (the reply header). A name
psframe does not know comes back as a RemoteError naming it. In-process
servers on ports the OS picks, loopback only.

This file holds the service tier's tests of the subject; `tests/unit/test_error_codec.py` holds the
other tiers'.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from psframe import errors
from psframe.wire import codec, transport
from psframe.wire import psframe_pb2 as pb
from psframe.wire.transport import error_codec
from psframe.worker.client.operations import PullRows
from psframe.worker.client.streams import PushPullStreams
from tests.unit.test_error_codec import ALL_ERRORS, DEADLINE_S, _message, _Served, served  # noqa: F401


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_class_comes_back_from_a_unary_call(served, cls):
    request = pb.InfoRequest(caller=pb.Caller(job_name=cls.__name__))
    with pytest.raises(cls) as info:
        served.connection.call("GetInfo", request, timeout=DEADLINE_S)
    assert info.type is cls and str(info.value) == _message(cls)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_class_comes_back_from_a_push_pull_reply(served, cls):
    pull = PullRows(0, [(cls.__name__, torch.tensor([0]))])
    with pytest.raises(cls) as info:
        served.streams.exchange([pull], step=0, compress=False, timeout=DEADLINE_S)
    assert info.type is cls and str(info.value) == _message(cls)


@pytest.mark.parametrize("cls", [cls for cls, _ in error_codec.STATUS_OF] + [errors.LaunchError])
def test_a_unary_call_ends_with_the_error_s_status_and_class_name(served, cls):
    channel = grpc.insecure_channel(f"127.0.0.1:{served.port}")
    try:
        call = channel.unary_unary(transport.METHODS["GetInfo"].path)
        request = pb.InfoRequest(caller=pb.Caller(job_name=cls.__name__)).SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=DEADLINE_S)
    finally:
        channel.close()
    error = info.value
    assert error.code() == transport.status_code(cls("x"))  # type: ignore[attr-defined]
    assert dict(error.trailing_metadata())[transport.ERROR_METADATA_KEY] == cls.__name__  # type: ignore[attr-defined]
    assert error.details() == _message(cls)  # type: ignore[attr-defined]


def test_an_unknown_error_name_in_a_push_pull_reply_is_a_remote_error_naming_it(served):
    def push_pull(requests):
        for _ in requests:
            yield codec.encode(pb.PushPullReplyHeader(error_class="ErrorOfANewerPsframe", error_message="boom"), ())

    server = transport.RpcServer({"PushPull": push_pull}, name="/job:ps/task:1", max_threads=2)
    port = server.bind("127.0.0.1:0")
    server.start()
    connection = transport.Connection(f"127.0.0.1:{port}", "/job:ps/task:1 under test")
    streams = PushPullStreams([connection], pb.Caller(job_name="worker"), None, share_with=False)
    try:
        with pytest.raises(
            errors.RemoteError, match=r"/job:ps/task:1 under test failed with 'ErrorOfANewerPsframe'.*boom"
        ):
            streams.exchange([PullRows(0, [("w", torch.tensor([0]))])], step=0, compress=False, timeout=DEADLINE_S)
    finally:
        streams.close()
        connection.close()
        server.stop(0.1)
