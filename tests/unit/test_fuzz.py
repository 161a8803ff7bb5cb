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

This file holds the unit tier's tests of the subject; `tests/service/test_fuzz.py` holds the other
tiers'.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from psframe.errors import WireFormatError
from psframe.wire import dtypes
from psframe.wire import psframe_pb2 as pb
from psframe.wire.transport import limits
from tests.service.test_fuzz import PROPERTY, check_decoded, meta_envelope, metas


def test_peer_hosts():
    assert limits.peer_host("ipv4:10.0.0.5:41234") == "ipv4:10.0.0.5"
    assert limits.peer_host("ipv6:[::1]:41234") == "ipv6:[::1]"
    assert limits.peer_host("unix:/tmp/x.sock") == limits.peer_host("unix:") == "unix"


@PROPERTY
@given(st.binary(max_size=300))
def test_decode_of_arbitrary_bytes_refuses_or_is_consistent(data):
    check_decoded(data)


@PROPERTY
@given(st.lists(metas(), max_size=4), st.binary(max_size=96), st.integers(0, 2))
def test_decode_of_arbitrary_envelopes_refuses_or_is_consistent(tensors, payload, cut):
    data = meta_envelope(pb.PushPullHeader(), tensors, payload)
    check_decoded(data)
    check_decoded(data[: len(data) - cut])  # cut short


def test_check_shape_names_what_was_expected():
    assert dtypes.check_shape("t", (0, 2**31)) == 0
    assert dtypes.check_shape("t", (2, 3)) == 6
    for shape, expected in [
        ((1,) * 65, "at most 64"),
        ((-1, 2), "dimensions >= 0"),
        ((0, 2**31 + 1), "more than 2147483648 elements"),
    ]:
        with pytest.raises(WireFormatError, match=expected):
            dtypes.check_shape("t", shape)
