"""Streams of records a job trains on as they come: :class:`StreamSource` and its brokers.

A worker reads a stream with :meth:`psframe.Trainer.stream`; the ps tasks
share the stream's partitions out among the workers and commit each
partition's offset with the push that trained on its records, so that after
any worker or ps task is killed, or the ps tasks are re-laid, no record is
trained twice and none is lost (:mod:`psframe.ps.protocol.stream_partitions`)::

    from psframe.streams import JetStream

    events = JetStream("nats://broker:4222", "clicks", partitions=8)
    for records in trainer.stream(events, batch_size=512):
        trainer.step(loss_of(decode(records)))

Brokers: NATS JetStream (:class:`JetStream`, the ``stream`` extra). Kafka has
no adapter: none ships that is not tested against a real broker, and no Kafka
broker can be installed where psframe is tested. A source of another broker
is a class with :class:`StreamSource`'s ``name``, ``partitions``, ``read`` and ``close``.
"""

from psframe.streams.jetstream import JetStream  # imports nats-py only when one is made
from psframe.streams.source import StreamRecord, StreamSource

__all__ = ["JetStream", "StreamRecord", "StreamSource"]
