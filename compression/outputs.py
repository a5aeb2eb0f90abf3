"""The output policy every command and the trainer follow: an output directory appears whole
or not at all, and only where nothing would be lost.

- :func:`check_output`: refuse an output that is not an empty or missing directory (unless
  overwriting) and always one that holds the current directory or an input; checked before any
  work starts.
- :class:`StagedOutput`: write a directory through a temporary one beside it, put in place by
  one rename (on an object store, :class:`compression.fs.StagedObjectOutput`: a hidden
  generation published by its manifest).
- :func:`replace_directory`: put a complete directory in place of an old one, never leaving a
  half-written one.

Below the command face (:mod:`compression.cli` re-exports these names) and above the storage
layer (:mod:`compression.fs`); its errors come from :mod:`compression.errors`.
"""

from __future__ import annotations

import os
import shutil
import uuid

from compression import fs
from compression.errors import OutputExistsError, UsageError


def check_output(path: str, overwrite: bool, flag: str = "--output", inputs=()) -> None:
    """Refuse an output that is not an empty or missing directory, unless ``overwrite``; and
    always one that holds the current directory or one of the ``inputs`` (replacing it whole
    would delete them)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    real = os.path.realpath(path)
    for inner in (os.getcwd(), *inputs):
        inner = os.path.realpath(inner)
        if inner == real or inner.startswith(real.rstrip(os.sep) + os.sep):
            what = "the current directory" if inner == os.path.realpath(os.getcwd()) \
                else f"the input {inner}"
            raise UsageError(f"{flag} {path}: holds {what}, which writing the output there "
                             "would replace; choose another directory")
    if os.path.isdir(path) and not overwrite:
        entries = os.listdir(path)
        if entries:
            raise OutputExistsError(
                f"{flag} {path}: the directory is not empty ({len(entries)} entr"
                f"{'y' if len(entries) == 1 else 'ies'}); pass --overwrite to replace it "
                "whole, or choose another directory")


class StagedOutput:
    """An output directory written through a temporary directory next to it.

    On an object store (``s3://``, ``gs://``...), which cannot rename a directory,
    ``StagedOutput(uri)`` is a :class:`compression.fs.StagedObjectOutput`: the files go under
    a hidden unique prefix and a manifest written last publishes them.

    ``StagedOutput(path, overwrite)`` checks the policy (:func:`check_output`) and creates
    ``.<name>.tmp-XXXXXXXX`` in the same parent (same file system, so the final rename is
    atomic); write into ``.tmp``; :meth:`commit` renames it into place (replacing the old
    directory whole with ``overwrite``); :meth:`discard` (or leaving the ``with`` block with an
    exception) removes it, so a failed job leaves nothing that looks like output.
    """

    def __new__(cls, path: str, overwrite: bool = False, flag: str = "--output", inputs=()):
        if cls is StagedOutput and not fs.is_local(path):
            return fs.StagedObjectOutput(path, overwrite, flag, inputs)
        return super().__new__(cls)

    def __init__(self, path: str, overwrite: bool = False, flag: str = "--output", inputs=()):
        check_output(path, overwrite, flag, inputs)
        self.path = os.path.abspath(path)
        self.overwrite = overwrite
        self.flag = flag
        parent, name = os.path.split(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.tmp)
        self.committed = False

    def commit(self) -> str:
        check_output(self.path, self.overwrite, self.flag)  # another job may have written it
        replace_directory(self.tmp, self.path)
        self.committed = True
        return self.path

    def discard(self) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "StagedOutput":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self.committed:
            self.discard()
        return False


def replace_directory(new: str, path: str) -> str:
    """Put the complete directory ``new`` at ``path``: an existing ``path`` is renamed aside
    first and removed only after ``new`` took its place, so ``path`` is never half-written (a
    crash in between leaves the old one beside it, named ``.NAME.old-*``)."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    old = None
    if os.path.isdir(path):
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
    os.rename(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path
