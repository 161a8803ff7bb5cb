"""Tensors through a same-host shared region (psframe.wire.same_host), against messages.

Oracles: a worker's requests answered through a region give the replies and
variables that messages give, bit for bit, and after the offer carry no
tensors; a region the ps task cannot use is refused with nothing changed,
and the worker goes back to messages; no region file outlives its worker.

This file holds the unit tier's tests of the subject; `tests/service/test_shared_region.py` holds
the other tiers'.
"""

from __future__ import annotations

import os

import pytest
import torch

from psframe.errors import SharedRegionError
from psframe.ps.service import ParameterServerService
from psframe.ps.service.push_pull_handler import StreamCache
from psframe.wire import codec, encoding, same_host
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.same_host import SameHostRegion
from psframe.worker.client.operations import PreparedRequest
from tests.unit.test_fast_path import CLUSTER, VALUES, _service, _variables

pytestmark = pytest.mark.skipif(not same_host.available(), reason="no writable /dev/shm on this host")


def _region_files() -> set[str]:
    """This process's region files, less those an earlier test of the process left (its own check)."""
    return _files_of_this_process() - _LEFT_BEFORE


def _files_of_this_process() -> set[str]:
    return {name for name in os.listdir(same_host.DIRECTORY) if name.startswith(f"{same_host.PREFIX}{os.getpid()}-")}


_LEFT_BEFORE: set[str] = set()


@pytest.fixture(autouse=True)
def _files_left_before():
    """What this process held before the test: a test here answers for its own files only."""
    _LEFT_BEFORE.clear()
    _LEFT_BEFORE.update(_files_of_this_process())
    yield


def _layouts():
    request = MessageEncoding(pb.PushPullHeader, [("a", torch.float32, (5,)), ("h", torch.bfloat16, (3, 3))])
    reply = MessageEncoding(pb.PushPullReplyHeader, [("w", torch.float64, (2, 2)), ("c", torch.int8, (3,))])
    return request, reply


def test_a_region_carries_both_parts_aligned_between_a_maker_and_a_mapper():
    request, reply = _layouts()
    made = SameHostRegion.create(request, reply)
    try:
        grads = [torch.arange(5, dtype=torch.float32), torch.randn(3, 3).to(torch.bfloat16)]
        made.write_request(request, request.buffers(grads))
        header = pb.PushPullHeader()
        header.tensors.extend(request._metas)
        mapped = SameHostRegion.attach(made.message)
        received = request.tensors(mapped.request_envelope(header))
        assert all(torch.equal(a, b) for a, b in zip(received, grads))
        assert all(t.data_ptr() % 8 == 0 for t in received)  # views of the region, not copies
        values = [
            torch.tensor([[1.5, 2.0], [3.0, 4.0]], dtype=torch.float64),
            torch.tensor([1, -2, 3], dtype=torch.int8),
        ]
        assert mapped.fits_reply(reply)
        mapped.write_reply(reply, reply.buffers(values))
        reply_header = pb.PushPullReplyHeader()
        reply_header.tensors.extend(reply._metas)
        got = encoding.tensors_of(made.reply_envelope(reply_header))
        assert all(torch.equal(a, b) for a, b in zip(got, values))
    finally:
        made.unlink()
    assert not os.path.exists(made.message.path)


def test_a_held_message_is_read_whole_by_another_mapper_however_writev_splits_it(monkeypatch):
    """A message of more buffers than one ``writev`` takes, written a few bytes a call: the
    reader maps the very message; the file goes with the holder's unlink."""
    tensors = [(f"t{k}", torch.full((k % 5 + 1,), float(k))) for k in range(1500)]
    header = pb.FetchPartsReplyHeader(record="{}")
    chunks = codec.encode_chunks(header, tensors)
    assert len(chunks) > 2 * 1024  # past IOV_MAX: written in several calls
    writev = os.writev
    calls = []

    def stingy(fd, buffers):  # a write may take fewer bytes than asked: the rest is written after
        calls.append(len(buffers))
        return writev(fd, [memoryview(buffers[0]).cast("B")[:7]])

    monkeypatch.setattr(same_host.os, "writev", stingy)
    held = same_host.HeldMessage(chunks[:40])
    monkeypatch.setattr(same_host.os, "writev", writev)
    assert len(calls) > 1
    whole = same_host.HeldMessage(chunks)
    try:
        for message, expected in ((held.message, b"".join(chunks[:40])), (whole.message, b"".join(chunks))):
            mapped = SameHostRegion.attach(message)
            assert bytes(mapped.request_bytes()) == expected
        _, back = codec.decode(SameHostRegion.attach(whole.message).request_bytes(), pb.FetchPartsReplyHeader)
        assert all(torch.equal(a, b) for (_, a), b in zip(tensors, back))
    finally:
        held.unlink()
        whole.unlink()
    assert not os.path.exists(whole.message.path) and not os.path.exists(held.message.path)


def _named(region: SameHostRegion, **changes) -> pb.SameHostRegion:
    message = pb.SameHostRegion()
    message.CopyFrom(region.message)
    for field, value in changes.items():
        setattr(message, field, value)
    return message


def test_a_region_that_is_not_what_the_request_says_is_refused(tmp_path):
    request, reply = _layouts()
    made = SameHostRegion.create(request, reply)
    link = os.path.join(same_host.DIRECTORY, f"{same_host.PREFIX}{os.getpid()}-link-{os.urandom(4).hex()}")
    os.symlink(made.message.path, link)
    try:
        outside = tmp_path / "psframe-x"
        outside.write_bytes(bytes(made.message.size))
        bad = {
            "wrong key": _named(made, key=bytes(16)),
            "short key": _named(made, key=b"k"),
            "wrong size": _named(made, size=made.message.size + 8),
            "parts past the end": _named(made, reply_start=made.message.size + 1),
            "outside /dev/shm": _named(made, path=str(outside)),
            "not a psframe file": _named(made, path=os.path.join(same_host.DIRECTORY, "other")),
            "a symlink": _named(made, path=link),
            "gone": _named(made, path=made.message.path + "-gone"),
            "climbing out": _named(made, path=os.path.join(same_host.DIRECTORY, "psframe-../../etc/passwd")),
        }
        for why, message in bad.items():
            with pytest.raises(SharedRegionError):
                SameHostRegion.attach(message)
                pytest.fail(why)
    finally:
        os.unlink(link)
        made.unlink()


# ---- a worker's prepared requests against a ps service, no network


def _grads(step: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.full_like(VALUES[name], 0.5 * step + i)) for i, name in enumerate(("w", "b"))]


def _header(worker: int = 0) -> pb.PushPullHeader:
    caller = pb.Caller(job_name="worker", task_index=worker, cluster_fingerprint=CLUSTER.fingerprint)
    return pb.PushPullHeader(caller=caller, pull=["w", "b", "n"], end_of_step=True)


def _train(service: ParameterServerService, prepared: PreparedRequest, steps: range, plans: StreamCache):
    replies, sizes = [], []
    for step in steps:
        data = prepared.encode(step, _grads(step))
        sizes.append(encoding.parse(data, pb.PushPullHeader).payload_length)
        header, tensors = prepared.decode(service.push_pulls.reply(data, plans))
        replies.append((header.global_step, header.in_region, [t.clone() for t in tensors]))
    return replies, sizes


def test_requests_through_a_region_give_what_messages_give():
    through_region, in_messages = _service(), _service()
    shared, plain = PreparedRequest(_header(), share=True), PreparedRequest(_header())
    region_replies, sizes = _train(through_region, shared, range(6), StreamCache())
    message_replies, _ = _train(in_messages, plain, range(6), StreamCache())
    # The second request offers the region (tensors still in the message), the ps answers in it.
    assert [s for _, s, _ in region_replies] == [False, True, True, True, True, True]
    assert sizes[2:] == [0] * 4 and min(sizes[:2]) > 0  # then the requests carry the header only
    for (step_a, _, a), (step_b, _, b) in zip(region_replies, message_replies):
        assert step_a == step_b and all(torch.equal(x, y) for x, y in zip(a, b))
    a, b = _variables(through_region), _variables(in_messages)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert shared.in_region and not os.path.exists(shared.header.same_host.path)  # unlinked once accepted
    shared.drop_region()


def test_a_region_the_ps_cannot_map_is_refused_and_the_worker_goes_back_to_messages():
    service, reference = _service(), _service()
    prepared = PreparedRequest(_header(), share=True)
    _train(service, prepared, range(2), StreamCache())  # the second request offers a region
    _train(reference, PreparedRequest(_header()), range(2), StreamCache())
    assert prepared.in_region
    # A new stream (the ps task was replaced, or another of its processes answers):
    # the file is gone, so a request whose tensors lie in it is refused, nothing applied.
    before = _variables(service)
    data = prepared.encode(2, _grads(2))
    header, _ = prepared.decode(service.push_pulls.reply(data, StreamCache()))
    assert "cannot be" in header.region_unusable and not header.error_class and not header.tensors
    after = _variables(service)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The worker sends the tensors in the message instead, and offers a new region.
    prepared.drop_region()
    replies, _sizes = _train(service, prepared, range(2, 4), StreamCache())
    reference_replies, _ = _train(reference, PreparedRequest(_header()), range(2, 4), StreamCache())
    assert [s for _, s, _ in replies] == [False, True]  # a message, then an offer taken
    for (_, _, a), (_, _, b) in zip(replies, reference_replies):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    prepared.drop_region()


def test_an_offer_the_ps_cannot_map_is_answered_in_the_message_and_refused():
    service, reference = _service(), _service()
    data = PreparedRequest(_header()).encode(0, _grads(0))
    envelope = encoding.parse(data, pb.PushPullHeader)
    header = envelope.header
    header.same_host.CopyFrom(
        pb.SameHostRegion(
            path="/dev/shm/psframe-on-another-host",
            key=bytes(16),
            size=4096,
            request_start=64,
            request_length=0,
            reply_start=64,
        )
    )
    offer = codec.encode(header, list(zip([m.name for m in header.tensors], encoding.tensors_of(envelope))))
    reply_header, values = codec.decode(service.push_pulls.reply(offer, StreamCache()), pb.PushPullReplyHeader)
    assert "cannot be opened" in reply_header.region_refused and not reply_header.in_region
    expected_header, expected = codec.decode(reference.push_pulls.reply(data, StreamCache()), pb.PushPullReplyHeader)
    assert reply_header.global_step == expected_header.global_step
    assert all(torch.equal(a, b) for a, b in zip(values, expected))
    prepared = PreparedRequest(_header(), share=True)
    prepared.encode(0, _grads(0))
    prepared.decode(service.push_pulls.reply(offer, StreamCache()))
    assert not prepared.share  # it offers no more


# ---- a trainer and an in-process ps task


def test_a_sync_member_whose_region_cannot_be_mapped_is_told_so_and_stops_offering():
    """A sync worker on another host offers a region the ps cannot open: the round's
    reply comes in the message and says why, and the worker offers no more."""
    import threading

    from tests.service.test_sync import _sync_service

    service, push, decoded = _sync_service()
    caller = pb.Caller(job_name="worker", task_index=1, cluster_fingerprint=service.cluster.fingerprint)
    header = pb.PushPullHeader(caller=caller, step=0, pull=["w", "b"], end_of_step=True)
    header.same_host.CopyFrom(
        pb.SameHostRegion(
            path="/dev/shm/psframe-on-another-host",
            key=bytes(16),
            size=4096,
            request_start=64,
            request_length=0,
            reply_start=64,
        )
    )
    offer = codec.encode(header, [("w", torch.full((3,), 2.0)), ("b", torch.full((2,), 2.0))])
    replies = {}
    member = threading.Thread(target=lambda: replies.update(first=push(0, 0, 4.0)), daemon=True)
    member.start()
    replies["offer"] = service.push_pulls.reply(offer, StreamCache())
    member.join(30)
    assert not member.is_alive()
    refused, values = decoded(replies["offer"])
    assert "cannot be opened" in refused.region_refused and not refused.in_region and refused.global_step == 1
    assert torch.equal(values[0], torch.full((3,), -3.0))  # 0 - 1.0 x mean(4, 2)
    other, _ = decoded(replies["first"])
    assert not other.region_refused  # the member on this host is told nothing of it
    prepared = PreparedRequest(pb.PushPullHeader(caller=caller, pull=["w", "b"], end_of_step=True), share=True)
    prepared.encode(0, [("w", torch.zeros(3)), ("b", torch.zeros(2))])
    prepared.decode(replies["offer"])
    assert not prepared.share
