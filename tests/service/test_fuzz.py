"""Issue 17, parts 3 and 4: no input a caller sends can hurt a ps task.

One ps task (in this process, on a free loopback port, with an auth token)
holds a small model with an embedding table, made by a real Trainer (the
chief), which stays connected throughout. Every method of the service is
fed random bytes, truncated messages, protobuf that declares huge lengths,
tensors of the wrong dtype or shape, negative, enormous and too many
dimensions, and streams that stop halfway, with and without the token.
After each test: every call got a status code (or, on PushPull, a reply
naming the error), the Trainer's pull still works, and every stored value,
the global step and the count of applied pushes are as before.

Plus: a property-based test of the codec's decoder on arbitrary bytes and
envelopes (hypothesis; seeded and bounded), the per-host cap on calls in
flight, the message size cap, and what a ps task does with NaN/Inf
gradients (it applies them as torch.optim would; workers guard their loss
with NanGuardHook). Loopback only, OS-picked ports, bounded in count.

This file holds the service tier's tests of the subject; `tests/unit/test_fuzz.py` holds the other
tiers'.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import threading

import grpc
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import psframe
from psframe.config.security import generate_token
from psframe.errors import WireFormatError
from psframe.wire import codec, dtypes, encoding, row_tensors, transport
from psframe.wire import psframe_pb2 as pb
from psframe.wire.transport import limits
from tests.conftest import free_cluster

DEADLINE_S = 10.0
SEED = 17
MAX_MESSAGE_BYTES = 1 << 20  # the fuzzed ps task's cap, small enough to cross in a test
TABLE = "emb.weight"
# What a ps task answers bad input with (a refused PushPull request is named in its reply instead).
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 3, sparse=True), "fc": torch.nn.Linear(3, 2)})


class Target:
    """The fuzzed ps task, its token and its chief; calls as anyone, with any bytes."""

    def __init__(self) -> None:
        self.token = generate_token()
        self.cluster = free_cluster(1, 2)
        self.server = psframe.Server(
            self.cluster,
            "ps",
            0,
            serving_processes=1,
            security=psframe.Security(auth_token=self.token),
            worker_timeout=3600.0,
            max_message_bytes=MAX_MESSAGE_BYTES,
        )
        self.model = make_model()
        self.trainer = psframe.Trainer(
            self.model,
            self.cluster,
            security=psframe.Security(auth_token=self.token),
            optimizer=psframe.optim.SGD(lr=0.1),
            transport=psframe.Transport(connect_timeout=DEADLINE_S, rpc_timeout=DEADLINE_S),
        )
        self.trainer.__enter__()
        self.channel = grpc.insecure_channel(self.server.address)
        self.caller = pb.Caller(job_name="worker", task_index=1, cluster_fingerprint=self.cluster.fingerprint)
        self.chief = pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=self.cluster.fingerprint)
        self.metadata = (("authorization", "Bearer " + self.token),)
        self.info = self.unary("GetInfo", pb.InfoRequest().SerializeToString())
        self.defs = {d.name: d for d in pb.TaskInfo.FromString(self.info).variables}

    def close(self) -> None:
        self.trainer.__exit__(None, None, None)
        self.channel.close()
        self.server.stop(grace=0.1)

    def unary(self, method: str, data: bytes, metadata=()) -> bytes:
        return self.channel.unary_unary(transport.METHODS[method].path)(
            data, timeout=DEADLINE_S, metadata=self.metadata if metadata == () else metadata
        )

    def stream(self, requests: list[bytes], metadata=()) -> list[bytes]:
        call = self.channel.stream_stream(transport.METHODS["PushPull"].path)
        return list(call(iter(requests), timeout=DEADLINE_S, metadata=self.metadata if metadata == () else metadata))

    def push_pull(self, header: pb.PushPullHeader, tensors=(), kinds=()) -> pb.PushPullReplyHeader:
        """One PushPull request, with the token; the reply's header."""
        (reply,) = self.stream([codec.encode(header, list(tensors), kinds)])
        return codec.decode(reply, pb.PushPullReplyHeader)[0]

    def snapshot(self) -> dict[str, object]:
        """Every stored value (whole variables, and every row of the table), the step and the steps applied."""
        dense = sorted(name for name, d in self.defs.items() if not d.table)
        ids = torch.arange(self.defs[TABLE].shape[0])
        header = pb.PushPullHeader(caller=self.caller, pull=dense)
        tensors, kinds = row_tensors.pull_tensors([(TABLE, ids)])
        (reply,) = self.stream([codec.encode(header, tensors, kinds)])
        head, values = codec.decode(reply, pb.PushPullReplyHeader)
        assert not head.error_class, head.error_message
        info = pb.TaskInfo.FromString(self.unary("GetInfo", pb.InfoRequest().SerializeToString()))
        return {
            **{n: v.clone() for n, v in zip([*dense, TABLE], values)},
            "global_step": info.global_step,
            "applied_steps": info.applied_steps,
        }


@pytest.fixture(scope="module")
def target():
    made = Target()
    yield made
    made.close()


@pytest.fixture
def unchanged(target):
    """The ps task, checked after the test: alive, serving its chief, every value as before."""
    before = target.snapshot()
    yield target
    target.trainer.pull()  # a real worker's call
    after = target.snapshot()
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), f"{key} changed"
        else:
            assert after[key] == value, f"{key}: {value} -> {after[key]}"


def refused(call) -> grpc.RpcError:
    """The error ``call()`` ends with (it must end with one)."""
    try:
        call()
    except grpc.RpcError as e:
        return e
    pytest.fail("the call was answered")


def assert_refused(target: Target, method: str, data: bytes, metadata=(), codes=frozenset(REFUSALS)) -> None:
    """``data`` sent to ``method`` is refused: a status code in ``codes``, or a PushPull reply naming the error."""
    if method != "PushPull":
        error = refused(lambda: target.unary(method, data, metadata))
        assert error.code() in codes, (method, error.code(), error.details())
        return
    try:
        replies = target.stream([data], metadata)
    except grpc.RpcError as e:
        assert e.code() in codes, (method, e.code(), e.details())
        return
    header, _ = codec.decode(replies[0], pb.PushPullReplyHeader)
    assert header.error_class or header.region_unusable, f"PushPull answered {data[:40]!r}... without naming an error"


# ---- every method, junk bytes


def junk(rng: random.Random, count: int) -> list[bytes]:
    """Random byte strings of random lengths (empty included), and protobuf-shaped ones."""
    out = [b"", b"\x00", b"\xff" * 16]
    for _ in range(count):
        out.append(rng.randbytes(rng.choice([1, 7, 64, 600])))
        # A field that declares a huge length and carries a few bytes.
        out.append(
            bytes([rng.choice([0x0A, 0x12, 0x1A, 0x22])])
            + encoding.varint(rng.choice([2**31, 2**40, 2**63]))
            + rng.randbytes(5)
        )
    return out


def valid_request(target: Target, method: str) -> bytes:
    """A request of ``method`` psframe would send (to be cut short)."""
    if method == "Init":
        header = pb.InitHeader(caller=target.chief, variables=list(target.defs.values()))
        return codec.encode(header, [("fc.bias", torch.zeros(2))])
    if method == "PushPull":
        return codec.encode(
            pb.PushPullHeader(caller=target.caller, pull=["fc.bias"]), [("fc.weight", torch.zeros(2, 3))]
        )
    if method == "FetchParts":
        return codec.encode(pb.FetchPartsHeader(caller=target.caller, variables=["fc.bias"]), [])
    if method == "CopyPartsLive":
        return codec.encode(pb.CopyPartsLiveHeader(caller=target.caller, variables=["fc.bias"]), [])
    request = transport.METHODS[method].request_type(caller=target.caller)
    return request.SerializeToString()


@pytest.mark.parametrize("method", sorted(transport.METHODS))
def test_junk_and_truncated_requests_get_a_status_code(unchanged, method):
    target = unchanged
    rng = random.Random(f"{SEED}-{method}")
    whole = valid_request(target, method)
    cuts = sorted({1, 2, len(whole) // 3, len(whole) // 2, len(whole) - 1})
    for data in junk(rng, 8) + [whole[:cut] for cut in cuts]:
        if data == b"" and not transport.METHODS[method].carries_tensors and method != "PushPull":
            continue  # the empty message: a valid request of no caller, refused below as such
        assert_refused(target, method, data, codes=REFUSALS)
    # Without the token, or with another: UNAUTHENTICATED, whatever the bytes.
    for metadata in (None, (("authorization", "Bearer " + generate_token()),)):
        for data in junk(rng, 2) + [whole]:
            assert_refused(target, method, data, metadata, codes={grpc.StatusCode.UNAUTHENTICATED})


@pytest.mark.parametrize(
    "method",
    [
        "Finish",
        "HoldCut",
        "SaveShard",
        "MoveCut",
        "Shutdown",
        "StepMembers",
        "GetInfo",
        "TakeParts",
        "RelayoutStatus",
        "AskRelayout",
        "RelayoutDone",
        "Precopy",
    ],
)
def test_requests_of_another_cluster_change_nothing(unchanged, method):
    target = unchanged
    stranger = pb.Caller(job_name="worker", task_index=1, cluster_fingerprint="f" * 16)
    request = transport.METHODS[method].request_type(caller=stranger)
    if method == "GetInfo":  # answers anyone with the token: who the task is
        assert pb.TaskInfo.FromString(target.unary(method, request.SerializeToString())).job_name == "ps"
        return
    if method == "RelayoutStatus":  # asking where the ps tasks are answers anyone; asking them to move does not
        reply = pb.RelayoutStatusReply.FromString(target.unary(method, request.SerializeToString()))
        assert reply.cluster_spec == ""
        return
    if method == "AskRelayout":
        request.cluster_spec = "ps|127.0.0.1:1,worker|127.0.0.1:2"
    assert_refused(target, method, request.SerializeToString())
    assert_refused(target, method, transport.METHODS[method].request_type().SerializeToString())


# ---- valid-looking requests with bad tensors


def meta_envelope(header, metas: list[dict], payload: bytes) -> bytes:
    """An envelope whose tensor metadata says whatever ``metas`` say, over ``payload``."""
    for meta in metas:
        header.tensors.add(**meta)
    serialized = header.SerializeToString()
    return (
        encoding.PAYLOAD_TAG
        + encoding.varint(len(payload))
        + payload
        + encoding.HEADER_TAG
        + encoding.varint(len(serialized))
        + serialized
    )


BAD_TENSORS = {
    "wrong_dtype": {"name": "fc.weight", "dtype": "float64", "shape": [2, 3], "nbytes": 48},
    "unknown_dtype": {"name": "fc.weight", "dtype": "float128", "shape": [2, 3], "nbytes": 96},
    "wrong_shape": {"name": "fc.weight", "dtype": "float32", "shape": [3, 2], "nbytes": 24},
    "negative_dim": {"name": "fc.weight", "dtype": "float32", "shape": [-2, -3], "nbytes": 24},
    "huge_empty": {"name": "fc.weight", "dtype": "float32", "shape": [0, 2**62], "nbytes": 0},
    "overflowing_empty": {"name": "fc.weight", "dtype": "float32", "shape": [2**62, 2**62, 0], "nbytes": 0},
    "too_many_dims": {"name": "fc.weight", "dtype": "float32", "shape": [1] * 1000, "nbytes": 4},
    "nbytes_not_shape": {"name": "fc.weight", "dtype": "float32", "shape": [2, 3], "nbytes": 4},
    "past_the_payload": {"name": "fc.weight", "dtype": "float32", "shape": [2, 3], "nbytes": 24, "offset": 2**40},
    "huge_nbytes": {"name": "fc.weight", "dtype": "uint8", "shape": [2**40], "nbytes": 2**40},
    "unknown_variable": {"name": "nope", "dtype": "float32", "shape": [2, 3], "nbytes": 24},
    "unknown_kind": {"name": "fc.weight", "dtype": "float32", "shape": [2, 3], "nbytes": 24, "kind": 9},
    "ids_without_rows": {"name": TABLE, "dtype": "int64", "shape": [1], "nbytes": 8, "kind": 1},
    "rows_without_ids": {"name": TABLE, "dtype": "float32", "shape": [1, 3], "nbytes": 12, "kind": 2},
    "float_row_ids": {"name": TABLE, "dtype": "float32", "shape": [2], "nbytes": 8, "kind": 3},
    "table_as_a_whole": {"name": TABLE, "dtype": "float32", "shape": [6, 3], "nbytes": 72},
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_pushes_of_bad_tensors_are_refused_naming_the_error(unchanged, case):
    payload = torch.full((32,), 0.5).numpy().tobytes()  # 128 bytes: room for the small cases
    data = meta_envelope(pb.PushPullHeader(caller=unchanged.caller, pull=["fc.bias"]), [BAD_TENSORS[case]], payload)
    (reply,) = unchanged.stream([data])
    header, tensors = codec.decode(reply, pb.PushPullReplyHeader)
    assert header.error_class and not tensors, (case, header)


ROW_CASES = {
    "ids_out_of_range": ([(TABLE, torch.tensor([0, 6]))], [torch.ones(2, 3)]),
    "negative_ids": ([(TABLE, torch.tensor([-1]))], [torch.ones(1, 3)]),
    "rows_of_another_shape": ([(TABLE, torch.tensor([1]))], [torch.ones(1, 4)]),
    "rows_of_another_dtype": ([(TABLE, torch.tensor([1]))], [torch.ones(1, 3, dtype=torch.float64)]),
}


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_pushes_of_bad_rows_are_refused(unchanged, case):
    pulls, rows = ROW_CASES[case]
    tensors, kinds = row_tensors.push_tensors([(name, ids, r) for (name, ids), r in zip(pulls, rows)])
    header = unchanged.push_pull(pb.PushPullHeader(caller=unchanged.caller, end_of_step=True), tensors, kinds)
    assert header.error_class, case
    if "ids" in case:  # nor can they be pulled
        pull_tensors, pull_kinds = row_tensors.pull_tensors(pulls)
        assert unchanged.push_pull(pb.PushPullHeader(caller=unchanged.caller), pull_tensors, pull_kinds).error_class


def test_bad_headers_and_shared_regions_are_refused(unchanged):
    target = unchanged
    grads = [("fc.weight", torch.ones(2, 3))]
    cases = {
        "wire_dtype": pb.PushPullHeader(caller=target.caller, wire_dtype="int4"),
        "pull_unknown": pb.PushPullHeader(caller=target.caller, pull=["nope"]),
        "region_elsewhere": pb.PushPullHeader(
            caller=target.caller,
            same_host=pb.SameHostRegion(
                path="/etc/passwd",
                key=bytes(16),
                size=64,
                request_start=16,
                request_length=24,
                reply_start=48,
                in_region=True,
            ),
        ),
        "region_nul": pb.PushPullHeader(
            caller=target.caller,
            same_host=pb.SameHostRegion(
                path="/dev/shm/psframe-\x00x",
                key=bytes(16),
                size=64,
                request_start=16,
                request_length=24,
                reply_start=48,
                in_region=True,
            ),
        ),
        "region_offsets": pb.PushPullHeader(
            caller=target.caller,
            same_host=pb.SameHostRegion(
                path="/dev/shm/psframe-none",
                key=bytes(16),
                size=64,
                request_start=2**63,
                request_length=2**63,
                reply_start=0,
                in_region=True,
            ),
        ),
        "region_missing": pb.PushPullHeader(
            caller=target.caller,
            same_host=pb.SameHostRegion(
                path="/dev/shm/psframe-none",
                key=bytes(16),
                size=2**62,
                request_start=16,
                request_length=24,
                reply_start=48,
                in_region=True,
            ),
        ),
    }
    for name, header in cases.items():
        reply = target.push_pull(header, grads)
        if name.startswith("region_"):  # the worker would send the tensors in the message instead
            assert reply.region_unusable and not reply.error_class and not reply.tensors, name
        else:
            assert reply.error_class, name
    # An offered region the task cannot use is declined, and the tensors in the message are used.
    offer = pb.PushPullHeader(
        caller=target.caller,
        pull=["fc.bias"],
        same_host=pb.SameHostRegion(
            path="/dev/shm/psframe-none", key=bytes(16), size=64, request_start=16, request_length=24, reply_start=48
        ),
    )
    reply = target.push_pull(offer)
    assert not reply.error_class and reply.region_refused


@pytest.mark.parametrize(
    "case",
    [
        "huge_shape",
        "negative_dim",
        "too_many_dims",
        "unknown_dtype",
        "infinite_timeout",
        "nan_timeout",
        "too_many_replicas",
        "another_model",
    ],
)
def test_init_requests_declaring_absurd_models_are_refused(unchanged, case):
    target = unchanged
    defs = [pb.VariableDef() for _ in target.defs]
    for new, old in zip(defs, target.defs.values()):
        new.CopyFrom(old)
    header = pb.InitHeader(caller=target.chief, variables=defs, optimizer=pb.OptimizerDef(name="SGD"))
    header.optimizer.kwargs["lr"].number = 0.1
    changed = defs[0]
    if case == "huge_shape":
        changed.shape[:] = [2**40, 2**40]
    elif case == "negative_dim":
        changed.shape[0] = -5
    elif case == "too_many_dims":
        changed.shape[:] = [1] * 100
    elif case == "unknown_dtype":
        changed.dtype = "float1024"
    elif case == "another_model":
        changed.shape[0] += 1
    else:
        timeout = {"infinite_timeout": float("inf"), "nan_timeout": float("nan")}.get(case, 10.0)
        header.sync.CopyFrom(
            pb.SyncDef(
                replicas_to_aggregate=1, total_num_replicas=2 if "timeout" in case else 9, timeout_seconds=timeout
            )
        )
    assert_refused(target, "Init", codec.encode(header, []))


@pytest.mark.service
def test_a_ps_waiting_for_its_model_allocates_nothing_absurd():
    """Before its model exists, a ps task would make what the chief declares: absurd
    declarations are refused first, and the task still takes a sane model afterwards."""
    token = generate_token()
    cluster = free_cluster(1, 2)
    chief = pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=cluster.fingerprint)
    table = pb.VariableDef(name="t", variable="t", dtype="float32", shape=[2**39, 2], full_shape=[2**39, 2], table=True)
    with (
        psframe.Server(cluster, "ps", 0, serving_processes=1, security=psframe.Security(auth_token=token)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):

        def init(header: pb.InitHeader, tensors=(), kinds=()) -> bytes:
            header.caller.CopyFrom(chief)
            header.optimizer.name = "SGD"
            header.optimizer.kwargs["lr"].number = 0.1
            header.table_optimizer.CopyFrom(header.optimizer)
            return channel.unary_unary(transport.METHODS["Init"].path)(
                codec.encode(header, list(tensors), kinds),
                timeout=DEADLINE_S,
                metadata=(("authorization", "Bearer " + token),),
            )

        rows, kinds = row_tensors.push_tensors([("t", torch.tensor([0]), torch.ones(1, 2))])
        for declared, sync in [
            ([2**39, 2**39], None),
            ([1] * 65, None),
            ([2, 2], pb.SyncDef(replicas_to_aggregate=1, total_num_replicas=2, timeout_seconds=float("inf"))),
        ]:
            table.shape[:] = table.full_shape[:] = declared
            header = pb.InitHeader(variables=[table], sync=sync)
            tensors = rows if declared != [2, 2] else []
            error = refused(lambda header=header, tensors=tensors: init(header, tensors, kinds))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert server.service.info().state == pb.TaskInfo.WAITING_FOR_MODEL
        table.shape[:] = table.full_shape[:] = [2, 2]
        rows, kinds = row_tensors.push_tensors([("t", torch.tensor([0, 1]), torch.ones(2, 2))])
        reply = codec.decode(init(pb.InitHeader(variables=[table]), rows, kinds), pb.InitReplyHeader)[0]
        assert reply.created and reply.state == pb.TaskInfo.READY


# ---- streams that stop halfway


def http2_request(path: str, token: str | None, declared: int, sent: bytes) -> bytes:
    """The bytes of an HTTP/2 connection opening one gRPC call whose message declares ``declared``
    bytes and carries ``sent`` (headers HPACK-encoded as literals, no Huffman)."""

    def header(name: str, value: str) -> bytes:
        n, v = name.encode(), value.encode()
        assert len(n) < 127 and len(v) < 127
        return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v

    def frame(kind: int, flags: int, stream: int, body: bytes) -> bytes:
        return struct.pack(">I", len(body))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + body

    headers = b"".join(
        header(k, v)
        for k, v in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *([("authorization", "Bearer " + token)] if token else []),
        ]
    )
    message = b"\x00" + struct.pack(">I", declared) + sent
    return b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, headers) + frame(0, 0, 1, message)


def grpc_status_of(sock: socket.socket) -> int:
    """The grpc-status the server ends stream 1 of a raw HTTP/2 connection with (read as
    grpc-core sends it: trailers in a HEADERS frame, the value a literal)."""
    buffer = b""
    while True:
        while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
            chunk = sock.recv(65536)
            assert chunk, "the connection closed without a status"
            buffer += chunk
        length = int.from_bytes(buffer[:3], "big")
        kind, flags, stream, body = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big"), buffer[9 : 9 + length]
        buffer = buffer[9 + length :]
        if kind == 1 and flags & 1 and stream == 1:  # HEADERS, END_STREAM
            found = re.search(rb"grpc-status.([0-9]+)", body, re.DOTALL)
            assert found, body
            return int(found.group(1))


@pytest.mark.parametrize("declared", [64, 10_000, 2**31 - 1], ids=["short", "long", "over_the_cap"])
def test_a_call_that_stops_halfway_holds_nothing_others_need(unchanged, declared):
    target = unchanged
    host, port = target.server.address.rsplit(":", 1)
    socks = []
    try:
        for path in (transport.METHODS["PushPull"].path, transport.METHODS["Init"].path):
            for token in (target.token, None):
                sock = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
                sock.sendall(http2_request(path, token, declared, b"\x0a\x02" + b"x" * 30))
                socks.append(sock)
                if declared > MAX_MESSAGE_BYTES:  # refused at once, token or not
                    assert grpc_status_of(sock) in (
                        (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],)
                        if token
                        else (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], grpc.StatusCode.UNAUTHENTICATED.value[0])
                    )
        half_preface = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
        half_preface.sendall(b"PRI * HTTP/2.0\r\n")
        socks.append(half_preface)
        # A gRPC stream that sent one request, then neither another nor its end.
        requests = threading.Event()

        def idle():
            yield codec.encode(pb.PushPullHeader(caller=target.caller, pull=["fc.bias"]), [])
            requests.wait(DEADLINE_S)

        call = target.channel.stream_stream(transport.METHODS["PushPull"].path)(
            idle(), timeout=DEADLINE_S, metadata=target.metadata
        )
        assert not codec.decode(next(call), pb.PushPullReplyHeader)[0].error_class
        # Meanwhile everyone else is served.
        target.trainer.pull()
        target.snapshot()
        requests.set()
        call.cancel()
    finally:
        for sock in socks:
            sock.close()


def test_a_message_over_the_cap_is_refused_before_it_is_read(unchanged):
    target = unchanged
    big = torch.zeros(MAX_MESSAGE_BYTES // 4 + 16)
    data = codec.encode(pb.PushPullHeader(caller=target.caller), [("fc.weight", big)])
    for method in ("PushPull", "Init"):
        assert_refused(target, method, data, codes={grpc.StatusCode.RESOURCE_EXHAUSTED})


@pytest.mark.service
def test_one_host_cannot_take_every_thread(tmp_path):
    """A host's calls in flight are capped below the server's threads: its next one is refused
    RESOURCE_EXHAUSTED at once, and callers on another host (here a Unix socket) are still served."""
    release = threading.Event()

    def hold(requests):  # a stream that holds its thread until released
        for _ in requests:
            release.wait(DEADLINE_S)
            yield b""

    server = transport.RpcServer(
        {"PushPull": hold, "GetInfo": lambda request: pb.TaskInfo(job_name="ps")}, name="/job:ps/task:0", max_threads=8
    )
    port = server.bind("127.0.0.1:0")
    local = server.bind_local(str(tmp_path / "s.sock"))
    server.start()
    cap = limits.default_calls_per_peer(8)
    calls, channels = [], []
    try:
        for _ in range(cap):  # one connection each: HTTP/2 would queue streams beyond the cap on one
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=(("grpc.use_local_subchannel_pool", 1),))
            channels.append(channel)
            call = channel.stream_stream(transport.METHODS["PushPull"].path)(iter([b"x"] * 2), timeout=DEADLINE_S)
            calls.append(call)
        waited = threading.Event()
        for _ in range(int(DEADLINE_S / 0.01)):  # until every stream holds its thread
            if server.limiter.in_flight().get("ipv4:127.0.0.1", 0) >= cap or waited.wait(0.01):
                break
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            error = refused(lambda: channel.unary_unary(transport.METHODS["GetInfo"].path)(b"", timeout=DEADLINE_S))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most" in error.details()
        with transport.Connection(local) as other:
            assert other.call("GetInfo", pb.InfoRequest(), timeout=DEADLINE_S).job_name == "ps"
    finally:
        release.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        server.stop(grace=0.1)
    assert server.limiter.refused == 1


# ---- NaN and Inf gradients


@pytest.mark.service
def test_nan_and_inf_gradients_are_applied_as_torch_would_and_the_task_serves_on():
    """A ps task does not look at the values of gradients: NaN and Inf reach the optimizer,
    as they would in one process (NanGuardHook keeps a worker from sending them)."""
    token = generate_token()
    cluster = free_cluster(1, 1)
    with psframe.Server(cluster, "ps", 0, serving_processes=1, security=psframe.Security(auth_token=token)) as server:
        model = torch.nn.Linear(2, 2)
        trainer = psframe.Trainer(
            model,
            cluster,
            security=psframe.Security(auth_token=token),
            optimizer=psframe.optim.SGD(lr=0.5),
            transport=psframe.Transport(connect_timeout=DEADLINE_S, rpc_timeout=DEADLINE_S),
        )
        with trainer:
            expected = {n: p.detach().clone() for n, p in model.named_parameters()}
            grad = torch.tensor([[float("nan"), float("inf")], [-float("inf"), 1.0]])
            caller = pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=cluster.fingerprint)
            header = pb.PushPullHeader(caller=caller, pull=["weight", "bias"], end_of_step=True)
            with grpc.insecure_channel(server.address) as channel:
                (reply,) = channel.stream_stream(transport.METHODS["PushPull"].path)(
                    iter([codec.encode(header, [("weight", grad)])]),
                    timeout=DEADLINE_S,
                    metadata=(("authorization", "Bearer " + token),),
                )
            head, (weight, bias) = codec.decode(reply, pb.PushPullReplyHeader)
            assert not head.error_class and head.global_step == 1
            oracle = expected["weight"] - 0.5 * grad
            assert torch.equal(weight.isnan(), oracle.isnan()) and torch.equal(weight.nan_to_num(), oracle.nan_to_num())
            assert torch.equal(bias, expected["bias"])
            trainer.pull()  # the task serves on
            assert torch.equal(model.bias.detach(), expected["bias"]) and trainer.global_step == 1


# ---- the decoder, property-based


DTYPE_NAMES = sorted(dtypes.DTYPES) + ["", "float128", "torch.float32"]
dims = st.one_of(st.integers(0, 6), st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**31, 2**62, -1]))


@st.composite
def metas(draw) -> dict:
    """A tensor's metadata: often consistent (its nbytes those of its shape and dtype), often not."""
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    shape = draw(st.lists(dims, max_size=5) | st.lists(st.just(1), min_size=60, max_size=70))
    numel = 1
    for dim in shape:
        numel *= dim
    itemsize = dtypes.DTYPES[dtype].itemsize if dtype in dtypes.DTYPES else 4
    consistent = numel * itemsize if 0 <= numel * itemsize < 2**64 else 0
    nbytes = draw(st.just(consistent) | st.integers(0, 80) | st.integers(0, 2**64 - 1))
    offset = draw(st.integers(0, 100) | st.integers(0, 2**64 - 1))
    return {"name": draw(st.text(max_size=8)), "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes}


def check_decoded(data: bytes) -> None:
    """Decode either refuses with WireFormatError or gives tensors its header describes, from its payload."""
    try:
        header, tensors = codec.decode(data, pb.PushPullHeader)
    except WireFormatError:
        return
    envelope = encoding.parse(data, pb.PushPullHeader)
    assert len(tensors) == len(header.tensors)
    for meta, tensor in zip(header.tensors, tensors):
        assert tensor.dtype == dtypes.DTYPES[meta.dtype] and tuple(tensor.shape) == tuple(meta.shape)
        assert tensor.numel() * tensor.element_size() == meta.nbytes <= envelope.payload_length
        start = envelope.payload_start + meta.offset
        if meta.nbytes:
            assert encoding.raw_bytes(tensor).tobytes() == bytes(data[start : start + meta.nbytes])


PROPERTY = settings(
    max_examples=400, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
