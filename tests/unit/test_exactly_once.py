"""A push is applied exactly once: sent again after a lost reply, it is answered, not applied twice.

Units (no network): the ledger, the ps service's answers to a push sent
again (asynchronous, on both its paths, and synchronous), the in-order rule
for pushes refused for their shared region, the worker's numbering, the
ledger in a checkpoint. Then a real worker and ps task with a TCP proxy
between them that swallows the replies of a step and then drops the
connection: the worker reconnects, sends the step again, and the oracle is
exact (SGD with a known gradient) with the ps's count of applied steps equal
to the worker's acknowledged steps.

This file holds the unit tier's tests of the subject; `tests/service/test_exactly_once.py`,
`tests/cluster/test_exactly_once.py` hold the other tiers'.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

import psframe
from psframe.cluster import ClusterSpec
from psframe.errors import SharedRegionError
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.service import ParameterServerService
from psframe.ps.service.push_pull_handler import StreamCache
from psframe.wire import codec, encoding
from psframe.wire import psframe_pb2 as pb
from psframe.worker.client.streams import PushNumbers
from psframe.worker.hooks import Hook

CLUSTER = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})


def _push(step: int, push_id: int, value: float, *, worker: int = 0, end_of_step: bool = True) -> bytes:
    caller = pb.Caller(job_name="worker", task_index=worker, cluster_fingerprint=CLUSTER.fingerprint)
    header = pb.PushPullHeader(caller=caller, step=step, pull=["w"], end_of_step=end_of_step, push_id=push_id)
    return codec.encode(header, [("w", torch.full((4,), value))])


def _answer(service: ParameterServerService, data: bytes, plans: StreamCache | None = None):
    return codec.decode(service.push_pulls.reply(data, plans), pb.PushPullReplyHeader)


def _async_service() -> ParameterServerService:
    service = ParameterServerService(CLUSTER, 0)
    service.store.create({"w": torch.zeros(4)}, psframe.optim.SGD(lr=0.5))
    return service


def test_the_ledger_applies_each_number_once_and_counts_steps():
    ledger = PushLedger(2)
    assert not ledger.is_duplicate(0, 1)
    ledger.record(0, 1, ends_step=False)
    ledger.record(0, 2, ends_step=True)
    assert ledger.is_duplicate(0, 1) and ledger.is_duplicate(0, 2) and not ledger.is_duplicate(0, 3)
    assert not ledger.is_duplicate(1, 1)  # each worker numbers its own pushes
    assert not ledger.is_duplicate(0, 0)  # unnumbered: always new
    assert (ledger.last_push(0), ledger.applied_steps(0)) == (2, 1)
    restored = PushLedger(3)
    restored.load_state_dict(ledger.state_dict())
    assert restored.state_dict() == {"last_push": [2, 0, 0], "applied_steps": [1, 0, 0]}


@pytest.mark.parametrize("planned", [False, True], ids=["general", "fast path"])
def test_an_async_push_sent_again_is_answered_not_applied_twice(planned):
    service = _async_service()
    plans = StreamCache() if planned else None
    for push_id in (1, 2):  # the second of a kind takes the fast path, when planned
        header, _ = _answer(service, _push(push_id - 1, push_id, 1.0), plans)
        assert not header.duplicate and not header.error_class
    again, (w,) = _answer(service, _push(1, 2, 1.0), plans)  # push 2, its reply lost, sent again
    assert again.duplicate and not again.error_class and again.global_step == 2
    assert w.tolist() == [-1.0] * 4  # 0 - 0.5 * 1 - 0.5 * 1: two pushes applied, not three
    assert service.store.global_step == 2 and service.store.pushes == 2
    info = service.info()
    assert (info.workers[0].applied_steps, info.workers[0].last_push_id) == (2, 2)
    header, (w,) = _answer(service, _push(2, 3, 1.0), plans)  # the next push is applied
    assert not header.duplicate and w.tolist() == [-1.5] * 4


def test_a_bad_push_sent_again_is_still_refused():
    service = _async_service()
    _answer(service, _push(0, 1, 1.0))
    caller = pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=CLUSTER.fingerprint)
    header = pb.PushPullHeader(caller=caller, step=1, pull=["w"], end_of_step=True, push_id=1)
    reply, _ = _answer(service, codec.encode(header, [("w", torch.ones(5))]))
    assert reply.error_class == "ShapeMismatchError"


def test_a_sync_push_sent_again_after_its_round_is_answered_as_applied():
    service = ParameterServerService(CLUSTER, 0)
    service.store.create({"w": torch.zeros(4)}, psframe.optim.SGD(lr=1.0))
    service._start_sync(pb.SyncDef(replicas_to_aggregate=1, total_num_replicas=2, timeout_seconds=30.0))
    first, (w,) = _answer(service, _push(0, 1, 2.0))
    assert not first.dropped and first.global_step == 1 and w.tolist() == [-2.0] * 4
    again, (w,) = _answer(service, _push(0, 1, 2.0))  # its reply was lost: sent again
    assert not again.dropped and w.tolist() == [-2.0] * 4
    stale, _ = _answer(service, _push(0, 2, 2.0))  # a new push of an old step is stale
    assert stale.dropped
    assert service.aggregator.dropped_gradients == 1
    assert service.info().workers[0].applied_steps == 1


def test_pushes_after_one_refused_for_its_region_wait_for_it():
    plans = StreamCache()
    region = pb.SameHostRegion(path="/dev/shm/psframe-missing-region", key=b"k", size=64, in_region=True)
    caller = pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=CLUSTER.fingerprint)
    refused = encoding.parse(
        codec.encode(pb.PushPullHeader(caller=caller, push_id=5, same_host=region), []), pb.PushPullHeader
    )
    with pytest.raises(SharedRegionError):
        plans.open_region(refused)
    with pytest.raises(SharedRegionError, match="push 6 follows push 5"):
        plans.check_order(6)  # sent behind it: refused, to come again after it
    plans.check_order(5)  # push 5 again (in its message)
    plans.check_order(6)  # then the rest, in order


def test_pushes_are_numbered_in_order_and_numbered_alike_when_sent_again():
    numbers = PushNumbers(2)
    step = [0, 0, None, 1, 0]  # ps task of each message; None: it pushes nothing
    assert numbers.assign(step) == [1, 2, 0, 1, 3]
    assert numbers.assign(step, again=True) == [1, 2, 0, 1, 3]
    assert numbers.assign([None, None]) == [0, 0]  # a pull takes none, and keeps the step's numbers
    assert numbers.assign(step, again=True) == [1, 2, 0, 1, 3]
    assert numbers.assign([0, 0]) == [4, 5]
    with pytest.raises(ValueError, match="sent again"):
        numbers.assign([0, 0, 0], again=True)
    numbers.start_after(1, 41)  # the task applied up to 41 (a run of this worker before this one)
    numbers.start_after(0, 2)  # below what is taken already: no change
    assert numbers.assign([0, 1]) == [6, 42]


def test_the_ledger_is_saved_and_restored_with_the_shard(url):
    service = _async_service()
    service._variable_defs = [
        pb.VariableDef(name="w", variable="w", dtype="float32", shape=[4], full_shape=[4], num_parts=1)
    ]
    for push_id in (1, 2, 3):
        _answer(service, _push(push_id - 1, push_id, 1.0))
    from psframe.checkpoint import files as checkpoint_io
    from psframe.checkpoint.manifest import ShardRecord

    tool = pb.Caller(job_name="tool", cluster_fingerprint=CLUSTER.fingerprint)
    shard = service.save_shard(pb.SaveShardRequest(caller=tool, checkpoint_dir=url, step=3))
    checkpoint_io.write_manifest(
        url,
        3,
        [
            ShardRecord(
                ps_task=0, file=shard.file, sha256=shard.sha256, nbytes=shard.nbytes, global_step=shard.global_step
            )
        ],
    )
    restarted = ParameterServerService(CLUSTER, 0, checkpoint_dir=url)
    assert restarted.store.ready
    assert restarted.ledger.state_dict() == {"last_push": [3, 0], "applied_steps": [3, 0]}
    again, (w,) = _answer(restarted, _push(2, 3, 1.0))  # applied before the checkpoint: a duplicate
    assert again.duplicate and w.tolist() == [-1.5] * 4


# ---- a real worker and ps task, with the replies of one step lost


class ReplySwallowingProxy:
    """Forwards TCP connections to ``target``; :meth:`lose_replies` throws away what the
    server sends from then on and, ``after`` seconds later, closes every connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._swallow = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=5.0)
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if replies and self._swallow.is_set():
                    continue
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.close()
            except OSError:
                pass

    def lose_replies(self, after: float) -> None:
        self._swallow.set()

        def cut() -> None:
            time.sleep(after)
            with self._lock:
                sockets, self._sockets = self._sockets, []
                self._swallow.clear()  # connections made from now on work
            for s in sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

        threading.Thread(target=cut, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()


class LoseRepliesAt(Hook):
    """Before the pushes of the given local steps are sent, lose their replies."""

    def __init__(self, proxy: ReplySwallowingProxy, local_steps: set[int]) -> None:
        self.proxy, self.local_steps = proxy, local_steps

    def before_push(self, trainer, loss) -> None:
        if trainer.stats.local_step in self.local_steps:
            self.proxy.lose_replies(after=0.5)
