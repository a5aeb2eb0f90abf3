"""compression.kafka: -X options, client settings and their defaults, librdkafka's logs through
Python logging (rate-limited), and the reachability check."""

import logging

import pytest

from compression import kafka


def test_x_options_with_and_without_the_kafka_prefix():
    assert kafka.parse_option("security.protocol=SASL_SSL") == ("security.protocol", "SASL_SSL")
    assert kafka.parse_option("kafka.security.protocol=SSL") == ("security.protocol", "SSL")
    assert kafka.parse_option("sasl.password=a=b=") == ("sasl.password", "a=b=")
    assert kafka.parse_option("client.id=") == ("client.id", "")
    assert kafka.parse_options(["linger.ms=1", "kafka.linger.ms=2"]) == {"linger.ms": "2"}


@pytest.mark.parametrize("text", ["linger.ms", "=5", "kafka.=5", ""])
def test_a_malformed_x_option_says_what_is_expected(text):
    with pytest.raises(kafka.KafkaOptionError) as error:
        kafka.parse_option(text)
    assert str(error.value) == (f"-X {text!r}: expected key=value (or kafka.key=value), e.g. "
                                "-X security.protocol=SASL_SSL")
    assert isinstance(error.value, ValueError)  # a usage error (exit code 2) for the commands


def test_settings_defaults_overrides_and_user_options(monkeypatch):
    monkeypatch.delenv(kafka.ENV_OPTIONS, raising=False)
    consumer = kafka.consumer_settings("b:9092", "g", {"auto.offset.reset": "latest",
                                                       "linger.ms": "5"},
                                       enable_partition_eof=True)
    assert consumer == {"bootstrap.servers": "b:9092", "group.id": "g",
                        "enable.auto.commit": False, "enable.auto.offset.store": False,
                        "auto.offset.reset": "latest", "enable.partition.eof": True}
    # production defaults: no test-broker group settings
    assert "session.timeout.ms" not in consumer and "heartbeat.interval.ms" not in consumer
    producer = kafka.producer_settings("b:9092", {"security.protocol": "SSL",
                                                  "session.timeout.ms": "6000"},
                                       overrides={"queue.buffering.max.messages": 10})
    assert producer == {"bootstrap.servers": "b:9092", "enable.idempotence": True,
                        "acks": "all", "linger.ms": 20, "queue.buffering.max.messages": 10,
                        "security.protocol": "SSL"}


def test_the_environment_gives_every_client_settings_and_x_wins(monkeypatch):
    monkeypatch.setenv(kafka.ENV_OPTIONS, "session.timeout.ms=6000 kafka.client.id=env")
    consumer = kafka.consumer_settings("b", "g", {"client.id": "x"})
    assert consumer["session.timeout.ms"] == "6000" and consumer["client.id"] == "x"
    assert "session.timeout.ms" not in kafka.producer_settings("b")
    monkeypatch.setenv(kafka.ENV_OPTIONS, "oops")
    with pytest.raises(kafka.KafkaOptionError, match=f"^{kafka.ENV_OPTIONS}: -X 'oops'"):
        kafka.producer_settings("b")


def test_java_settings_are_strings_without_callbacks():
    assert kafka.for_java({"a": 1, "b": True, "on_commit": print}) == {"a": "1", "b": "True"}


def test_librdkafka_lines_are_rate_limited(caplog):
    logger = logging.getLogger("kafka.test")
    limited = kafka.RateLimitedLog(logger, burst=3, period=3600)
    with caplog.at_level(logging.DEBUG, logger="kafka.test"):
        for _ in range(50):
            limited.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "refused")
        limited.log(logging.INFO, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "ignored")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == (
        [(logging.WARNING, "kafka FAIL [rdkafka#producer-1] refused")] * 3
        + [(logging.INFO, "kafka CONFWARN [rdkafka#producer-1] ignored")])


def test_a_client_of_a_down_broker_logs_a_few_lines_not_a_flood(caplog):
    producer = kafka.producer(kafka.producer_settings("127.0.0.1:1"))
    producer.produce("t", b"x")
    with caplog.at_level(logging.WARNING, logger="kafka"):
        producer.flush(2)  # librdkafka retries the connection many times meanwhile
    lines = [r.getMessage() for r in caplog.records if r.name == "kafka"]
    assert 1 <= len(lines) <= 3 and all("127.0.0.1:1" in line for line in lines)


def test_check_reachable(kafka_broker):
    kafka.check_reachable(kafka.consumer_settings(kafka_broker.bootstrap, "g"), timeout=10)
    with pytest.raises(kafka.BrokerUnreachable) as error:
        kafka.check_reachable({"bootstrap.servers": "127.0.0.1:1"}, timeout=1,
                              option="--wait")
    assert str(error.value).startswith("no Kafka broker at 127.0.0.1:1 answered within 1 s (")
    assert str(error.value).endswith("or wait longer with --wait SECONDS")
    assert isinstance(error.value, ConnectionError)  # a failure (exit code 1), not a usage error


def test_list_partitions(kafka_broker):
    topic = kafka_broker.create_topic(partitions=3)
    settings = kafka.consumer_settings(kafka_broker.bootstrap, "g")
    assert kafka.list_partitions(settings, topic) == [0, 1, 2]
