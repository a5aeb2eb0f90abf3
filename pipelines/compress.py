"""The batch compression job: raw sample files -> multi-prefix-tree Parquet shards, on Beam.

    python -m pipelines.compress --schema schemas/examples/taobao_like.yaml \\
        --input 'raw/*.parquet' --output trees/ --shards 16 [Beam pipeline options]

Shape (Arrow tables end to end, never row dicts)::

    file paths -> read each file in chunks -> split_bad_rows --------> _dead_letter/*.jsonl
                                           -> split_roots (root nodes once per chunk)
                                           -> split by hash(root key) % N
               -> GroupByKey(shard) -> build_trees -> part-SSSSS-of-NNNNN.parquet
               -> TreeStats of every shard + bad-row count -> _stats.json

What is shuffled is a ``ShardPart`` per (chunk, shard): the root layer's features once per
root node of the chunk (a user's behaviour lists are most of a sample's bytes) and the other
columns per row, as LZ4 Arrow IPC encoded on the read DoFn's thread pool. ``--threads``
(default 2) lets a worker split a chunk while it decodes the next, and build and write that
many shards at once.

Every sample of a root node (a user) goes to one shard, so the shards hold exactly the trees the
in-process ``python -m compression.compress`` builds, only split into N files. A shard is built
in one worker's memory: pick ``--shards`` so that samples / N rows fit (the taobao_like schema
takes ~450 bytes per sample in memory, ~3x that while its trees are built).

Without ``--runner`` the job runs on the in-process ``FnApiRunner``: the default
``DirectRunner`` of Beam 2.77 first tries to download the Prism runner on every run and falls
back to the FnApiRunner when it cannot (offline it only wastes time; on a network that drops
packets it can hang). Pass ``--runner=DirectRunner``, ``DataflowRunner``, ``FlinkRunner`` or
``SparkRunner`` with their usual options to run elsewhere, or
``--runner=apache_beam.runners.dask.dask_runner.DaskRunner --dask_client_address=HOST:PORT``
for a Dask cluster (Beam knows that runner only by its full name; see
:class:`CompressFiles` for what shape it needs).

Paths may be local or on an object store (``s3://bucket/logs/*.parquet``, ``gs://``): workers
open and create files through Beam's ``FileSystems`` (``apache-beam[aws]`` for S3, ``[gcp]``
for GCS; configured by the pipeline options, e.g. ``--s3_endpoint_url``, or the store's
standard environment); the launching process matches the inputs, applies the output policy
and publishes the output through :mod:`compression.fs`, which reads the standard environment
(``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``). An object store has no atomic rename: the
output is written under a hidden ``OUTPUT/.gen-XXXXXXXX/`` and published by
``OUTPUT/_MANIFEST.json``, written last (:class:`compression.fs.StagedObjectOutput`); readers
of the project see the old output or the new one, never a mix.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from typing import Iterable, Tuple

import apache_beam as beam
import pyarrow as pa
import yaml
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.utils.windowed_value import WindowedValue

import compression
import schemas
from compression import RawDataError, TreeStats, cli, fs, outputs
from compression.stats import format_summary
from pipelines._runner import with_default_runner
from pipelines._coders import ShardPart  # registers the Arrow table and part coders
from pipelines._shards import split_by_shard, split_roots_by_shard

log = logging.getLogger(__name__)

DEFAULT_SHARDS = 16
DEFAULT_CHUNK_ROWS = 1 << 17
DEFAULT_THREADS = 2
DEAD_LETTER_DIR = "_dead_letter"
STATS_FILE = "_stats.json"
_PART = re.compile(r"^part-\d{5}-of-\d{5}\.parquet$")
_METRICS = "prefixrec.compress"


class TooManyBadRows(RawDataError):
    """More rows failed validation than ``--max-bad-rows`` allows."""


def _load_schema(schema_yaml: str) -> schemas.Schema:
    return schemas.from_dict(yaml.safe_load(schema_yaml))


def part_name(shard: int, shards: int) -> str:
    return f"part-{shard:05d}-of-{shards:05d}.parquet"


# -- files through Beam's FileSystems (local paths keep their atomic temp file + rename) -----

def _opener(path: str):
    """None for a local path (compression reads it directly), else a function opening it
    through Beam's FileSystems."""
    if fs.is_local(path):
        return None
    return lambda: FileSystems.open(path, mime_type="application/octet-stream",
                                    compression_type=CompressionTypes.UNCOMPRESSED)


def _create(path: str):
    """A file for writing ``path`` whole through Beam's FileSystems (the object appears,
    complete, when it is closed)."""
    return FileSystems.create(path, mime_type="application/octet-stream",
                              compression_type=CompressionTypes.UNCOMPRESSED)


def _storage_errors(path: str, doing: str):
    """Turns a store's failure into :class:`compression.fs.StorageError` naming ``path``."""
    return fs.translate_errors(path, doing, extra=(Exception,))


class _Counted:
    """A file being written that counts the bytes written through it."""

    def __init__(self, file):
        self.file = file
        self.size = 0

    def write(self, data) -> int:
        self.size += len(memoryview(data).cast("B"))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def _write_trees(trees: pa.Table, path: str) -> int:
    """Write a tree file; returns its size in bytes (counted while written: on S3, each call
    of Beam 2.77's file system builds a new boto3 client, ~0.3 s of CPU here)."""
    if fs.is_local(path):
        return os.path.getsize(compression.write_trees(trees, path))
    with _storage_errors(path, "write it"):
        with _create(path) as f:
            counted = _Counted(f)
            compression.write_trees(trees, path, sink=counted)
        return counted.size


def _write_text(path: str, text: str) -> None:
    """Write a small text file whole: temp file + rename locally, one object on a store."""
    if fs.is_local(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return
    with _storage_errors(path, "write it"):
        with _create(path) as f:
            f.write(text.encode("utf-8"))


class _FilesFn(beam.DoFn):
    """A DoFn that opens and creates files through Beam's ``FileSystems`` with the job's
    pipeline options (``--s3_endpoint_url``...), set in ``setup`` on the worker.

    Dataflow's and the portable runners' workers receive the options from the runner; the
    DaskRunner's do not, and Beam's S3 file system without options fails ("Unable to get
    the Filesystem"). ``filesystem_options`` is the dict of the options given
    (``PipelineOptions.get_all_options(drop_default=True)``); None leaves the worker's
    own."""

    def __init__(self, filesystem_options: dict | None = None):
        self._filesystem_options = filesystem_options

    def setup(self):
        if self._filesystem_options is not None:
            FileSystems.set_options(PipelineOptions.from_dictionary(self._filesystem_options))


class _PooledFn(_FilesFn):
    """A DoFn with a pool of ``threads - 1`` worker threads (None for one thread) next to the
    bundle thread, built in ``setup`` (DoFns are pickled) and shut down in ``teardown``."""

    def __init__(self, threads: int, filesystem_options: dict | None = None):
        super().__init__(filesystem_options)
        self._threads = max(1, threads)

    def setup(self):
        super().setup()
        self._pool = (concurrent.futures.ThreadPoolExecutor(self._threads - 1)
                      if self._threads > 1 else None)

    def teardown(self):
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@beam.typehints.with_output_types(Tuple[int, ShardPart])
class _ReadShardsFn(_PooledFn):
    """One raw file -> (shard, part of the good rows); rejected rows are written to
    ``OUTPUT/_dead_letter/`` here (:func:`_write_dead_letter`). Parts carry the root layer's
    features once per root node of the chunk (``compression.split_roots``), not once per
    sample: a user's features and behaviour lists, most of the bytes, are then shuffled ~10x
    less often.

    Whole-file problems (a missing or mistyped column, an unreadable file) raise
    :class:`RawDataError` naming the file: they are not bad rows, and retrying cannot fix them.
    """

    def __init__(self, schema_yaml: str, output: str, shards: int, format: str | None,
                 chunk_rows: int, threads: int = 1, filesystem_options: dict | None = None):
        super().__init__(threads, filesystem_options)
        self._dead_letter_dir = fs.join(output, DEAD_LETTER_DIR)
        self._schema_yaml = schema_yaml
        self._shards = shards
        self._format = format
        self._chunk_rows = chunk_rows
        self._rows = beam.metrics.Metrics.counter(_METRICS, "rows_read")
        self._bad = beam.metrics.Metrics.counter(_METRICS, "bad_rows")
        self._files = beam.metrics.Metrics.counter(_METRICS, "files_read")

    def setup(self):
        # Chunks are validated and split on the pool while the next one is decoded (Parquet
        # decoding, Arrow and numpy release the GIL).
        super().setup()
        self._schema = _load_schema(self._schema_yaml)

    def process(self, path: str):
        rows = bad = 0
        pending = collections.deque()
        try:
            for chunk in compression.iter_raw_chunks(path, self._schema, self._format,
                                                     self._chunk_rows, _opener(path)):
                read = chunk.table.num_rows + (chunk.rejected.num_rows
                                               if chunk.rejected is not None else 0)
                rows += read
                self._rows.inc(read)
                if self._pool is None:
                    split = self._split(chunk, path)
                    bad += split[0].num_rows
                    yield from self._emit(*split)
                    continue
                pending.append(self._pool.submit(self._split, chunk, path))
                del chunk
                while pending and (pending[0].done() or len(pending) >= self._threads):
                    split = pending.popleft().result()
                    bad += split[0].num_rows
                    yield from self._emit(*split)
            while pending:
                split = pending.popleft().result()
                bad += split[0].num_rows
                yield from self._emit(*split)
        except RawDataError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise RawDataError(f"{path}: cannot read the file as "
                               f"{compression.raw_format(path, self._format)}: {e}") from None
        finally:
            for future in pending:
                future.cancel()
        self._files.inc()
        log.info("read %s: %s rows, %s bad", path, f"{rows:,}", f"{bad:,}")

    def _split(self, chunk: compression.RawChunk, path: str):
        """(rejected rows, [(shard, part), ...]) of one chunk, parts already encoded."""
        good, rejected = chunk.split(self._schema, path)
        if len(self._schema.layers) > 1:
            parts = [(shard, ShardPart(roots, rows)) for shard, (roots, rows)
                     in split_roots_by_shard(good, self._schema, self._shards)]
        else:
            parts = [(shard, ShardPart(None, rows))
                     for shard, rows in split_by_shard(good, self._schema, self._shards)]
        for _, part in parts:
            part.encoded()  # here, on a pool thread, rather than in the runner's coder call
        return rejected, parts

    def _emit(self, rejected: pa.Table, parts):
        if rejected.num_rows:
            self._bad.inc(rejected.num_rows)
            _write_dead_letter(self._dead_letter_dir, rejected)
        yield from parts


class _BuildShardFn(_PooledFn):
    """All rows of one shard -> its tree table, written as ``part-SSSSS-of-NNNNN.parquet``.

    Up to ``threads`` shards of a bundle are built and written at once, on a thread pool:
    Arrow, numpy's big array operations and the Parquet writer release the GIL, and a
    runner that hands one worker several shards (the local FnApiRunner gives the whole
    stage one bundle) would otherwise leave all but one core idle. Results are emitted in
    order of completion; at most ``threads`` shards are in memory at once.
    """

    def __init__(self, schema_yaml: str, output: str, shards: int, threads: int = 1,
                 filesystem_options: dict | None = None):
        super().__init__(threads, filesystem_options)
        self._schema_yaml = schema_yaml
        self._output = output
        self._shards = shards
        self._samples = beam.metrics.Metrics.counter(_METRICS, "samples_written")
        self._trees = beam.metrics.Metrics.counter(_METRICS, "trees_written")
        self._done = beam.metrics.Metrics.counter(_METRICS, "shards_written")

    def setup(self):
        super().setup()
        self._schema = _load_schema(self._schema_yaml)

    def start_bundle(self):
        self._pending = collections.deque()

    def process(self, element: Tuple[int, Iterable[ShardPart]],
                timestamp=beam.DoFn.TimestampParam, window=beam.DoFn.WindowParam):
        shard, parts = element
        parts = list(parts)
        if self._pool is None:
            yield self._finish(self._build(shard, parts))
            return
        yield from self._done_builds()
        if len(self._pending) < self._threads - 1:  # a pool thread is free: hand it over
            self._pending.append((self._pool.submit(self._build, shard, parts), timestamp,
                                  window))
            return
        # All pool threads busy: this thread builds one too, so ``threads`` run at once.
        yield self._finish(self._build(shard, parts))
        yield from self._done_builds()

    def finish_bundle(self):
        yield from self._done_builds(wait=True)

    def _done_builds(self, wait: bool = False):
        """The results of the pool's builds that are done (all of them with ``wait``), each
        in the window of its own element."""
        while self._pending and (wait or self._pending[0][0].done()):
            future, timestamp, window = self._pending.popleft()
            yield WindowedValue(self._finish(future.result()), timestamp, [window])

    def _build(self, shard: int, parts: list[ShardPart]):
        parts = [part.tables for part in parts]  # decoded here, on a pool thread
        if parts[0][0] is None:
            flat = pa.concat_tables([rows for _, rows in parts])
            trees = compression.build_trees(flat, self._schema, validate=False)
        else:
            roots, flat = compression.concat_roots(parts)
            trees = compression.build_trees(flat, self._schema, validate=False, roots=roots)
        del parts
        path = fs.join(self._output, part_name(shard, self._shards))
        stats = TreeStats(self._schema).add(trees)
        stats.bytes_on_disk = _write_trees(trees, path)
        log.info("shard %d/%d written: %s samples in %s trees -> %s", shard + 1, self._shards,
                 f"{flat.num_rows:,}", f"{trees.num_rows:,}", path)
        return shard, stats, flat.num_rows, trees.num_rows

    def _finish(self, built):
        # Metrics are counted on the bundle's thread (a pool thread has no metrics context).
        shard, stats, samples, trees = built
        self._samples.inc(samples)
        self._trees.inc(trees)
        self._done.inc()
        return shard, stats


def _write_dead_letter(directory: str, rejected: pa.Table) -> None:
    """Rejected rows (source, row, reason) of one chunk as one JSON-lines file.

    The file name comes from the source and its first rejected row, so a retried bundle
    rewrites the same file instead of adding a copy, and :func:`_count_dead_letters` can count
    the files' lines.
    """
    source = rejected.column("source")[0].as_py()
    first = rejected.column("row")[0].as_py()
    tag = hashlib.sha1(source.encode()).hexdigest()[:8]
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(source)) or "input"
    path = fs.join(directory, f"{base}-{tag}-{first:012d}.jsonl")
    # rejected rows only: few, and small
    _write_text(path, "".join(json.dumps(row) + "\n" for row in rejected.to_pylist()))


def _count_dead_letters(directory: str) -> tuple[int, dict | None]:
    """(rejected rows, the first of them by source and row) of the files in ``directory``."""
    pattern = fs.join(directory, "*.jsonl")
    with _storage_errors(directory, "list it"):
        found = FileSystems.match([pattern])[0].metadata_list
    count, first = 0, None
    for metadata in sorted(found, key=lambda m: m.path):
        with _storage_errors(metadata.path, "read it"):
            with FileSystems.open(metadata.path, mime_type="application/octet-stream",
                                  compression_type=CompressionTypes.UNCOMPRESSED) as f:
                lines = f.read().decode("utf-8").splitlines()
        count += len(lines)
        if lines:
            head = json.loads(lines[0])
            if first is None or (head["source"], head["row"]) < (first["source"],
                                                                   first["row"]):
                first = head
    return count, first


_GATHER = 0  # the one key all shard statistics are grouped under (an int: same hash anywhere)


class _FinishFn(_FilesFn):
    """Merges the shards' statistics, checks the bad-row budget, writes ``_stats.json``.

    Its one element is ``(_GATHER, [None, (shard, stats), ...])``: the statistics of every
    shard built, grouped under one key, with a None that makes the element exist when no
    shard was. Bad rows are counted from the dead-letter files the read step wrote.
    ``_stats.json`` is written last and only when the job succeeds: its presence marks a
    complete output directory.
    """

    def __init__(self, schema_yaml: str, output: str, shards: int, input_files: int,
                 max_bad_rows: int, rejected_dir: str | None = None,
                 filesystem_options: dict | None = None):
        super().__init__(filesystem_options)
        self._schema_yaml = schema_yaml
        self._output = output
        self._rejected_dir = rejected_dir or fs.join(output, DEAD_LETTER_DIR)
        self._shards = shards
        self._input_files = input_files
        self._max_bad_rows = max_bad_rows

    def process(self, element):
        _, gathered = element
        schema = _load_schema(self._schema_yaml)
        bad_rows, first = _count_dead_letters(fs.join(self._output, DEAD_LETTER_DIR))
        if bad_rows > self._max_bad_rows:
            raise TooManyBadRows(
                f"{bad_rows:,} rows failed validation, more than --max-bad-rows "
                f"{self._max_bad_rows:,} (the first: {first['source']}: {first['reason']}); "
                f"their reasons are in {self._rejected_dir}/ (fix the data, or raise "
                "--max-bad-rows to drop them)")
        total = TreeStats(schema)
        built = set()
        for shard, stats in (g for g in gathered if g is not None):
            total.merge(stats)
            built.add(shard)
        # A shard no sample hashed to still gets its (empty) file: readers can count on N.
        empty = schema.tree_arrow_schema().empty_table()
        for shard in sorted(set(range(self._shards)) - built):
            total.bytes_on_disk += _write_trees(
                empty, fs.join(self._output, part_name(shard, self._shards)))
        summary = total.summary()
        summary.update(bad_rows=bad_rows, shards=self._shards, input_files=self._input_files,
                       bytes_on_disk=total.bytes_on_disk)
        _write_text(fs.join(self._output, STATS_FILE), json.dumps(summary, indent=2))
        yield summary


class CompressFiles(beam.PTransform):
    """PCollection of raw file paths -> trees in ``output``; outputs the ``_stats.json`` dict.

    ``schema_yaml`` is the schema's YAML text (what DoFns carry to the workers).
    ``rejected_dir`` is where the error of a failed job says the rejected rows are (default
    ``output/_dead_letter``). ``filesystem_options``: the pipeline options the workers set on
    Beam's ``FileSystems`` (:class:`_FilesFn`).

    One chain of single-output ParDos, GroupByKeys and a Flatten, no side inputs: the shape
    Beam 2.77's DaskRunner runs. It hands every consumer of a multi-output ParDo all of its
    outputs mixed (the dead-letter writer got (shard, part) pairs), computes only the last
    transform's graph (a side input is computed again inside the task that reads it, which
    holds a worker meanwhile), and drops what a DoFn emits from ``finish_bundle`` (its
    ``apply_dofn_to_bundle`` collects the outputs before calling it): the job passes
    ``threads=1`` to the build step there (:func:`build_threads`).
    """

    def __init__(self, schema_yaml: str, output: str, shards: int = DEFAULT_SHARDS,
                 format: str | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                 max_bad_rows: int = 0, input_files: int = 0,
                 threads: int = DEFAULT_THREADS, rejected_dir: str | None = None,
                 filesystem_options: dict | None = None, build_threads: int | None = None):
        super().__init__()
        self._rejected_dir = rejected_dir
        self._threads = threads
        self._build_threads = threads if build_threads is None else build_threads
        self._schema_yaml = schema_yaml
        self._output = output
        self._shards = shards
        self._format = format
        self._chunk_rows = chunk_rows
        self._max_bad_rows = max_bad_rows
        self._input_files = input_files
        self._filesystem_options = filesystem_options

    def expand(self, paths):
        options = self._filesystem_options
        shard_stats = (paths
                       | "SpreadFiles" >> beam.Reshuffle()
                       | "ReadAndShard" >> beam.ParDo(
                           _ReadShardsFn(self._schema_yaml, self._output, self._shards,
                                         self._format, self._chunk_rows, self._threads,
                                         options))
                       | "GroupByShard" >> beam.GroupByKey()
                       | "BuildAndWrite" >> beam.ParDo(
                           _BuildShardFn(self._schema_yaml, self._output, self._shards,
                                         self._build_threads, options)))
        always = paths.pipeline | "Finish" >> beam.Create([None])
        return ((shard_stats, always)
                | "Gather" >> beam.Flatten()
                | "OneKey" >> beam.Map(lambda stats: (_GATHER, stats))
                | "GroupAll" >> beam.GroupByKey()
                | "WriteStats" >> beam.ParDo(
                    _FinishFn(self._schema_yaml, self._output, self._shards,
                              self._input_files, self._max_bad_rows, self._rejected_dir,
                              options)))


def _on_dask(options: PipelineOptions) -> bool:
    from apache_beam.options.pipeline_options import StandardOptions

    runner = options.view_as(StandardOptions).runner
    name = runner if isinstance(runner, str) else type(runner).__name__
    return bool(name) and name.rsplit(".", 1)[-1] == "DaskRunner"


def build_threads(options: PipelineOptions, threads: int) -> int:
    """The threads of the build step: 1 on the DaskRunner (which drops what
    ``finish_bundle`` emits, where the pool's last builds come out), ``threads`` elsewhere."""
    return 1 if _on_dask(options) else threads


def _spread_on_dask(options: PipelineOptions, files: int) -> None:
    """On the DaskRunner, one Dask partition per input file unless ``--dask_npartitions`` or
    ``--dask_partition_size`` is given: Beam's DaskRunner puts up to 128 elements of a Create
    in one partition and its Reshuffle does nothing, so one task would read every file, and
    the GroupByKey keeps the number of partitions, so one worker would build every shard."""
    if not _on_dask(options):
        return
    from apache_beam.runners.dask.dask_runner import DaskOptions

    dask = options.view_as(DaskOptions)
    if dask.npartitions is None and dask.partition_size is None:
        dask.npartitions = files


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(f"{PROG} --schema schemas/examples/taobao_like.yaml --input "
                          "'raw/*.parquet' --output trees/ --shards 16",
                          f"{PROG} ... --runner=DataflowRunner --project P --region R "
                          "--setup_file ./setup.py"),
        description="Compress raw samples (Parquet, CSV or JSON lines) into multi-prefix-tree "
                    "Parquet shards with Apache Beam. Flags not listed here are Beam pipeline "
                    "options (--runner, --project, --flink_master, ...); without --runner the "
                    "job runs locally on the FnApiRunner.")
    p.add_argument("--schema", required=True, help="schema YAML file")
    p.add_argument("--input", required=True, action="append",
                   help="raw files: a path, directory or glob, local or on an object store "
                        "(s3://bucket/logs/*.parquet; repeat for more)")
    p.add_argument("--output", required=True,
                   help="output directory: part-SSSSS-of-NNNNN.parquet, _stats.json, "
                        "_dead_letter/; written through a temporary directory next to it and "
                        "renamed into place on success (on an object store: under a hidden "
                        "prefix, published by OUTPUT/_MANIFEST.json written last); a failed "
                        "job leaves no output, its rejected rows go to OUTPUT.dead_letter/")
    cli.add_overwrite_flag(p)
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS,
                   help=f"number of output files; each is built in one worker's memory "
                        f"(default {DEFAULT_SHARDS})")
    p.add_argument("--format", choices=["parquet", "csv", "json"],
                   help="input format (default: from each file's extension)")
    p.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                   help=f"rows read and validated at a time (default {DEFAULT_CHUNK_ROWS})")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help="threads of a worker's DoFns: raw chunks split while the next is "
                        "read, and shards built and written at once (each shard in memory; "
                        f"default {DEFAULT_THREADS})")
    p.add_argument("--max-bad-rows", type=int, default=0,
                   help="rows that may fail validation (they go to OUTPUT/_dead_letter/ with "
                        "the reason) before the job fails (default 0: any bad row fails it)")
    cli.add_debug_flag(p)
    return p


def _job_error(e: BaseException) -> BaseException | None:
    """The error of ours a failed pipeline carries (runners wrap it in their own exception)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (RawDataError, fs.StorageError, KeyboardInterrupt)):
            return e
        e = e.__cause__ or e.__context__
    return None


def run(argv=None) -> dict:
    """Run the job; returns the ``_stats.json`` summary.

    Raises :class:`compression.RawDataError` (bad files, or more bad rows than allowed),
    :class:`compression.cli.UsageError` (no input, empty input, a non-empty output without
    ``--overwrite``) or ``schemas.SchemaError``. The output is written through a temporary
    directory next to it, renamed into place on success; a failed job leaves no output (its
    rejected rows, if any, go to ``OUTPUT.dead_letter/``).
    """
    args, beam_args = _parser().parse_known_args(argv)
    if args.shards < 1:
        raise cli.UsageError(f"--shards: expected a positive number, got {args.shards}")
    if args.threads < 1:
        raise cli.UsageError(f"--threads: expected a positive number, got {args.threads}")
    schema = schemas.load(args.schema)
    options = PipelineOptions(with_default_runner(beam_args))
    with s3_options_as_environment(options):
        return _run(args, options, schema)


def s3_options_as_environment(options: PipelineOptions):
    """Beam's ``--s3_endpoint_url`` and ``--s3_region_name``, when given, as this process's
    ``AWS_ENDPOINT_URL`` / ``AWS_DEFAULT_REGION`` meanwhile (where those are not set), so the
    launcher's checks and publishing (:mod:`compression.fs`, which reads the standard
    environment) talk to the store the workers write to. Credentials are not copied: they
    come from the environment (or the workers' own)."""
    from apache_beam.options.pipeline_options import S3Options

    s3 = options.view_as(S3Options)
    wanted = {"AWS_ENDPOINT_URL": s3.s3_endpoint_url, "AWS_DEFAULT_REGION": s3.s3_region_name}
    added = {name: value for name, value in wanted.items()
             if value and not os.environ.get(name)}

    @contextlib.contextmanager
    def environment():
        os.environ.update(added)
        try:
            yield added
        finally:
            for name in added:
                os.environ.pop(name, None)
    return environment()


def _run(args, options: PipelineOptions, schema: schemas.Schema) -> dict:
    files = cli.check_inputs(args.input, "--input", args.format)
    for path in files:
        compression.raw_format(path, args.format)  # fail now, not in a worker
    FileSystems.set_options(options)  # for the job's own files before the pipeline exists
    staged = outputs.StagedOutput(args.output, args.overwrite, inputs=files)
    rejected = f"{staged.path}.dead_letter"
    try:
        log.info("compressing %d file(s) into %d shard(s) -> %s", len(files), args.shards,
                 staged.path)
        _run_pipeline(options, files, schema, staged.tmp, args, rejected)
        summary = json.loads(fs.read_text(fs.join(staged.tmp, STATS_FILE)))
        staged.commit()
    except BaseException:
        _keep_dead_letter(staged.tmp, rejected)
        staged.discard()
        raise
    fs.delete_tree(rejected)  # an earlier failed run's rejected rows
    return summary


def _keep_dead_letter(tmp: str, rejected: str) -> None:
    """Move a failed run's rejected rows out of its temporary output, to ``rejected`` (on
    an object store: copied, then removed with the temporary output)."""
    dead = fs.join(tmp, DEAD_LETTER_DIR)
    if fs.is_local(tmp):
        if os.path.isdir(dead) and os.listdir(dead):
            shutil.rmtree(rejected, ignore_errors=True)
            os.rename(dead, rejected)
        return
    files = fs.list_files(dead)
    if files:
        fs.delete_tree(rejected)
        for path in files:
            fs.write_bytes(fs.join(rejected, path[len(dead) + 1:]), fs.read_bytes(path))


def _run_pipeline(options, files, schema, output: str, args, rejected: str) -> None:
    _spread_on_dask(options, len(files))
    try:
        p = beam.Pipeline(options=options)
        _ = (p
             | "Files" >> beam.Create([os.path.abspath(f) if fs.is_local(f) else f
                                      for f in files])
             | "Compress" >> CompressFiles(
                 schema.to_yaml(), output, args.shards, args.format, args.chunk_rows,
                 args.max_bad_rows, len(files), args.threads, rejected,
                 options.get_all_options(drop_default=True),
                 build_threads(options, args.threads)))
        result = p.run()
        try:
            result.wait_until_finish()
        finally:
            client = getattr(result, "client", None)  # the DaskRunner's, left open by Beam
            if client is not None:
                client.close()
    except Exception as e:
        ours = _job_error(e)
        if ours is None:
            # Some runners only keep the message text of a worker's exception.
            text = str(e)
            # Ctrl-C / SIGTERM inside a DoFn run on this thread (the local runners)
            for cls in (cli.Terminated, KeyboardInterrupt):
                if re.match(rf"(?:[\w.]+\.)?{cls.__name__} \[while running", text):
                    raise cls() from None
            for cls in (TooManyBadRows, RawDataError, fs.StorageError):
                match = re.search(rf"{cls.__name__}: (.+?)(?: \[while running|\n|$)", text)
                if match:
                    raise cls(match.group(1)) from e
            raise
        if isinstance(ours, KeyboardInterrupt):
            raise ours from None
        raise type(ours)(str(ours).split(" [while running")[0]) from e


PROG = "python -m pipelines.compress"


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


def _main(argv) -> int:
    # force: importing Beam has already given the root logger a handler.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    log.setLevel(logging.INFO)
    if "--debug" not in argv:
        cli.hide_logged_tracebacks("apache_beam")  # the error is reported once, below
    started = time.perf_counter()
    summary = run(argv)
    seconds = time.perf_counter() - started
    print(format_summary(summary))
    print(f"bad rows              {summary['bad_rows']:,}")
    print(f"compressed {summary['samples']:,} samples into {summary['shards']} shards in "
          f"{seconds:.1f} s ({summary['samples'] / max(seconds, 1e-9):,.0f} samples/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
