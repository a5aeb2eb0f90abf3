"""Kafka clients of prefixrec: settings with production defaults, ``-X`` options, logging and a
reachability check, for the Beam jobs and the online trainer alike.

    settings = kafka.consumer_settings("broker:9092", "ctr-online", options)
    consumer = kafka.consumer(settings)       # librdkafka's log lines go to logging, rate-limited
    kafka.check_reachable(settings, timeout=30)   # or BrokerUnreachable naming the servers

The only module of the project that imports ``confluent_kafka``: swapping the client touches this
file. Settings are plain dicts (Beam pickles them into its DoFns; Java KafkaIO takes them as
strings); the logger is added only when a client is built.

Settings, lowest precedence first: the defaults below, what the calling code needs
(``overrides``), then the user's, from the environment variable ``PREFIXREC_KAFKA_OPTIONS``
(``key=value`` pairs separated by spaces, for every client of every command; the test suite sets
its test-broker settings there) and from ``-X key=value`` (``-X kafka.key=value`` too). A
consumer-only setting is not given to producers, nor a producer-only one to consumers, so one
``-X`` list serves a command's consumer and its producers without librdkafka warnings.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import Iterable

from confluent_kafka import (OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer,
                             TopicPartition)
from confluent_kafka.admin import AdminClient

__all__ = [
    "OFFSET_BEGINNING", "Consumer", "KafkaError", "KafkaException", "Producer", "TopicPartition",
    "BrokerUnreachable", "KafkaOptionError", "DEFAULT_BROKER_TIMEOUT", "ENV_OPTIONS",
    "add_options", "admin", "check_reachable", "consumer", "consumer_settings", "parse_option",
    "parse_options", "producer", "producer_settings",
]

log = logging.getLogger("kafka")

ENV_OPTIONS = "PREFIXREC_KAFKA_OPTIONS"
DEFAULT_BROKER_TIMEOUT = 30.0

# Production defaults. Offsets are committed by the code, after its output is durable, never
# automatically; a new group starts at the beginning of the topic (nothing is skipped); the
# group session keeps librdkafka's default (45 s), so a slow step or a short network hiccup
# does not move partitions around. Producers are idempotent and wait for all replicas.
CONSUMER_DEFAULTS = {"enable.auto.commit": False, "enable.auto.offset.store": False,
                     "auto.offset.reset": "earliest", "enable.partition.eof": False}
PRODUCER_DEFAULTS = {"enable.idempotence": True, "acks": "all", "linger.ms": 20}

# Settings that librdkafka only knows for one kind of client (it warns about them on the other).
_CONSUMER_ONLY = ("group.", "session.timeout.ms", "heartbeat.interval.ms",
                  "max.poll.interval.ms", "auto.offset.reset", "enable.auto.commit",
                  "auto.commit.interval.ms", "enable.auto.offset.store", "enable.partition.eof",
                  "fetch.", "isolation.level", "partition.assignment.strategy", "check.crcs",
                  "queued.", "coordinator.query.interval.ms", "consume.callback.max.messages")
_PRODUCER_ONLY = ("linger.ms", "acks", "request.required.acks", "enable.idempotence",
                  "compression.", "batch.", "queue.buffering.", "message.send.max.retries",
                  "retries", "transactional.id", "transaction.timeout.ms", "delivery.timeout.ms",
                  "message.timeout.ms", "partitioner", "sticky.partitioning.linger.ms",
                  "enable.gapless.guarantee", "request.timeout.ms")


class KafkaOptionError(argparse.ArgumentTypeError, ValueError):
    """A malformed ``-X`` option (argparse reports it as a usage error, exit code 2)."""


class BrokerUnreachable(ConnectionError):
    """No broker of ``bootstrap.servers`` answered in time (a failure, exit code 1)."""


# -- options --------------------------------------------------------------------------------

def parse_option(text: str) -> tuple[str, str]:
    """``key=value`` or ``kafka.key=value`` -> ``(key, value)``; the value may hold ``=``."""
    key, sep, value = text.partition("=")
    key = key.strip().removeprefix("kafka.")
    if not sep or not key:
        raise KafkaOptionError(f"-X {text!r}: expected key=value (or kafka.key=value), e.g. "
                               "-X security.protocol=SASL_SSL")
    return key, value


def parse_options(items: Iterable[str] | None) -> dict:
    """Several ``-X`` options as a settings dict (a later key wins)."""
    return dict(parse_option(item) for item in items or ())


def _env_options() -> dict:
    text = os.environ.get(ENV_OPTIONS, "")
    try:
        return parse_options(text.split())
    except KafkaOptionError as e:
        raise KafkaOptionError(f"{ENV_OPTIONS}: {e}") from None


def add_options(parser: argparse.ArgumentParser, clients: str = "consumer and producers",
                ) -> None:
    """Add ``-X KEY=VALUE`` (``args.kafka_options``, a list of pairs) and ``--broker-timeout``
    to a command's parser."""
    parser.add_argument(
        "-X", dest="kafka_options", action="append", type=parse_option, default=[],
        metavar="KEY=VALUE",
        help=f"librdkafka setting for the {clients} (repeatable; a kafka. prefix is allowed), "
             f"e.g. -X security.protocol=SASL_SSL; also read from ${ENV_OPTIONS} "
             "(space-separated KEY=VALUE pairs)")
    parser.add_argument(
        "--broker-timeout", type=float, default=DEFAULT_BROKER_TIMEOUT, metavar="SECONDS",
        help="give up with an error when no broker answers within this long at start "
             f"(default {DEFAULT_BROKER_TIMEOUT:g})")


# -- settings -------------------------------------------------------------------------------

def _user(options: dict | None, drop: tuple[str, ...]) -> dict:
    user = {**_env_options(), **(options or {})}
    return {k: v for k, v in user.items() if not k.startswith(drop)}


def consumer_settings(bootstrap_servers: str, group_id: str, options: dict | None = None,
                      **overrides) -> dict:
    """Settings of a consumer in group ``group_id``: defaults < ``overrides`` (keyword names
    with ``_`` for ``.``, or a dict as ``overrides={...}``) < the user's options."""
    extra = overrides.pop("overrides", {})
    return {"bootstrap.servers": bootstrap_servers, "group.id": group_id, **CONSUMER_DEFAULTS,
            **{k.replace("_", "."): v for k, v in overrides.items()}, **extra,
            **_user(options, _PRODUCER_ONLY)}


def producer_settings(bootstrap_servers: str, options: dict | None = None, **overrides) -> dict:
    """Settings of a producer: defaults < ``overrides`` < the user's options."""
    extra = overrides.pop("overrides", {})
    return {"bootstrap.servers": bootstrap_servers, **PRODUCER_DEFAULTS,
            **{k.replace("_", "."): v for k, v in overrides.items()}, **extra,
            **_user(options, _CONSUMER_ONLY)}


def for_java(settings: dict) -> dict:
    """Settings as Beam's Java KafkaIO takes them (strings; callbacks dropped)."""
    return {k: str(v) for k, v in settings.items() if not callable(v)}


# -- clients --------------------------------------------------------------------------------

class RateLimitedLog:
    """librdkafka's log lines, to the ``kafka`` logger: at most ``burst`` lines of one kind
    (facility and level) every ``period`` seconds, then one line saying how many were dropped.

    A broker that is down makes librdkafka log a line per connection attempt and client (several
    a second); a handful says the same."""

    def __init__(self, logger: logging.Logger = log, burst: int = 3, period: float = 60.0):
        self._logger = logger
        self._burst = burst
        self._period = period
        self._lock = threading.Lock()
        self._kinds: dict = {}  # (level, facility) -> [window start, lines in it, dropped]

    def log(self, level: int, fmt: str, *args) -> None:
        facility = args[0] if args else ""
        now = time.monotonic()
        with self._lock:
            state = self._kinds.setdefault((level, facility), [now, 0, 0])
            if now - state[0] >= self._period:
                dropped = state[2]
                state[:] = [now, 0, 0]
                if dropped:
                    self._logger.log(min(level, logging.WARNING),
                                     "kafka: %d more %s line(s) in the last %.0f s not shown",
                                     dropped, facility, self._period)
            if state[1] >= self._burst:
                state[2] += 1
                return
            state[1] += 1
        # librdkafka retries what it logs as errors (a refused connection); the command decides
        # what is fatal, so these are warnings at most.
        self._logger.log(min(level, logging.WARNING), "kafka " + fmt, *args)

    def __reduce__(self):  # a client's settings may be pickled (Beam); the limit is per process
        return _shared_log, ()


_SHARED = RateLimitedLog()


def _shared_log() -> RateLimitedLog:
    return _SHARED


def _with_logger(settings: dict) -> dict:
    return {**settings, "logger": settings.get("logger", _SHARED)}


def consumer(settings: dict) -> Consumer:
    """A consumer of ``settings`` whose log lines go to Python logging (rate-limited)."""
    return Consumer(_with_logger(settings))


def producer(settings: dict) -> Producer:
    """A producer of ``settings`` whose log lines go to Python logging (rate-limited)."""
    return Producer(_with_logger(settings))


class _DebugLog:
    """librdkafka's log lines at DEBUG: for a check that reports the failure itself."""

    def log(self, level: int, fmt: str, *args) -> None:
        log.debug("kafka " + fmt, *args)


def admin(settings: dict, quiet: bool = False) -> AdminClient:
    """An admin client on the brokers of ``settings`` (security settings kept)."""
    keep = {k: v for k, v in settings.items()
            if not k.startswith(_CONSUMER_ONLY + _PRODUCER_ONLY) and not callable(v)}
    keep["logger"] = _DebugLog() if quiet else settings.get("logger", _SHARED)
    return AdminClient(keep)


def check_reachable(settings: dict, timeout: float = DEFAULT_BROKER_TIMEOUT,
                    option: str = "--broker-timeout") -> None:
    """Return once a broker of ``settings['bootstrap.servers']`` answers a metadata request;
    raise :class:`BrokerUnreachable` after ``timeout`` seconds without an answer."""
    servers = settings.get("bootstrap.servers")
    client = admin(settings, quiet=True)  # its connection failures are the error raised here
    try:
        client.list_topics(timeout=timeout)
    except KafkaException as e:
        error = e.args[0] if e.args else e
        reason = error.str() if isinstance(error, KafkaError) else str(error)
        raise BrokerUnreachable(
            f"no Kafka broker at {servers} answered within {timeout:g} s ({reason}); check "
            f"--bootstrap-servers and that the broker is up, or wait longer with {option} "
            "SECONDS") from None


def list_partitions(settings: dict, topic: str, timeout: float = 30.0) -> list[int]:
    """The partition numbers of ``topic``; raises ``ValueError`` naming the topic if missing."""
    client = admin(settings)
    try:
        metadata = client.list_topics(topic, timeout=timeout).topics.get(topic)
    except KafkaException as e:
        raise BrokerUnreachable(f"topic {topic!r} on {settings.get('bootstrap.servers')}: no "
                                f"metadata within {timeout:g} s ({e})") from None
    if metadata is None or metadata.error is not None or not metadata.partitions:
        reason = metadata.error if metadata is not None else "no metadata"
        raise ValueError(f"topic {topic!r} on {settings.get('bootstrap.servers')}: cannot read "
                         f"its partitions ({reason}); create the topic first")
    return sorted(metadata.partitions)
