"""psframe.wire.transport: the one seam between psframe and gRPC.

The method table is the .proto's service; every method has a handler on a ps
task; errors cross it both ways keeping their class; every call has a
deadline. In-process servers on ports the OS picks, loopback only.

This file holds the service tier's tests of the subject; `tests/unit/test_transport.py` holds the
other tiers'.
"""

from __future__ import annotations

import logging
import threading

import pytest

from psframe import errors
from psframe.launch import pick_free_ports
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport

DEADLINE_S = 10.0


class _Served:
    """An RpcServer on a free loopback port with the given handlers, and a connection to it."""

    def __init__(self, handlers) -> None:
        self.server = transport.RpcServer(handlers, name="/job:ps/task:0", max_threads=4)
        self.port = self.server.bind("127.0.0.1:0")
        self.server.start()
        self.connection = transport.Connection(f"127.0.0.1:{self.port}", "/job:ps/task:0 under test")

    def close(self) -> None:
        self.connection.close()
        self.server.stop(0.1)


@pytest.fixture
def serve():
    started: list[_Served] = []

    def start(handlers) -> _Served:
        started.append(_Served(handlers))
        return started[-1]

    yield start
    for served in started:
        served.close()


@pytest.mark.parametrize(
    "error",
    [
        errors.ShapeMismatchError,
        errors.ClusterMismatchError,
        errors.NotReadyError,
        errors.BarrierTimeoutError,
        errors.CheckpointError,
        errors.UnknownVariableError,
    ],
)
def test_a_handler_error_comes_back_as_the_same_class(serve, error):
    def get_info(request):
        raise error(f"refused {request.caller.task_index}")

    served = serve({"GetInfo": get_info})
    with pytest.raises(error, match="refused 3") as info:
        served.connection.call("GetInfo", pb.InfoRequest(caller=pb.Caller(task_index=3)), timeout=DEADLINE_S)
    assert info.type is error


def test_a_bug_in_a_handler_is_a_remote_error_and_the_server_keeps_serving(serve):
    calls = []

    def get_info(request):
        calls.append(request)
        if len(calls) == 1:
            raise KeyError("oops")
        return pb.TaskInfo(job_name="ps")

    served = serve({"GetInfo": get_info})
    with pytest.raises(errors.RemoteError, match="INTERNAL.*KeyError"):
        served.connection.call("GetInfo", pb.InfoRequest(), timeout=DEADLINE_S)
    assert served.connection.call("GetInfo", pb.InfoRequest(), timeout=DEADLINE_S).job_name == "ps"


def test_a_call_past_its_deadline_is_an_rpc_timeout(serve):
    release = threading.Event()

    def get_info(request):
        release.wait(DEADLINE_S)
        return pb.TaskInfo()

    served = serve({"GetInfo": get_info})
    try:
        with pytest.raises(errors.RpcTimeoutError, match="did not answer within 0.2s"):
            served.connection.call("GetInfo", pb.InfoRequest(), timeout=0.2)
    finally:
        release.set()


def test_a_stream_reply_past_its_deadline_is_an_rpc_timeout(serve):
    release = threading.Event()

    def push_pull(requests):
        for data in requests:
            release.wait(DEADLINE_S)
            yield data

    served = serve({"PushPull": push_pull})
    watchdog = transport.Watchdog()
    stream = served.connection.open_stream("PushPull", watchdog)
    try:
        stream.send(b"", 0.2)
        with pytest.raises(errors.RpcTimeoutError):
            stream.receive()
    finally:
        release.set()
        stream.close()
        watchdog.stop()


def test_a_stream_the_caller_closes_ends_quietly(serve, caplog):
    ended = threading.Event()

    def push_pull(requests):
        try:
            yield from requests
        finally:
            ended.set()

    served = serve({"PushPull": push_pull})
    watchdog = transport.Watchdog()
    stream = served.connection.open_stream("PushPull", watchdog)
    stream.send(b"x", DEADLINE_S)
    assert stream.receive() == b"x"
    stream.close()  # what a worker does when it finishes or resets its streams
    watchdog.stop()
    assert ended.wait(DEADLINE_S)
    served.server.stop(1.0)  # every call is over: anything logged is in by now
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.service
def test_nothing_listening_is_task_unavailable():
    (port,) = pick_free_ports(1)
    with transport.Connection(f"127.0.0.1:{port}", "/job:ps/task:0") as connection:
        with pytest.raises(errors.TaskUnavailableError, match="/job:ps/task:0 is unavailable"):
            connection.call("GetInfo", pb.InfoRequest(), timeout=DEADLINE_S)


def test_parallel_calls_return_in_order_and_raise_the_first_failure(serve):
    good = serve({"GetInfo": lambda request: pb.TaskInfo(task_index=request.caller.task_index)})
    bad = serve({"GetInfo": lambda request: (_ for _ in ()).throw(errors.NotReadyError("not yet"))})
    request = pb.InfoRequest(caller=pb.Caller(task_index=5))
    replies = transport.call_all([(good.connection, "GetInfo", request)] * 2, DEADLINE_S)
    assert [r.task_index for r in replies] == [5, 5]
    with pytest.raises(errors.NotReadyError, match="not yet"):
        transport.call_all([(good.connection, "GetInfo", request), (bad.connection, "GetInfo", request)], DEADLINE_S)


def test_the_server_refuses_unknown_methods_and_a_port_in_use(serve):
    with pytest.raises(ValueError, match=r"\['Nope'\] are not methods of psframe.ParameterServer"):
        transport.RpcServer({"Nope": lambda request: None}, name="x", max_threads=1)
    served = serve({"GetInfo": lambda request: pb.TaskInfo()})
    other = transport.RpcServer({}, name="/job:ps/task:1", max_threads=1)
    with pytest.raises(errors.PortInUseError, match=f"/job:ps/task:1 cannot listen on 127.0.0.1:{served.port}"):
        other.bind(f"127.0.0.1:{served.port}")


def test_a_forwarding_server_relays_replies_errors_and_streams(serve):
    release = threading.Event()

    def get_info(request):
        if request.caller.task_index == 1:
            raise errors.ShapeMismatchError("gradient for 'w' has shape (2,)")
        if request.caller.task_index == 2:
            release.wait(DEADLINE_S)
        return pb.TaskInfo(task_index=request.caller.task_index, job_name="ps")

    def push_pull(requests):
        for data in requests:
            yield data[::-1]

    owner = serve({"GetInfo": get_info, "PushPull": push_pull})
    forwarder = transport.RpcServer(
        {}, name="/job:ps/task:0-serving1", max_threads=4, forward_to=f"127.0.0.1:{owner.port}"
    )
    port = forwarder.bind("127.0.0.1:0")
    forwarder.start()
    watchdog = transport.Watchdog()
    try:
        with transport.Connection(f"127.0.0.1:{port}", "/job:ps/task:0") as connection:
            reply = connection.call("GetInfo", pb.InfoRequest(caller=pb.Caller(task_index=5)), timeout=DEADLINE_S)
            assert (reply.job_name, reply.task_index) == ("ps", 5)
            with pytest.raises(errors.ShapeMismatchError, match=r"has shape \(2,\)") as info:
                connection.call("GetInfo", pb.InfoRequest(caller=pb.Caller(task_index=1)), timeout=DEADLINE_S)
            assert info.type is errors.ShapeMismatchError
            # The caller's deadline travels with the forwarded call.
            with pytest.raises(errors.RpcTimeoutError):
                connection.call("GetInfo", pb.InfoRequest(caller=pb.Caller(task_index=2)), timeout=0.3)
            stream = connection.open_stream("PushPull", watchdog)
            for data in (b"abc", b"xyz"):
                stream.send(data, DEADLINE_S)
                assert stream.receive() == data[::-1]
            stream.close()
            # Methods neither side handles are UNIMPLEMENTED, relayed as they came.
            with pytest.raises(errors.RemoteError, match="UNIMPLEMENTED"):
                connection.call("Finish", pb.FinishRequest(), timeout=DEADLINE_S)
    finally:
        release.set()
        watchdog.stop()
        forwarder.stop(0.1)
