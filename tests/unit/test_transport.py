"""psframe.wire.transport: the one seam between psframe and gRPC.

The method table is the .proto's service; every method has a handler on a ps
task; errors cross it both ways keeping their class; every call has a
deadline. In-process servers on ports the OS picks, loopback only.

This file holds the unit tier's tests of the subject; `tests/service/test_transport.py` holds the
other tiers'.
"""

from __future__ import annotations

import ast
import inspect

from psframe.cluster import ClusterSpec
from psframe.ps.service import ParameterServerService
from psframe.ps.service.task_service import TaskService
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport
from tests.conftest import ROOT


def test_the_method_table_is_the_service_of_the_proto():
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    assert list(transport.METHODS) == [m.name for m in service.methods]
    for descriptor in service.methods:
        method = transport.METHODS[descriptor.name]
        assert method.path == f"/psframe.ParameterServer/{descriptor.name}"
        assert method.request_type.DESCRIPTOR is descriptor.input_type
        assert method.reply_type.DESCRIPTOR is descriptor.output_type
        assert method.streaming == descriptor.client_streaming == descriptor.server_streaming
    assert {m.name for m in transport.METHODS.values() if m.carries_tensors} == {
        "Init",
        "PushPull",
        "FetchParts",
        "CopyPartsLive",
    }


def test_a_ps_task_handles_every_method_of_the_service_and_a_bare_task_a_few():
    cluster = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    handlers = ParameterServerService(cluster, 0).handlers()
    assert set(handlers) == set(transport.METHODS)
    for name, handler in handlers.items():
        assert inspect.isgeneratorfunction(handler) == transport.METHODS[name].streaming, name
    assert set(TaskService(cluster, "worker", 0).handlers()) == {"GetInfo", "Shutdown"}


def test_only_the_transport_package_imports_grpc():
    importers = []
    for path in sorted((ROOT / "psframe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "grpc" or n.startswith("grpc.") for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert importers and all(path.startswith("psframe/wire/transport/") for path in importers), importers
