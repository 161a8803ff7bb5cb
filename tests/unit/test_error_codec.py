"""psframe.wire.transport.error_codec: one codec for the errors tasks answer with.

Every class of psframe.errors crosses both paths keeping its class and its
message: a unary call that ends with it (status code + trailing metadata),
and a PushPull reply that refuses its request (the reply header). A name
psframe does not know comes back as a RemoteError naming it. In-process
servers on ports the OS picks, loopback only.

This file holds the unit tier's tests of the subject; `tests/service/test_error_codec.py` holds the
other tiers'.
"""

from __future__ import annotations

import ast

import grpc
import pytest

import psframe.launch
import psframe.ray
from psframe import errors
from psframe.cluster import ClusterSpec
from psframe.errors import PsframeError
from psframe.ps.service import ParameterServerService
from psframe.wire import encoding, transport
from psframe.wire import psframe_pb2 as pb
from psframe.wire.transport import error_codec
from psframe.worker.client.streams import PushPullStreams
from tests.conftest import ROOT

DEADLINE_S = 10.0
PEER = "/job:ps/task:0 under test"

ALL_ERRORS = sorted(
    (cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, PsframeError)),
    key=lambda cls: cls.__name__,
)


def _message(cls: type[PsframeError]) -> str:
    return f"{cls.__name__} raised with a value (42) and 'quotes'"


# ---- the codec alone


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_class_round_trips_through_the_codec(cls):
    name, message = error_codec.encode_error(cls(_message(cls)))
    decoded = error_codec.decode_error(name, message, PEER)
    assert type(decoded) is cls and str(decoded) == _message(cls)


def test_every_error_class_travels_in_a_reply_header():
    for cls in ALL_ERRORS:
        name, message = transport.encode_error(cls(_message(cls)))
        header = pb.PushPullReplyHeader.FromString(
            pb.PushPullReplyHeader(error_class=name, error_message=message).SerializeToString()
        )
        decoded = transport.decode_error(header.error_class, header.error_message, PEER)
        assert type(decoded) is cls and str(decoded) == _message(cls), cls


@pytest.mark.parametrize("name", ["NoSuchError", "error_from_name", "ValueError", "annotations", ""])
def test_a_name_psframe_does_not_know_decodes_to_a_remote_error_naming_it(name):
    decoded = transport.decode_error(name, "it broke", PEER)
    assert type(decoded) is errors.RemoteError
    assert PEER in str(decoded) and "it broke" in str(decoded) and "not a psframe error" in str(decoded)
    assert (repr(name) if name else "no error name") in str(decoded)


def test_only_psframe_errors_are_encoded():
    with pytest.raises(TypeError, match="only a PsframeError travels as an error name; got KeyError"):
        transport.encode_error(KeyError("x"))  # type: ignore[arg-type]


def test_the_status_table_answers_the_first_row_that_matches_else_unknown():
    assert transport.status_code(errors.ShapeMismatchError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert transport.status_code(errors.SharedRegionError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert transport.status_code(errors.CheckpointCorruptError("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert transport.status_code(errors.BarrierTimeoutError("x")) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert transport.status_code(errors.LaunchError("x")) == grpc.StatusCode.UNKNOWN


# ---- every error class lives in psframe.errors


def test_every_exception_class_of_psframe_is_defined_in_psframe_errors():
    elsewhere = []
    for path in sorted((ROOT / "psframe").rglob("*.py")):
        if path.name.endswith("_pb2.py") or path == ROOT / "psframe" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases}
                if bases & ({cls.__name__ for cls in ALL_ERRORS} | {"Exception", "BaseException"}):
                    elsewhere.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not elsewhere, f"define these in psframe/errors.py (and re-export them): {elsewhere}"


def test_the_edges_re_export_their_errors_from_psframe_errors():
    assert psframe.launch.LaunchError is errors.LaunchError
    assert psframe.ray.RayRunError is errors.RayRunError
    assert psframe.ray.RayConfigError is errors.RayConfigError
    assert issubclass(errors.LaunchError, ValueError) and issubclass(errors.RayConfigError, ValueError)
    assert issubclass(errors.RayRunError, RuntimeError) and issubclass(errors.SparkJobError, RuntimeError)


def test_the_spark_edge_re_exports_its_error_from_psframe_errors():
    pytest.importorskip("pyspark")
    import psframe.spark

    assert psframe.spark.SparkJobError is errors.SparkJobError


# ---- both paths, through gRPC


class _Served:
    """An RpcServer on a free loopback port: GetInfo raises the error class its
    request names; PushPull is a ps service whose every request raises it."""

    def __init__(self) -> None:
        service = ParameterServerService(ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}), 0)
        service.push_pulls.answer = self._raise_named  # type: ignore[method-assign]
        handlers = {
            "GetInfo": lambda request: self._raise(request.caller.job_name),
            "PushPull": service.push_pulls.stream,
        }
        self.server = transport.RpcServer(handlers, name="/job:ps/task:0", max_threads=4)
        self.port = self.server.bind("127.0.0.1:0")
        self.server.start()
        self.connection = transport.Connection(f"127.0.0.1:{self.port}", PEER)
        self.streams = PushPullStreams([self.connection], pb.Caller(job_name="worker"), None, share_with=False)

    @staticmethod
    def _raise(name: str) -> None:
        cls = errors.error_class(name)
        assert cls is not None, name
        raise cls(_message(cls))

    def _raise_named(self, data: bytes, plans=None) -> bytes:
        self._raise(encoding.parse(data, pb.PushPullHeader).header.tensors[0].name)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.streams.close()
        self.connection.close()
        self.server.stop(0.1)


@pytest.fixture(scope="module")
def served():
    served = _Served()
    yield served
    served.close()
