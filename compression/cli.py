"""What every ``python -m`` command of prefixrec shares: one error path, one exit-code
convention, the input checks, and quiet framework start-up. The output policy the commands
follow (:func:`check_output`, :class:`StagedOutput`, :func:`replace_directory`) lives in
:mod:`compression.outputs` and its errors in :mod:`compression.errors`, below this command
face; both are reachable from here too.

Framework-free (standard library and pyarrow only), so the Beam jobs, the trainer commands and
the in-process compression commands all use the same code::

    def main(argv=None) -> int:
        return cli.run_command(PROG, _main, argv)

Exit codes (``EXIT_CODES``, shown in every command's ``--help``):

- 0: done.
- 1: a failure while running that is not the input's fault (an I/O error writing, a worker
  that broke, a bug).
- 2: a usage or input error: a flag, the schema, the config, an input that is missing, empty
  or unreadable, bad rows past the limit, an output directory that is not empty. Checked
  before any work starts wherever the command can.
- 130 / 143: stopped by SIGINT (Ctrl-C) / SIGTERM.

Errors print one line, ``<prog>: error: <message>`` (argparse's own form); ``--debug`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import logging
import os
import signal
import sys
import threading
import traceback

import pyarrow as pa
import pyarrow.parquet as pq

from compression import fs
# The output policy and the usage errors live below the command face (the trainer's core and
# the storage layer use them too); a command reaches them here as well.
from compression.errors import OutputExistsError, UsageError  # noqa: F401
from compression.outputs import StagedOutput, check_output, replace_directory  # noqa: F401

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

def _exit_codes(on_signal: str) -> str:
    return ("exit status: 0 done; 2 usage or input error (a flag, the schema or config, an "
            "input that is missing, empty or unreadable, an output directory that is not "
            "empty), checked before work starts where possible; 1 failure while running "
            f"(I/O, a worker, a bug); {on_signal}. Errors print one line; --debug adds the "
            "traceback.")


EXIT_CODES = _exit_codes("130 interrupted (Ctrl-C), 143 terminated (SIGTERM)")
# A service that stops cleanly on a signal (trainer.online, the local broker) exits 0 then.
SERVICE_EXIT_CODES = _exit_codes("0 also after SIGINT or SIGTERM, which stop it cleanly")


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (raised by :func:`run_command`'s handler, so cleanup code runs)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def epilog(*examples: str, notes: str = "", exit_codes: str = EXIT_CODES) -> str:
    """A ``--help`` epilog: examples, notes, then the exit codes (use with
    ``argparse.RawDescriptionHelpFormatter``)."""
    parts = []
    if examples:
        parts.append("examples:\n" + "\n".join(f"  {e}" for e in examples))
    if notes:
        parts.append(_wrap(notes))
    parts.append(_wrap(exit_codes))
    return "\n\n".join(parts)


def _wrap(text: str, width: int = 78) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on an error, also print the traceback")


def add_overwrite_flag(parser: argparse.ArgumentParser, what: str = "the output directory"
                       ) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace {what} whole if it is not empty (without it a "
                             "non-empty directory is refused)")


# -- one error path -------------------------------------------------------------------------

def describe_error(error: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that ended a command."""
    if isinstance(error, FileNotFoundError):
        if error.filename is not None:
            return EXIT_USAGE, f"{error.filename}: no such file or directory"
        return EXIT_USAGE, _text(error)
    if isinstance(error, pa.ArrowException) and not isinstance(error, OSError):
        return EXIT_USAGE, f"cannot read the input: {_text(error)}"
    if isinstance(error, ValueError):  # SchemaError, ConfigError, RawDataError, UsageError, ...
        return EXIT_USAGE, _text(error)
    if isinstance(error, OSError):
        if error.filename is not None and error.strerror:
            return EXIT_FAILURE, f"{error.filename}: {error.strerror}"
        return EXIT_FAILURE, _text(error)
    if isinstance(error, MemoryError):
        return EXIT_FAILURE, "out of memory"
    return EXIT_FAILURE, (f"{type(error).__name__}: {_text(error)} (unexpected; rerun with "
                          "--debug for the traceback)")


def _text(error: BaseException) -> str:
    text = str(error).strip()
    return text or type(error).__name__


def run_command(prog: str, body, argv=None, service: bool = False) -> int:
    """Run ``body(argv)`` (returns an exit code or None) under the shared error path.

    SIGTERM unwinds like Ctrl-C (SIGINT) from the start, before the arguments are parsed: the
    command ends with 143 (130), its temporary outputs removed on the way out, unless it
    handles the signal itself by then (a training run finishing its step). ``service``: a
    command that a signal stops cleanly (:data:`SERVICE_EXIT_CODES`) exits 0 then, also when
    the signal comes before its own handling is in place (during start-up)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    previous = None
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return body(argv) or EXIT_OK
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        terminated = isinstance(e, Terminated)
        if service:
            print(f"{prog}: stopped by {'SIGTERM' if terminated else 'SIGINT'}",
                  file=sys.stderr, flush=True)
            return EXIT_OK
        print(f"{prog}: {'terminated' if terminated else 'interrupted'}",
              file=sys.stderr, flush=True)
        return EXIT_SIGTERM if terminated else EXIT_SIGINT
    except Exception as e:  # noqa: BLE001 - the one place errors become messages
        code, message = describe_error(e)
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# -- inputs ---------------------------------------------------------------------------------

def input_rows(path: str, format: str | None = None) -> int:
    """Rows of one input file: exact for Parquet (from the footer), 0 or 1 ("some") for CSV and
    JSON lines. Raises :class:`compression.RawDataError` naming the file when it cannot be
    read."""
    from compression.io import raw_format
    from compression.validate import RawDataError

    fmt = raw_format(path, format) if format or not path.endswith((".parquet", ".pq")) \
        else "parquet"
    if fmt == "parquet":
        try:
            with fs.source(path) as source:
                return pq.ParquetFile(source).metadata.num_rows
        except (pa.ArrowException, OSError) as e:  # e.g. "Parquet file size is 0 bytes"
            raise RawDataError(f"{path}: cannot read the file as parquet: {_text(e)}") from None
    if not fs.is_local(path):
        return _remote_text_rows(path, fmt)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", errors="replace") as f:
            lines = (line for line in f if line.strip())
            if fmt == "csv":
                next(lines, None)  # the header
            return 1 if next(lines, None) is not None else 0
    except OSError as e:
        raise RawDataError(f"{path}: cannot read the file as {fmt}: "
                           f"{e.strerror or _text(e)}") from None


def _remote_text_rows(path: str, fmt: str) -> int:
    """:func:`input_rows` of a CSV or JSON-lines file on an object store (its first 1 MiB)."""
    from compression.validate import RawDataError

    try:
        with fs.open_input_stream(path) as f:
            head = f.read(1 << 20).decode("utf-8", "replace")
    except (pa.ArrowException, OSError) as e:
        raise RawDataError(f"{path}: cannot read the file as {fmt}: {_text(e)}") from None
    lines = [line for line in head.splitlines() if line.strip()]
    return 1 if len(lines) > (1 if fmt == "csv" else 0) else 0


def check_inputs(path_or_glob, flag: str, format: str | None = None) -> list[str]:
    """The files an input flag names, each readable, together holding at least one row;
    otherwise :class:`UsageError` (before any work starts)."""
    from compression.io import expand_paths

    patterns = path_or_glob if isinstance(path_or_glob, (list, tuple)) else [path_or_glob]
    files = []
    for pattern in patterns:
        try:
            files += expand_paths(pattern)
        except FileNotFoundError as e:
            raise UsageError(f"{flag}: {_text(e)}") from None
    rows = 0
    for path in files:
        rows += input_rows(path, format)
    if rows == 0:
        shown = ", ".join(repr(p) for p in patterns)
        raise UsageError(f"{flag} {shown}: the {len(files)} input file(s) hold no samples; "
                         "nothing to do")
    return files


# -- quiet start-up -------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_stderr():
    """Send file descriptor 2 to /dev/null for the block: for native libraries that log to
    stderr before any setting can reach them (TensorFlow's absl start-up lines). Python
    exceptions raised in the block still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self._prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self._prefixes)


def drop_log_messages(*prefixes: str, logger: str = "") -> None:
    """Drop records of ``logger`` (default the root) whose message starts with a prefix."""
    logging.getLogger(logger).addFilter(_DropMessages(prefixes))


class _NoTracebacks(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self._prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(self._prefix) and record.exc_info
                    and record.levelno >= logging.ERROR)


def hide_logged_tracebacks(logger_prefix: str) -> None:
    """On the root logger's handlers, drop error records with a traceback from loggers under
    ``logger_prefix`` (a framework that logs a worker's exception before re-raising it: the
    command reports that error once, through :func:`run_command`). Call after configuring
    logging; skip it under ``--debug``."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NoTracebacks(logger_prefix))
