"""Serving: a SavedModel of the dense network plus store snapshots, and a Predictor over them.

    trainer.export("export/")                      # dense SavedModel + every store's snapshot
    export_increment(trainer, "export/")           # later: store deltas + new dense weights
    predictor = Predictor("export/")
    predictor.predict(raw_samples)                 # probabilities, in the samples' order
    predictor.update()                             # apply what appeared since, in order

Layout of an export directory::

    export.json                 schema, config, model spec and heads, format version
    saved_model/                tf.saved_model with a ``predict`` function over the feed
    stores/<table>/store.snapshot   (store.quantized: a table exported as float16/int8/int4)
    versions/vNNNNNNNN/<table>/delta-SSSSSS.bin   (export_increment, later: version N's
    versions/vNNNNNNNN/dense.npz                   store deltas and dense weights)
    versions/vNNNNNNNN.json                       its manifest, written last

**Versions.** A full export is version 0 of a *lineage* (``export.json["lineage"]``, a random
id). Each :func:`export_increment` after it publishes version N+1: its files under
``versions/vNNNNNNNN/``, then the manifest ``versions/vNNNNNNNN.json`` (the lineage, the number,
the step, every table's delta files, the dense weights, the newest sample's arrival time),
written last and atomically. A reader trusts only what a manifest names, applies versions in
order and never one of another lineage. A published file is never rewritten: a trainer that
restarts (from a checkpoint older than what it published, say) starts a new lineage with a full
export instead of renumbering deltas a follower may have applied. The older layout
(``deltas/<table>/delta-NNNNNN.bin`` + ``dense.npz``) is still applied by ``Predictor.update``.

A distributed run (``DistributedTrainer.export`` / ``export_increment``) keeps its shards:
``stores/<table>/shard-SSSS/`` and ``versions/vNNNNNNNN/<table>/shard-SSSS/delta-*.bin``, with
``"shards": S`` in export.json; the Predictor then looks every id up on its shard
(:class:`ShardedStore`), so each shard's deltas follow that shard's own sequence.

The SavedModel takes the feed of :mod:`trainer.feed` (ids already turned into embedding rows);
the Predictor does that part with the native stores, so a serving process follows the trainer
through ``apply_delta`` without reloading TensorFlow. Samples are scored one leaf per sample
(every layer's node is the sample itself), which keeps their order.

**Export formats.** Each table is written in its config's ``export_format``
(:meth:`trainer.config.TrainConfig.export_format`; ``--export-format`` of trainer.train and
trainer.online): float32 writes the store's own snapshot and deltas, float16, int8 and int4 a
quantized snapshot ``store.quantized`` and quantized deltas under the same names, made from the
store's files (:mod:`native.quantized`); ``export.json["export_formats"]`` names each table's.
Training state stays float32. The Predictor and :class:`trainer.live.LiveModel` load a
quantized table into a :class:`native.QuantizedStore`, rows kept as stored and dequantized on
lookup, and follow its deltas and rebases as a float32 table's. Memory budgets
(``--memory-budget``) apply to exports of float32 tables only.

**Object stores.** A full export may go to ``s3://...`` (``gs://``..., through
:mod:`compression.fs`): it is written to a local temporary directory, then published all or
nothing, its files under a hidden ``DIR/.gen-XXXXXXXX/`` and ``DIR/_MANIFEST.json`` written
last (:func:`compression.fs.publish_directory`). ``Predictor("s3://...")`` downloads the files
that manifest names to a local temporary directory first (the native stores and TensorFlow load
local files) and loads from there; :meth:`Predictor.update` (and ``trainer.serve``) bring that
copy up to date first (:func:`mirror_export`). Versions (:func:`export_increment`) are published
on a store as locally: their files first, their manifest last.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import time
import uuid
import weakref

import numpy as np
import pyarrow as pa
import tensorflow as tf

import compression
from compression.outputs import replace_directory
import native
from native.crash_points import crash_point
import schemas
from compression import LayerBatch, TreeBatch, fs
from compression.batches import feature_array
from schemas.hashing import id_shards
from trainer.checkpoints import dense_name
from trainer import tiers
from trainer.config import ConfigError, TrainConfig
from trainer.feed import FeedBuilder, Layout
from trainer.network import dummy_feed, feed_signature
from trainer.requests import TreeRequest

EXPORT_VERSION = 1
_DELTA = re.compile(r"delta-(\d+)\.bin$")
_MANIFEST = re.compile(r"^v(\d{8})\.json$")


def export(core, directory: str | os.PathLike, *, step: int, stores: dict | None = None,
           write_stores=None) -> str:
    """Write ``core``'s dense network (a :class:`trainer.model_core.ModelCore`: a ``Trainer`` or
    a distributed run's model) as a SavedModel and the embedding snapshots, as of ``step``.

    ``stores``: ``{table: EmbeddingStore}`` to snapshot; or ``write_stores(tmp_dir)``, which
    writes the snapshots itself and returns what to add to ``export.json``
    (``DistributedTrainer.export``: one snapshot per shard, ``stores/<table>/shard-NNNN``,
    and ``"shards": S``).

    On an object store (``directory`` a URI) the export is written locally, then published
    whole by a manifest written last (see the module's docstring)."""
    if not fs.is_local(os.fspath(directory)):
        with tempfile.TemporaryDirectory(prefix="prefixrec-export-") as local:
            export(core, os.path.join(local, "export"), step=step, stores=stores,
                   write_stores=write_stores)
            return fs.publish_directory(os.path.join(local, "export"), os.fspath(directory),
                                        flag="--export-dir")
    directory = os.path.abspath(os.fspath(directory))
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    network = core.network
    # The structured signature over one-sample-per-node batches is what the Predictor feeds.
    signature = feed_signature(core.layout, structured=True)
    serving_network = network.structured_twin()
    module = tf.Module()
    module.variables_ = [getattr(v, "value", v) for v in network.variables]

    @tf.function(input_signature=[signature])
    def predict(feed):
        return serving_network.predict_outputs(feed)[1]

    module.predict = predict
    # A SavedModel gives dict outputs back in its own key order; keep the model's.
    heads = list(serving_network.predict_outputs(dummy_feed(core.layout, True))[1])
    tf.saved_model.save(module, os.path.join(tmp, "saved_model"))
    extra = {}
    if write_stores is not None:
        extra = write_stores(tmp) or {}
    else:
        for table, store in stores.items():
            os.makedirs(os.path.join(tmp, "stores", table))
            store.save(os.path.join(tmp, "stores", table))
    formats = {t: core.config.export_format(t) for t in core.tables}
    for table, export_format in formats.items():
        if export_format != "float32":
            quantize_table_snapshots(os.path.join(tmp, "stores", table), table, export_format)
    meta = {"version": EXPORT_VERSION, "lineage": uuid.uuid4().hex, "schema": core.schema.to_dict(),
            "config": core.config.to_dict(), "model": core.spec(), "step": step,
            "tables": list(core.tables), "heads": heads, "export_formats": formats, **extra}
    with open(os.path.join(tmp, "export.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return replace_directory(tmp, directory)


def _snapshot_dirs(table_dir: str) -> list[str]:
    """A table's snapshot directories in an export: itself, or its ``shard-NNNN`` ones."""
    shards = sorted(glob.glob(os.path.join(table_dir, "shard-[0-9][0-9][0-9][0-9]")))
    return shards or [table_dir]


def quantize_table_snapshots(table_dir: str, table: str, export_format: str) -> None:
    """Replace the store snapshot(s) of ``table`` under ``table_dir`` (an export being
    written) with quantized ones in ``export_format``; a row that cannot be quantized (NaN,
    infinite, beyond float16) raises :class:`native.InvalidInputError` naming the table."""
    for directory in _snapshot_dirs(table_dir):
        snapshot = os.path.join(directory, "store.snapshot")
        try:
            native.quantized.quantize_snapshot(directory, os.path.join(
                directory, native.quantized.SNAPSHOT_FILE), export_format)
        except native.InvalidInputError as e:
            raise native.InvalidInputError(f"table {table} (export_format {export_format}): "
                                           f"{e}") from None
        os.remove(snapshot)


def quantize_deltas(deltas: dict, formats: dict) -> None:
    """Rewrite in place, as quantized deltas, the store deltas (``{table: path or [path per
    shard]}``, as ``export_delta`` returns them) of the tables ``formats`` does not keep as
    float32."""
    for table, paths in deltas.items():
        export_format = formats.get(table, "float32")
        if export_format == "float32":
            continue
        for path in paths if isinstance(paths, list) else [paths]:
            try:
                native.quantized.quantize_delta(path, path, export_format)
            except native.InvalidInputError as e:
                raise native.InvalidInputError(f"table {table} (export_format "
                                               f"{export_format}): {e}") from None


def export_formats(meta: dict, tables) -> dict[str, str]:
    """Each table's format in the export described by ``meta`` (export.json): as recorded,
    else (an export written before formats were recorded) float32."""
    recorded = meta.get("export_formats") or {}
    return {t: recorded.get(t, "float32") for t in tables}


# trainer -> {export directory: [lineage, last version]}: what this process published there.
_PUBLISHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def restart_lineage(trainer) -> None:
    """The next :func:`export_increment` of ``trainer`` (to any directory) writes a full
    export, a new lineage: for a trainer whose stores went back to a checkpoint (a
    distributed run rolled back after an actor died), whose next deltas would not follow
    what was published."""
    _PUBLISHED.pop(trainer, None)


def version_path(directory: str, version: int) -> str:
    """``directory/versions/vNNNNNNNN``: version ``version``'s files (+ ``.json``: manifest)."""
    return fs.join(os.fspath(directory), "versions", f"v{version:08d}")


def published_versions(directory: str) -> list[int]:
    """The version numbers whose manifest is in ``directory/versions``, ascending."""
    directory = os.fspath(directory)
    if fs.is_local(directory):
        try:
            names = os.listdir(os.path.join(directory, "versions"))
        except FileNotFoundError:
            return []
    else:
        names = [fs.basename(f) for f in fs.list_files(fs.join(directory, "versions"),
                                                        recursive=False)]
    return sorted(int(m.group(1)) for m in map(_MANIFEST.match, names) if m)


def read_lineage(directory: str) -> str | None:
    """The lineage of the full export in ``directory`` (None: none there, or an export written
    before lineages)."""
    directory = os.fspath(directory)
    try:
        if fs.is_local(directory):
            with open(os.path.join(directory, "export.json")) as f:
                return json.load(f).get("lineage")
        return json.loads(fs.read_bytes(fs.resolve_published(
            fs.join(directory, "export.json")))).get("lineage")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def export_increment(trainer, directory: str | os.PathLike,
                     newest_sample_time: float | None = None) -> dict:
    """Keep an export directory up to date cheaply. The first call (and any call after which
    this process cannot continue the directory's lineage: another writer, a new trainer object,
    a failed increment) writes a full export, starting a new lineage; later calls publish the
    next version: every store's delta and the dense weights under ``versions/vNNNNNNNN/``, then
    its manifest. ``newest_sample_time``: the arrival time (Unix seconds) of the newest sample
    trained into this version, for a follower's freshness lag.

    ``trainer``: a :class:`~trainer.trainer.Trainer` or a ``DistributedTrainer`` (anything with
    ``export(dir)``, ``export_delta(dir)`` -> ``{table: path or [path per shard]}``,
    ``dense_arrays(optimizer=False)`` and ``step``). Returns ``{"full": dir}`` or
    ``{"version": N, "manifest": path, "deltas": ..., "dense": path}``, plus ``"lineage"``.

    On an object store (``directory`` a URI) the full export is published by its manifest
    (:func:`export`), and a version is written to a local temporary directory, its files
    uploaded under ``versions/vNNNNNNNN/``, then its manifest ``versions/vNNNNNNNN.json`` put
    last in one request: as locally, readers trust a version's files only once its manifest
    is there. A new full export removes every version of the lineage it replaces."""
    remote = not fs.is_local(os.fspath(directory))
    directory = (os.fspath(directory).rstrip("/") if remote
                 else os.path.abspath(os.fspath(directory)))
    mine = _PUBLISHED.setdefault(trainer, {})
    state = mine.get(directory)
    if state is None or read_lineage(directory) != state[0]:
        trainer.export(directory)
        lineage = read_lineage(directory)
        mine[directory] = [lineage, 0]
        return {"full": directory, "lineage": lineage}
    lineage, version = state[0], state[1] + 1
    # the version's files are written under `root`: the directory, or a local staging copy
    root = tempfile.mkdtemp(prefix="prefixrec-version-") if remote else directory
    files = version_path(root, version)
    shutil.rmtree(files, ignore_errors=True)  # a failed attempt's leftovers, never published
    try:
        deltas = trainer.export_delta(files)
        quantize_deltas(deltas, {t: trainer.config.export_format(t) for t in deltas})
        dense = os.path.join(files, "dense.npz")
        np.savez(dense, step=np.int64(trainer.step), **trainer.dense_arrays(optimizer=False))
        relative = {table: [os.path.relpath(p, root)
                            for p in (paths if isinstance(paths, list) else [paths])]
                    for table, paths in deltas.items()}
        manifest = {"lineage": lineage, "version": version, "step": int(trainer.step),
                    "deltas": relative, "dense": os.path.relpath(dense, root),
                    "newest_sample_time": newest_sample_time, "published_at": time.time()}
        if remote:
            target = version_path(directory, version)
            fs.delete_tree(target)
            fs.upload_directory(files, target, doing="publish a version")
            deltas = {t: [fs.join(directory, p) for p in paths] if isinstance(deltas[t], list)
                      else fs.join(directory, paths[0]) for t, paths in relative.items()}
            dense = fs.join(directory, manifest["dense"])
        # written last, whole (a temp file fsynced and renamed; one PUT on a store)
        path = fs.write_bytes(f"{version_path(directory, version)}.json",
                              json.dumps(manifest, indent=1).encode())
        crash_point("export.published")  # see native.crash_points
    except BaseException:
        # the stores' delta sequences may have moved past what is published: the next
        # call starts a new lineage rather than publish a version with a hole
        mine.pop(directory, None)
        raise
    finally:
        if remote:
            shutil.rmtree(root, ignore_errors=True)
    state[1] = version
    return {"version": version, "manifest": path, "deltas": deltas, "dense": dense,
            "lineage": lineage}


def mirror_export(source: str, local: str) -> bool:
    """Bring ``local``, a local copy of the object-store export ``source``, up to date the way
    a local export directory changes, so that followers (:class:`Predictor`,
    :class:`trainer.live.LiveModel`) read it as one: a new full export (a new generation of
    its ``_MANIFEST.json``) replaces the copy whole; then every version published since, of
    the copy's lineage, is downloaded, its files first and its manifest last. A version of
    another lineage is a leftover a new export is removing: the round stops there. Returns
    whether anything was copied; raises :class:`compression.fs.StorageError` when the store
    fails (a version a new export removed meanwhile: the next round finds the new export)."""
    published = fs.published_manifest(source)
    if published is None or "export.json" not in published["files"]:
        return False
    marker = os.path.join(local, ".generation")  # which generation the copy holds
    try:
        with open(marker) as f:
            generation = f.read()
    except FileNotFoundError:
        generation = None
    changed = False
    if generation != published["generation"]:
        tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            fs.download_published(source, tmp)
            with open(os.path.join(tmp, ".generation"), "w") as f:
                f.write(published["generation"])
            os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
            replace_directory(tmp, local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        changed = True
    lineage = read_lineage(local)
    have = published_versions(local)
    for number in published_versions(source):
        if have and number <= have[-1]:
            continue
        data = fs.read_bytes(f"{version_path(source, number)}.json")
        try:
            manifest = json.loads(data)
            names = [*(p for paths in manifest["deltas"].values() for p in paths),
                     manifest["dense"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            names = []  # damaged: copied as it is, for the follower to refuse
        else:
            if manifest.get("lineage") != lineage:
                break
        for name in names:
            fs.download_file(fs.join(source, name), os.path.join(local, name))
        fs.write_bytes(f"{version_path(local, number)}.json", data)
        changed = True
    return changed


def read_version_manifest(directory: str, version: int) -> dict:
    """Version ``version``'s manifest, checked: ValueError naming the file if it is damaged."""
    path = f"{version_path(directory, version)}.json"
    with open(path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: damaged version manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("version") != version or not isinstance(
            manifest.get("deltas"), dict) or not isinstance(manifest.get("dense"), str):
        raise ValueError(f"{path}: not a version manifest of version {version}")
    return manifest


def serving_budgets(directory: str, config: TrainConfig, tables, shards: int | None,
                    memory_budget: int) -> dict[str, int]:
    """``memory_budget`` over the export's tables in proportion to the bytes of their
    snapshots (so each table keeps the same share of its rows in memory: a big table does
    not get a small one's share); a table whose share is below one row per store shard gets
    that, and the others share the rest."""
    sizes = {}
    for table in tables:
        parts = ([os.path.join(directory, "stores", table, f"shard-{i:04d}") for i in
                  range(shards)] if shards else [os.path.join(directory, "stores", table)])
        sizes[table] = sum(os.path.getsize(os.path.join(p, "store.snapshot")) for p in parts
                           if os.path.exists(os.path.join(p, "store.snapshot")))
    least = {t: tiers.min_budget(config.table(t).dim, config.table(t).optimizer) * (shards or 1)
             for t in tables}
    if memory_budget < sum(least.values()):
        raise ConfigError(
            f"--memory-budget {tiers.format_size(memory_budget)} cannot hold one row per store "
            f"shard of every table; raise it to at least "
            f"{tiers.format_size(sum(least.values()))}")
    out, rest, left = {}, list(tables), memory_budget
    while True:  # tables whose share is below their least get it, the rest share what is left
        total = sum(sizes[t] for t in rest) or 1
        small = [t for t in rest if left * sizes[t] // total < least[t]]
        if not small:
            out.update({t: left * sizes[t] // total for t in rest})
            return out
        for t in small:
            out[t] = least[t]
            left -= least[t]
            rest.remove(t)


def load_export_stores(directory: str, config: TrainConfig, tables, shards: int | None,
                       memory_budget: int | None = None, tier_dir: str | None = None,
                       formats: dict | None = None) -> dict:
    """Every table's store of the export in ``directory`` (a :class:`ShardedStore` for a
    sharded export). With ``memory_budget`` (bytes, for the whole model) the stores load
    into budgets: split over the tables in proportion to their snapshots' bytes
    (:func:`serving_budgets`; the training config's own budgets do not apply to serving) and
    over each table's shards, the rows
    beyond them on local disk under ``tier_dir/<table>`` (default: a temporary directory
    removed at exit). A budget too small names ``--memory-budget`` and the size it needs.

    ``formats``: each table's export format (:func:`export_formats`; default float32): a
    quantized table loads into a :class:`native.QuantizedStore` (memory budgets apply to
    float32 tables only: with ``memory_budget`` a quantized table is a ConfigError)."""
    formats = formats or {}
    quantized = {t: formats[t] for t in tables if formats.get(t, "float32") != "float32"}
    if quantized and memory_budget is not None:
        table, export_format = next(iter(quantized.items()))
        raise ConfigError(f"--memory-budget applies to exports of float32 tables only; table "
                          f"{table} of {directory} is exported as {export_format} (its rows "
                          "stay quantized in memory, a fraction of float32's): serve it "
                          "without --memory-budget")

    def load(table: str, path: str, config):
        if table in quantized:
            store = native.QuantizedStore.load(path)
            if store.format != quantized[table]:
                raise ValueError(f"{path}: holds {store.format} rows, export.json names "
                                 f"{quantized[table]}")
            return store
        return tiers.load_store(path, config)

    configs = {t: None for t in tables}
    if memory_budget is not None:
        serving = config.with_table_budgets(
            serving_budgets(directory, config, tables, shards, int(memory_budget)))
        tier_dir = tier_dir or tiers.temporary_tier_dir()
        try:
            if shards:
                configs = {t: [serving.store_configs(tables, tier_dir, shards, index=i)[t]
                               for i in range(shards)] for t in tables}
            else:
                configs = serving.store_configs(tables, tier_dir)
        except ConfigError as e:
            raise ConfigError(f"--memory-budget {tiers.format_size(int(memory_budget))}: "
                              f"{e}") from None
    if shards:
        return {t: ShardedStore([
            load(t, os.path.join(directory, "stores", t, f"shard-{i:04d}"),
                 configs[t][i] if configs[t] else None)
            for i in range(shards)]) for t in tables}
    return {t: load(t, os.path.join(directory, "stores", t), configs[t]) for t in tables}


class Predictor:
    """Scores raw samples with an export directory's SavedModel and embedding snapshots;
    with ``memory_budget`` (bytes) its stores keep about that much in memory and the rest
    on local disk under ``tier_dir`` (see :func:`load_export_stores`)."""

    def __init__(self, directory: str | os.PathLike, batch_size: int = 4096, *,
                 memory_budget: int | None = None, tier_dir: str | None = None):
        self.directory = self.source = os.fspath(directory)
        if not fs.is_local(self.source):  # a local copy (mirror_export) of the published one
            self.directory = self._download(self.source)
        path = os.path.join(self.directory, "export.json")
        try:
            with open(path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.directory}: not a trainer export (export.json "
                                    "missing); write one with Trainer.export") from None
        if meta.get("version") != EXPORT_VERSION:
            raise ValueError(f"{path}: export version {meta.get('version')}, this Predictor "
                             f"reads version {EXPORT_VERSION}")
        self.schema = schemas.from_dict(meta["schema"])
        self.config = TrainConfig.from_dict(meta["config"])
        tables = self.config.check(self.schema)
        dims = {t: self.config.table(t).dim for t in tables}
        poolings = {f.name: self.config.feature(f.name).pooling for f in self.schema.features
                    if f.kind != "dense"}
        self.layout = Layout(self.schema, tables, dims, poolings, dict(self.config.dense),
                             self.config.compact_tables(tables))
        self.builder = FeedBuilder(self.layout, structured=True)
        self.shards = meta.get("shards")  # a sharded (distributed) run's export
        self.export_formats = export_formats(meta, tables)
        self.stores = load_export_stores(self.directory, self.config, tables, self.shards,
                                         memory_budget, tier_dir, self.export_formats)
        self.model = tf.saved_model.load(os.path.join(self.directory, "saved_model"))
        self.batch_size = batch_size
        self.heads = meta["heads"]   # probability columns, in the model's order
        self.dense_step = meta["step"]
        self.lineage = meta.get("lineage")
        self.version = 0  # of the lineage: the full export

    def _download(self, uri: str) -> str:
        self._local_copy = tempfile.TemporaryDirectory(prefix="prefixrec-predictor-")
        local = os.path.join(self._local_copy.name, "export")
        if not mirror_export(uri, local):
            raise FileNotFoundError(f"{uri}: not a trainer export (no {fs.MANIFEST} naming "
                                    "export.json); write one with Trainer.export")
        return local

    def _update_dense(self) -> None:
        path = os.path.join(self.directory, "dense.npz")
        if os.path.exists(path) and _dense_step(path) > self.dense_step:
            self._set_dense(path)

    def predict(self, samples) -> np.ndarray:
        """Probabilities for raw samples (a pyarrow Table, a list of row dicts, or raw files),
        in their order: float32[n] for a one-head model, [n, heads] otherwise."""
        if isinstance(samples, (str, os.PathLike)):
            samples = compression.read_raw(os.fspath(samples), self.schema)
        table = request_table(samples, self.schema)
        outputs = []
        for start in range(0, table.num_rows, self.batch_size):
            batch = one_node_per_sample(table.slice(start, self.batch_size), self.schema)
            feed = self.builder.lookup(self.builder.prepare(batch), self.stores, train=False)
            probabilities = self.model.predict(tf.nest.map_structure(tf.convert_to_tensor,
                                                                     feed.feed))
            outputs.append(np.stack([probabilities[h].numpy() for h in self.heads], axis=1))
        if not outputs:
            return np.zeros(0, np.float32)
        out = np.concatenate(outputs)
        return out[:, 0] if out.shape[1] == 1 else out

    def update(self, delta_root: str | os.PathLike | None = None) -> int:
        """Apply what the trainer published since: by default the export's versions
        (:func:`export_increment`), in order, each one's deltas and dense weights; with
        ``delta_root``, every delta not applied yet from ``delta_root/<table>/`` (written by
        ``Trainer.export_delta``). Returns the number of delta files applied. A version of
        another lineage (the trainer started a new full export) raises ValueError: load a new
        Predictor (``trainer.serve`` does it by itself)."""
        if delta_root is not None:
            return self._apply_delta_tree(os.fspath(delta_root))
        if self.source != self.directory:  # on an object store: through the local copy
            mirror_export(self.source, self.directory)
        versions = [v for v in published_versions(self.directory) if v > self.version]
        if not versions:  # an export of the older layout: deltas/ and dense.npz
            self._update_dense()
            return self._apply_delta_tree(os.path.join(self.directory, "deltas"))
        applied = 0
        for version in versions:
            if version != self.version + 1:
                raise ValueError(f"{self.directory}: version {self.version + 1} is missing "
                                 f"(found {version}); load the export again")
            manifest = read_version_manifest(self.directory, version)
            if manifest["lineage"] != self.lineage:
                raise ValueError(f"{self.directory}: version {version} belongs to lineage "
                                 f"{manifest['lineage']}, this Predictor holds {self.lineage}; "
                                 "load the export again")
            for table, store in self.stores.items():
                shards = store.shards if isinstance(store, ShardedStore) else [store]
                paths = manifest["deltas"][table]
                if len(paths) != len(shards):
                    raise ValueError(f"{self.directory}: version {version} has {len(paths)} "
                                     f"delta files for table {table}, the export {len(shards)}")
                for shard, path in zip(shards, paths):
                    shard.apply_delta(os.path.join(self.directory, path))
                    applied += 1
            self._set_dense(os.path.join(self.directory, manifest["dense"]))
            self.version = version
        return applied

    def _set_dense(self, path: str) -> None:
        with np.load(path) as arrays:
            for i, variable in enumerate(self.model.variables_):
                variable.assign(arrays[dense_name("model", i)])
            self.dense_step = int(arrays["step"])

    def _apply_delta_tree(self, delta_root: str) -> int:
        applied = 0
        for table, store in self.stores.items():
            if isinstance(store, ShardedStore):  # deltas/<table>/shard-NNNN/delta-*.bin
                for i, shard in enumerate(store.shards):
                    applied += _apply_deltas(shard, os.path.join(delta_root, table,
                                                                 f"shard-{i:04d}"))
            else:
                applied += _apply_deltas(store, os.path.join(delta_root, table))
        return applied


class ShardedStore:
    """The stores of one table's shards read as one (a distributed run's export): an id is
    looked up on shard ``mix64(id) % len(shards)``, as in training
    (:func:`schemas.hashing.id_shards`)."""

    def __init__(self, shards: list):
        self.shards = shards
        self.dim = shards[0].dim

    def lookup_unique(self, ids, train: bool = False):
        """``(unique_ids, inverse, rows)`` as ``EmbeddingStore.lookup_unique``; never
        trains."""
        if train:
            raise ValueError("a serving store does not train")
        unique, inverse = np.unique(np.asarray(ids, np.int64), return_inverse=True)
        rows = np.empty((len(unique), self.dim), np.float32)
        owner = id_shards(unique, len(self.shards))
        for s, store in enumerate(self.shards):
            pos = np.flatnonzero(owner == s)
            rows[pos] = store.lookup(unique[pos], train=False)
        return unique, inverse.reshape(-1), rows

    def lookup(self, ids, train: bool = False) -> np.ndarray:
        _, inverse, rows = self.lookup_unique(ids, train)
        return rows[inverse]

    def contains(self, ids) -> np.ndarray:
        """Whether each id has a row on its shard."""
        ids = np.asarray(ids, np.int64)
        out = np.zeros(len(ids), bool)
        owner = id_shards(ids, len(self.shards))
        for s, store in enumerate(self.shards):
            pos = np.flatnonzero(owner == s)
            out[pos] = store.contains(ids[pos])
        return out

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def stats(self):
        """The shards' counters summed (:class:`native.StoreStats`; global step and delta
        sequence: the largest)."""
        parts = [s.stats().as_dict() for s in self.shards]
        return native.StoreStats(**{k: (max if k in ("global_step", "delta_sequence") else sum)(
            p[k] for p in parts) for k in parts[0]})


def _apply_deltas(store, directory: str) -> int:
    """Apply, in order, the deltas in ``directory`` newer than ``store``'s; their number."""
    current = store.stats().delta_sequence
    found = []
    for path in glob.glob(os.path.join(directory, "delta-*.bin")):
        match = _DELTA.search(path)
        if match and int(match.group(1)) > current:
            found.append((int(match.group(1)), path))
    for _, path in sorted(found):
        store.apply_delta(path)
    return len(found)


def _dense_step(path: str) -> int:
    with np.load(path) as arrays:
        return int(arrays["step"])


def request_table(samples, schema) -> pa.Table:
    """Samples to score (a pyarrow Table or a list of row dicts) checked against ``schema``
    and in its canonical types; labels may be left out. Raises
    :class:`compression.RawDataError` naming the row and column of a bad value."""
    if isinstance(samples, list):
        samples = _table_of_rows(samples, schema)
    for label in schema.labels:  # serving samples have no labels yet
        if label not in samples.column_names:
            samples = samples.append_column(label, pa.array(np.zeros(samples.num_rows,
                                                                     np.float32)))
    return compression.validate_raw(samples, schema)


def request_tree(root: dict, candidates: list, schema) -> TreeRequest:
    """A ranking request (the root layer's features once, the candidates' features of the
    layers below), checked as :func:`request_table` checks samples: the root's columns once,
    the candidates' row by row. Nothing is repeated per candidate."""
    root_names = [f.name for f in schema.layers[0].features]
    below = [f.name for layer in schema.layers[1:] for f in layer.features]
    top = _table_of_rows([root], schema, root_names, "root")
    rest = _table_of_rows(candidates, schema, below, "candidate")
    clash = set(root_names) & set(rest.column_names)
    if clash:
        name = sorted(clash)[0]
        i = next(i for i, candidate in enumerate(candidates) if name in candidate)
        raise compression.RawDataError(
            f"candidate {i}: {name!r} is a feature of the root layer "
            f"{schema.layers[0].name!r}; give it once, in the request's root")
    for name in top.column_names:
        if name not in root_names:
            raise compression.RawDataError(
                f"root: {name!r} is not a feature of the root layer {schema.layers[0].name!r}"
                f" ({', '.join(root_names)}); give the other layers' features in each "
                "candidate")
    for name in rest.column_names:
        if name not in below and name not in schema.labels:
            i = next(i for i, candidate in enumerate(candidates) if name in candidate)
            raise compression.RawDataError(
                f"candidate {i}: unexpected column {name!r}: not a feature of the schema "
                f"{schema.name!r} below its root layer")
    return TreeRequest(compression.validate_features(top, schema, root_names, "root"),
                       compression.validate_features(rest, schema, below, "candidate"))


def _table_of_rows(rows: list, schema, required=None, what: str = "sample") -> pa.Table:
    """Row dicts as a table, column by column, so a value of the wrong kind is named by its
    sample (0-based, as in the request) and column. ``required``: the feature names each row
    must hold (default: every feature)."""
    types = schema.raw_arrow_schema()
    try:  # the fast path: Arrow reads the rows in C++, inferring each column's type
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        table = None  # a value of the wrong kind: found and named column by column below
    if table is not None:
        names = table.column_names
        keys = set()
        for row in rows:  # Arrow takes the columns from the first row and drops other keys
            keys.update(row)
        if len(keys) > len(names):
            table = None
    if table is not None:
        columns = [_typed(table.column(n), types, n) for n in names]
    else:
        names = list(dict.fromkeys(name for row in rows for name in row))
        columns = [_typed_column([row.get(name) for row in rows], name, schema, types, what)
                   for name in names]
    if required is None:
        required = [f.name for f in schema.features]
    missing = [n for n in required if n not in names]
    if missing:
        raise compression.RawDataError(
            f"{what} 0: column {missing[0]!r} missing: the schema {schema.name!r} needs "
            f"every feature of every layer in each sample")
    table = pa.table(dict(zip(names, columns))) if names else pa.table({})
    for name in names:  # a key some samples lack arrives as null (unknown ones: refused later)
        column = table.column(name)
        if column.null_count and name not in schema.labels and name in types.names:
            i = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise compression.RawDataError(f"{what} {i}: column {name!r} missing or null")
    return table


def _typed(column, types, name: str):
    """An inferred column with nothing to infer from (all nulls, or lists empty in every
    sample) in the schema's type; any other as inferred (a float where an id belongs stays a
    float, for validation to refuse: Arrow would truncate it if asked for int64)."""
    if name in types.names and (pa.types.is_null(column.type) or (
            pa.types.is_list(column.type) and pa.types.is_null(column.type.value_type))):
        return column.cast(types.field(name).type)
    return column


def _typed_column(values: list, name: str, schema, types, what: str):
    """One column of row values; a value of the wrong kind is named by its row."""
    try:
        return _typed(pa.array(values), types, name)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    feature = next((f for f in schema.features if f.name == name), None)
    want = ("a list" if feature is not None and feature.kind != "id" else
            "a string" if feature is not None and feature.dtype == "string" else
            "a number" if name in schema.labels else "an integer")
    first = next((v for v in values if v is not None), None)
    bad = 0
    for i, value in enumerate(values):  # the first value that does not go with the first
        try:
            pa.array([first, value])
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            bad = i
            break
    raise compression.RawDataError(
        f"{what} {bad}: column {name!r} is {values[bad]!r} ({type(values[bad]).__name__}); "
        f"expected {want} (64-bit for integers)")


def one_node_per_sample(table: pa.Table, schema) -> TreeBatch:
    """A batch of validated raw samples in which every layer has one node per sample (parent
    i -> i): the samples keep their order and no grouping work is done at serving time."""
    n = table.num_rows
    identity = np.arange(n, dtype=np.int32)
    layers = []
    for level, layer in enumerate(schema.layers):
        layers.append(LayerBatch(layer.name, n, None if level == 0 else identity, {
            f.name: feature_array(table.column(f.name), f) for f in layer.features}))
    labels = {label: table.column(label).to_numpy().astype(np.float32, copy=False)
              for label in schema.labels}
    return TreeBatch(layers, labels)
