"""The small two-layer stream the online, serving and crash-point tests train on: one user per
``sid % 37``, one sample per ``sid`` (so a sample's row counts how often it was trained)."""

import json

SCHEMA = {"name": "online_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]}
CONFIG = {"batch_size": 100, "seed": 7, "threads": 1,
          "embedding": {"dim": 2, "optimizer": {"name": "adagrad", "lr": 0.3}}}
PROBE = [{"uid": u, "sid": 30 * u + 1} for u in range(20)]  # samples to score


def sample_value(sid: int) -> dict:
    return {"uid": sid % 37, "sid": sid, "click": float(sid % 3 == 0)}


def sample_message(sid: int) -> tuple[bytes, bytes]:
    """(key, value) of sample ``sid`` as a Kafka message: keyed by user, JSON."""
    return str(sid % 37).encode(), json.dumps(sample_value(sid)).encode()


def committed_offset(broker, topic: str, group: str) -> int | None:
    """The offset ``group`` has committed for partition 0 of ``topic`` (None: none yet)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    try:
        offset = consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
    finally:
        consumer.close()
    return offset if offset >= 0 else None
