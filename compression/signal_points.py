"""Signal points: named moments of a command's start-up at which a test makes the process signal
itself, so that what a signal at that moment does is tested without racing a sleep.

A test sets ``PREFIXREC_SIGNAL_AT=<point>`` (SIGTERM) or ``PREFIXREC_SIGNAL_AT=<point>:SIGINT``
in a child process; the first time the process reaches the point it sends itself that signal
(``os.kill``, as another process would) and goes on: whatever handler is in place at that
moment (the command's, or one a framework installed) decides what follows. Without the
variable a point costs one comparison. The variable is read once, at the first point.

The points, in the order ``trainer.train`` and ``trainer.online`` reach them (each reaches
those of its path only):

    ``args.parsed``        the arguments parsed
    ``config.loaded``      trainer.train: the schema, the config, every input and the run
                           directory checked; trainer.online: the schema and config loaded
                           (in one process: the model built or restored)
    ``tensorflow.loaded``  TensorFlow imported (trainer.online: before config.loaded)
    ``broker.reached``     trainer.online: the broker answered the start-up check
    ``source.opened``      trainer.online in one process: the Kafka consumer created (and the
                           metrics endpoint listening)
    ``ray.init.entered``   with --workers/--shards: ray.init about to start
    ``ray.init.returned``  ray.init returned, every handler it would set in place: the window
                           where Ray's own SIGTERM handling used to take over
    ``actors.created``     the shard and worker actors asked for, their processes starting
    ``actors.started``     every actor answered
    ``run.started``        the command's own stop handling in place, before the first step
"""

from __future__ import annotations

import os
import signal

ENV = "PREFIXREC_SIGNAL_AT"

POINTS = ("args.parsed", "config.loaded", "tensorflow.loaded", "broker.reached",
          "source.opened", "ray.init.entered", "ray.init.returned", "actors.created",
          "actors.started", "run.started")
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}

_wanted: tuple[str, signal.Signals] | None = None
_read = False


def parse(text: str) -> tuple[str, signal.Signals]:
    """``(point, signal)`` of ``point`` or ``point:SIGNAL``; ValueError naming the choices."""
    name, _, signame = text.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={text!r}: unknown signal point {name!r}; the points are "
                         f"{', '.join(POINTS)}")
    signame = signame or "SIGTERM"
    if signame not in SIGNALS:
        raise ValueError(f"{ENV}={text!r}: expected {name}:SIGTERM or {name}:SIGINT, got "
                         f"{signame!r}")
    return name, SIGNALS[signame]


def signal_point(name: str) -> None:
    """Send this process the signal ``PREFIXREC_SIGNAL_AT`` asks for at ``name``, the first
    time it is reached; otherwise return at once."""
    global _wanted, _read
    if not _read:
        text = os.environ.get(ENV)
        _wanted = parse(text) if text else None
        _read = True
    if _wanted is None or _wanted[0] != name:
        return
    signum = _wanted[1]
    _wanted = None  # once
    os.kill(os.getpid(), signum)
