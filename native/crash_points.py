"""Crash points: named steps of every durable write at which a test can make the process die.

A test sets ``PREFIXREC_CRASH_POINT=<name>`` (the first time the process reaches that point)
or ``PREFIXREC_CRASH_POINT=<name>:<n>`` (the n-th time) in a child process; on reaching it
the process ends at once with ``os._exit(EXIT_CODE)`` (``_exit(86)`` in C++): no ``finally``,
no flush, no destructor, as if it had been killed. Restarting the process without the variable
must then find nothing lost and nothing repeated. Without the variable a point costs one
dictionary lookup (Python) or one load of a cached flag (C++). The variable is read once, when
a process first reaches a point.

The points, in the order each write reaches them:

Native store snapshot (``EmbeddingStore.save``, C++ ``native/src/persistence.cc``):
    ``store.snapshot.written``   every byte written to ``store.snapshot.tmp.<pid>``, not fsynced
    ``store.snapshot.synced``    the temporary file fsynced, not yet renamed
    ``store.snapshot.renamed``   renamed to ``store.snapshot``, directory not yet fsynced
Native store delta (``EmbeddingStore.export_delta``, same file):
    ``store.delta.written``      as above, for ``delta-NNNNNN.bin``
    ``store.delta.synced``
    ``store.delta.renamed``      in place; the store's delta sequence not yet advanced
Quantized export files (a table exported as float16, int8 or int4: its snapshot and deltas
written from the store's, C++ ``native/src/quantized.cc``):
    ``quantized.snapshot.written``, ``.synced``, ``.renamed``   as above, for ``store.quantized``
    ``quantized.delta.written``, ``.synced``, ``.renamed``      as above, for ``delta-NNNNNN.bin``
Native store disk tier (a store with a memory budget, C++ ``native/src/disk_tier.cc``): the tier
extends memory and is not kept across a crash; a restarted store loads its last snapshot and
opens its tier directories empty, so nothing a killed writer left there is ever read:
    ``tier.put.written``         rows moved to disk written (not synced), before the next call
    ``tier.reclaim.moved``       rows moved into holes of the tier's file, the file not yet cut
Checkpoint (``trainer.checkpoints.CheckpointManager.save``):
    ``checkpoint.written``       the new checkpoint complete and fsynced, under a temporary name
    ``checkpoint.renamed``       renamed to ``ckpt-<step>[-<revision>]``, LATEST not yet moved
    ``checkpoint.latest``        LATEST names it, older checkpoints not yet removed
    ``checkpoint.removing``      an older checkpoint renamed away, half removed
  and, in a save of a step that has a checkpoint already (a new revision), the same four with
  ``.same-step`` appended (``checkpoint.renamed.same-step``), reached after the plain one.
Serving export (``trainer.serving.export_increment``):
    ``export.published``         a version's manifest in place (followers may apply it), the
                                 trainer's checkpoint not yet written
Object-store publish (``compression.fs.StagedObjectOutput.commit``: a directory on ``s3://``,
``gs://``...; the run directory of ``trainer.online``/``trainer.train`` and full exports there
are local working copies published this way, so the points above happen locally before it):
    ``publish.copied``           every file under the hidden ``DIR/.gen-XXXXXXXX/``, the manifest
                                 not written: readers still see the previous generation
    ``publish.committed``        ``DIR/_MANIFEST.json`` names the new generation, older ones not
                                 yet removed
Kafka offsets (``trainer.online_loop.OnlineLoop._commit``, the same for both online engines):
    ``offsets.commit``           the checkpoint holding the offsets is durable, not committed
    ``offsets.committed``        the commit sent (the final commit of a run: and answered)

A checkpoint's ``Trainer.save`` writes store snapshots into it, so ``store.snapshot.*`` points
are reached inside a checkpoint's write too (before ``checkpoint.written``).
"""

from __future__ import annotations

import os
import threading

ENV = "PREFIXREC_CRASH_POINT"
EXIT_CODE = 86

POINTS = (
    "store.snapshot.written", "store.snapshot.synced", "store.snapshot.renamed",
    "store.delta.written", "store.delta.synced", "store.delta.renamed",
    "quantized.snapshot.written", "quantized.snapshot.synced", "quantized.snapshot.renamed",
    "quantized.delta.written", "quantized.delta.synced", "quantized.delta.renamed",
    "tier.put.written", "tier.reclaim.moved",
    "checkpoint.written", "checkpoint.renamed", "checkpoint.latest", "checkpoint.removing",
    "checkpoint.written.same-step", "checkpoint.renamed.same-step",
    "checkpoint.latest.same-step", "checkpoint.removing.same-step",
    "export.published", "publish.copied", "publish.committed", "offsets.commit",
    "offsets.committed",
)

_lock = threading.Lock()
_wanted: tuple[str, int] | None = None
_read = False
_hits: dict[str, int] = {}


def parse(text: str) -> tuple[str, int]:
    """``("name", n)`` of ``name`` or ``name:n``; ValueError for an unknown name or a bad n."""
    name, _, count = text.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={text!r}: unknown crash point {name!r}; the points are "
                         f"{', '.join(POINTS)}")
    try:
        n = int(count) if count else 1
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={text!r}: expected {name}:<n> with n >= 1, got {count!r}")
    return name, n


def crash_point(name: str) -> None:
    """Die here (``os._exit(EXIT_CODE)``) if ``PREFIXREC_CRASH_POINT`` asks for this hit of
    ``name``; otherwise return at once."""
    global _wanted, _read
    if not _read:
        with _lock:
            if not _read:
                text = os.environ.get(ENV)
                _wanted = parse(text) if text else None
                _read = True
    if _wanted is None or _wanted[0] != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] == _wanted[1]:
            os._exit(EXIT_CODE)
