"""The generated protobuf code is what scripts/gen_proto.py makes of psframe.proto."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT

GENERATED = ("psframe_pb2.py", "psframe_pb2.pyi")


def test_generated_code_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the `test` extra) regenerates the code")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen_proto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_proto)
    assert gen_proto.main(["--out", str(tmp_path)]) == 0
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "psframe" / "wire" / name).read_text()
        assert fresh == committed, f"psframe/wire/{name} is stale: run python scripts/gen_proto.py"


def test_every_tensor_carrying_message_is_a_header_payload_envelope():
    from psframe.wire import psframe_pb2 as pb

    envelopes = [m for m in pb.DESCRIPTOR.message_types_by_name.values() if "payload" in m.fields_by_name]
    assert {m.name for m in envelopes} == {
        "InitRequest",
        "InitResponse",
        "PushPullRequest",
        "PushPullResponse",
        "FetchPartsRequest",
        "FetchPartsResponse",
        "CopyPartsLiveRequest",
    }
    for message in envelopes:
        header, payload = message.fields_by_name["header"], message.fields_by_name["payload"]
        assert (header.number, payload.number) == (1, 2), message.name
        assert payload.type == payload.TYPE_BYTES
        assert "tensors" in header.message_type.fields_by_name, message.name
