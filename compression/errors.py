"""The usage errors: what a command reports with exit code 2 (:mod:`compression.cli`), raised
by the code below it that finds the problem (the output policy, :mod:`compression.outputs`;
the object-store publisher, :class:`compression.fs.StagedObjectOutput`; the trainer's run
checks).

No imports: every module of the house can raise them without depending on the command face.
"""

from __future__ import annotations


class UsageError(ValueError):
    """The command cannot use what it was given (exit code 2)."""


class OutputExistsError(UsageError):
    """The output directory holds something and ``--overwrite`` was not given."""
