"""A served model that follows an export directory version by version (``trainer.serve``'s core).

    model = LiveModel("export/")           # the full export: lineage L, version 0
    probabilities, version = model.predict(samples)          # flat: one tree per sample
    probabilities, version = model.predict_tree(user, ads)   # one user's part computed once
    kind, probabilities, version = model.predict_request(body)  # trainer.serve's JSON body
    model.poll()                           # apply what the trainer published since

**One version per answer.** Every answer is computed on exactly one published version: all
tables and the dense weights of one manifest (:mod:`trainer.serving`). A request *pins* the
current version for its whole computation; the follower never changes what a pinned version
reads:

- version N+1 is served as "the stores + N+1's deltas": each table's delta is read (checked as
  ``apply_delta`` checks it) into an overlay (the rows it changes, the ids it removes), which
  lookups of N+1 apply over the stores' answers;
- the deltas are applied to the stores themselves only once no request pins a version older
  than N+1 (N+1's overlay keeps covering every row they change meanwhile);
- dense weights alternate between two copies of the SavedModel: N+1's go into the copy no
  pinned version uses.

So applying a version never blocks requests (no lock is held while rows are copied) and costs
the memory of one delta, not of a second model. A gap in the version numbers, a damaged or
foreign manifest, or a delta the stores refuse is never applied: the model keeps answering on
the last good version and says why it is not ready (:attr:`problem`) until the export directory
holds a version it can apply or a new full export (a new lineage).

**Object stores.** ``LiveModel("s3://bucket/export")`` follows a local copy of the export that
every :meth:`poll` first brings up to date (:func:`trainer.serving.mirror_export`: a new full
export replaces the copy whole, a version's files are copied before its manifest), then reads
it as a local export directory: the same checks, the same one version per answer.

**A new full export is a rebase, not a second model.** When the export directory holds a new
lineage of the same model (same schema, config, tables, heads and sharding: a trainer restarted
from an older checkpoint, another writer, a SIGHUP reload), the stores stream its snapshots and
write, table by table, a *rebase delta*: the snapshot rows that differ from the served rows and
the ids the snapshot lacks (``EmbeddingStore.write_rebase_delta``). It is served as version 0
of the new lineage exactly as a published version is (an overlay over the stores, dense weights
into the free SavedModel copy) and reaches the stores once no request reads them without it.
The reload costs the rows that differ, not a second copy of the model. Only an export of
another model (another schema, config or architecture) is loaded beside the served one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

import schemas
from compression import TreeBatch
from compression.fs import StorageError, is_local
from trainer.checkpoints import dense_name
from trainer.config import TrainConfig
from trainer.feed import FeedBuilder, Layout
from trainer.network import dummy_feed
from trainer.requests import BadRequest, RequestBody, decode_request, scan_request
from trainer.serving import (EXPORT_VERSION, ShardedStore, export_formats, load_export_stores,
                             mirror_export, one_node_per_sample, published_versions, read_lineage,
                             read_version_manifest, request_table, request_tree, version_path)


class Overlay:
    """One table's pending version over its stores: per store, the rows its delta changes and
    the ids it removes (the delta's net effect, ids ascending as ``read_delta`` gives them; the
    shards' id sets are disjoint). Kept as read: no copy of a table-sized rebase."""

    def __init__(self, parts: list[dict]):
        self.parts = [(p["ids"], p["rows"], p["tombstones"]) for p in parts]

    def __len__(self) -> int:
        return sum(len(ids) + len(tombstones) for ids, _, tombstones in self.parts)

    def patch(self, unique: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``rows`` (of the sorted ``unique`` ids, as the store read them) as this version
        has them."""
        for ids, changed, tombstones in self.parts:
            if len(ids):
                at = np.minimum(np.searchsorted(ids, unique), len(ids) - 1)
                hit = ids[at] == unique
                rows[hit] = changed[at[hit]]
            if len(tombstones):
                at = np.minimum(np.searchsorted(tombstones, unique), len(tombstones) - 1)
                rows[tombstones[at] == unique] = 0.0  # a removed row reads as unseen
        return rows

    def present(self, ids: np.ndarray, held: np.ndarray) -> np.ndarray:
        """``held`` (whether the store has a row for each of ``ids``) as this version has it:
        a row the delta writes is there, one it removes is not."""
        held = np.array(held, bool)
        for changed, _, tombstones in self.parts:
            for found, value in ((tombstones, False), (changed, True)):
                if len(found):
                    at = np.minimum(np.searchsorted(found, ids), len(found) - 1)
                    held[found[at] == ids] = value
        return held


class VersionedTable:
    """A table as one version sees it: its store, then the version's overlay."""

    def __init__(self, store, overlay: Overlay | None):
        self.store, self.overlay = store, overlay

    def lookup_unique(self, ids, train: bool = False):
        if train:
            raise ValueError("a served table does not train")
        unique, inverse, rows = self.store.lookup_unique(ids, False)
        if self.overlay is not None and len(self.overlay):
            rows = self.overlay.patch(unique, rows)
        return unique, inverse, rows

    def contains(self, ids) -> np.ndarray:
        """Whether this version has a row for each id (a cold table's routing)."""
        ids = np.asarray(ids, np.int64)
        held = self.store.contains(ids)
        if self.overlay is not None and len(self.overlay):
            held = self.overlay.present(ids, held)
        return held


class Base:
    """What a full export loads: its description, stores and two SavedModel copies."""

    def __init__(self, directory: str, memory_budget: int | None = None,
                 tier_dir: str | None = None):
        path = os.path.join(directory, "export.json")
        try:
            with open(path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{directory}: not a trainer export (export.json missing); "
                                    "write one with trainer.train --export-dir or "
                                    "trainer.online --export-dir") from None
        if meta.get("version") != EXPORT_VERSION:
            raise ValueError(f"{path}: export version {meta.get('version')}, this server reads "
                             f"version {EXPORT_VERSION}")
        self.meta = meta
        self.lineage = meta.get("lineage")
        self.schema = schemas.from_dict(meta["schema"])
        self.config = TrainConfig.from_dict(meta["config"])
        tables = self.config.check(self.schema)
        dims = {t: self.config.table(t).dim for t in tables}
        poolings = {f.name: self.config.feature(f.name).pooling
                    for f in self.schema.features if f.kind != "dense"}
        unresolved = [n for n, c in dict(self.config.dense).items() if not c.resolved]
        if unresolved:
            raise ValueError(f"{path}: dense feature {unresolved[0]!r} has no statistics yet "
                             "(an export of a model that trained nothing); waiting for one "
                             "that trained")
        self.layout = Layout(self.schema, tables, dims, poolings, dict(self.config.dense),
                             self.config.compact_tables(tables))
        self.builder = FeedBuilder(self.layout, structured=True)
        self.shards = meta.get("shards")
        self.tables = tables
        self.export_formats = export_formats(meta, tables)
        self.stores = load_export_stores(directory, self.config, tables, self.shards,
                                         memory_budget, tier_dir, self.export_formats)
        saved = os.path.join(directory, "saved_model")
        self.slots = [tf.saved_model.load(saved), tf.saved_model.load(saved)]
        # the one concrete function of each copy, called directly: skips the dispatch that
        # matches a call to a trace (~1 ms of Python per request), and through its flat inputs
        self.predict_fns = [FlatPredict(slot.predict.concrete_functions[0])
                            for slot in self.slots]
        self.heads = list(meta["heads"])
        warm = dummy_feed(self.layout, True)
        for predict in self.predict_fns:  # run once before the first request
            predict(warm)

    def shard_stores(self, table: str) -> list:
        store = self.stores[table]
        return store.shards if isinstance(store, ShardedStore) else [store]

    def snapshot_dirs(self, directory: str, table: str) -> list[str]:
        """Where an export of this model keeps ``table``'s snapshots, one per store."""
        if self.shards:
            return [os.path.join(directory, "stores", table, f"shard-{i:04d}")
                    for i in range(self.shards)]
        return [os.path.join(directory, "stores", table)]

    def same_model(self, meta: dict) -> bool:
        """Whether the export described by ``meta`` is of this model (what a rebase needs:
        the same schema, config, dense statistics, tables, heads, network and sharding)."""
        keys = ("version", "schema", "config", "model", "tables", "heads", "shards",
                "export_formats")
        return all(meta.get(k) == self.meta.get(k) for k in keys)


class FlatPredict:
    """A SavedModel's ``predict`` concrete function called on a feed of numpy arrays through
    its flat-input entry point (as :class:`trainer.network.FlatCall` calls the trainer's): a
    structured call binds, checks and casts each of the feed's 18 tensors against the
    signature in Python first (~0.5 ms of a 500-candidate request's ~3 ms here). The feed
    builder makes every feed of the signature's structure and dtypes; the structure is still
    checked per call, and a TensorFlow without the flat entry point takes the structured
    call."""

    def __init__(self, function):
        self.function = function
        self.signature = function.structured_input_signature[0][0]
        self.specs = tf.nest.flatten(self.signature)
        self.flat = hasattr(function, "_call_flat") and not function.structured_input_signature[1]

    def __call__(self, feed):
        if not self.flat:
            return self.function(tf.nest.map_structure(tf.convert_to_tensor, feed))
        tf.nest.assert_same_structure(feed, self.signature)
        flat = [tf.convert_to_tensor(x, spec.dtype)
                for x, spec in zip(tf.nest.flatten(feed), self.specs)]
        return self.function._call_flat(flat, self.function.captured_inputs)


@dataclass
class Version:
    """One published version as served: the stores plus ``overlays``, dense weights in
    ``base.slots[slot]``."""

    base: Base
    number: int
    step: int
    slot: int
    overlays: dict = field(default_factory=dict)
    staged: list = field(default_factory=list)  # (store, private delta copy) to apply later
    newest_sample_time: float | None = None
    published_at: float | None = None
    applied_at: float = field(default_factory=time.time)
    readers: int = 0
    lineage: str | None = None  # the base's, unless a rebase moved it to another
    rebased: bool = False       # staged holds a rebase delta (the sequence changes with it)

    def __post_init__(self):
        if self.lineage is None:
            self.lineage = self.base.lineage

    def tables(self) -> dict:
        return {t: VersionedTable(s, self.overlays.get(t)) for t, s in self.base.stores.items()}

    def info(self) -> dict:
        """What an answer reports about the version that computed it."""
        return {"lineage": self.lineage, "version": self.number, "step": self.step,
                "newest_sample_time": self.newest_sample_time, "heads": self.base.heads}


@dataclass
class Decoded:
    """A request decoded for scoring: its body, the model whose schema decoded it, and its
    tree batches (:func:`trainer.requests.decode_request`, split at ``batch_size``)."""

    request: RequestBody
    base: Base
    trees: list

    def __len__(self) -> int:
        return len(self.request)


class LiveModel:
    """Answers on one published version at a time and follows the export directory.

    ``max_lag``: with it, :attr:`ready` also needs the freshness lag (now minus the newest
    sample trained into the served version) to be at most that many seconds."""

    def __init__(self, directory: str | os.PathLike, batch_size: int = 4096,
                 max_lag: float | None = None, *, memory_budget: int | None = None,
                 tier_dir: str | None = None):
        self.source = os.fspath(directory)  # the export as named (maybe s3://...)
        self.directory = None
        if is_local(self.source):
            self.source = self.directory = os.path.abspath(self.source)
        self.batch_size = batch_size
        self.max_lag = max_lag
        self.problem: str | None = None     # why the served version is not the newest
        self.applied = 0                    # versions applied
        self.failed = 0                     # versions (or full exports) refused
        self.reloads = 0                    # full exports loaded after the first
        self.last_apply_seconds: float | None = None
        self.last_reload: dict | None = None  # how the last full export was taken in
        self._failures: set = set()         # (lineage, version, reason) counted once
        self._cond = threading.Condition()
        self._retired: list[Version] = []   # replaced versions some request may still pin
        self._staging = tempfile.mkdtemp(prefix="prefixrec-serve-")
        self._current: Version | None = None
        # with a memory budget (bytes, the whole model's): the rows beyond it on local disk
        # under tier_dir (default: in the staging directory), each full export loaded into it
        self.memory_budget = memory_budget
        self.tier_dir = tier_dir or os.path.join(self._staging, "tiers")
        try:
            if self.directory is None:  # on an object store: follow a local copy of it
                self.directory = os.path.join(self._staging, "mirror", "export")
                try:
                    mirror_export(self.source, self.directory)
                except StorageError as e:
                    self.problem = str(e)
            try:
                self._current = self._load_full()
            except ValueError as e:  # an export it cannot serve: not ready until a better one
                self.problem = str(e)
        except BaseException:  # a failure or a signal: no staging directory left behind
            self.close()
            raise

    # -- answering -----------------------------------------------------------------------

    @property
    def version(self) -> Version | None:
        return self._current

    @property
    def ready(self) -> bool:
        if self._current is None or self.problem is not None:
            return False
        return self.max_lag is None or (self.freshness_lag() or 0.0) <= self.max_lag

    def freshness_lag(self, now: float | None = None) -> float | None:
        """Seconds from the newest sample trained into the served version to ``now``."""
        current = self._current
        if current is None or current.newest_sample_time is None:
            return None
        return (time.time() if now is None else now) - current.newest_sample_time

    @contextlib.contextmanager
    def pinned(self):
        """The current version, kept whole until the block ends."""
        with self._cond:
            version = self._current
            if version is None:
                raise RuntimeError(f"{self.directory}: no model loaded yet ({self.problem})")
            version.readers += 1
        try:
            yield version
        finally:
            with self._cond:
                version.readers -= 1
                if version.readers == 0:
                    self._cond.notify_all()

    def predict(self, samples) -> tuple[np.ndarray, dict]:
        """Probabilities ``float32[n, heads]`` for raw samples (a pyarrow Table or a list of
        row dicts), in their order, each scored as its own tree, and the version's
        :meth:`Version.info`. Raises :class:`compression.RawDataError` naming the row and
        column of a bad sample."""
        with self.pinned() as version:
            table = request_table(samples, version.base.schema)
            out = self._score(version, [one_node_per_sample(table.slice(s, self.batch_size),
                                                            version.base.schema)
                                        for s in range(0, table.num_rows, self.batch_size)])
            return out, version.info()

    def predict_tree(self, root: dict, candidates: list[dict]) -> tuple[np.ndarray, dict]:
        """A ranking request: ``root`` holds the root layer's features once (the user's),
        every candidate the features of the layers below; probabilities
        ``float32[len(candidates), heads]`` in the candidates' order. The root's part of the
        network runs once for all candidates (structured compute); the answers equal
        :meth:`predict` on the flat samples ``{**root, **candidate}`` up to float rounding."""
        with self.pinned() as version:
            schema = version.base.schema
            request = request_tree(root, candidates, schema)
            return self._score(version, [
                request.batch(schema, s, s + self.batch_size)
                for s in range(0, len(request), self.batch_size)]), version.info()

    def predict_request(self, request: RequestBody | bytes) -> tuple[str, np.ndarray, dict]:
        """A request body of ``trainer.serve`` (bytes, or scanned by
        :func:`trainer.requests.scan_request`), decoded by the native JSON decoders with the
        pinned version's schema and scored on that version: ``(kind, probabilities
        float32[n, heads] in the request's order, Version.info())``, kind ``"samples"`` (each
        scored as its own tree, as :meth:`predict`) or ``"tree"`` (the root once, as
        :meth:`predict_tree`). Raises :class:`trainer.requests.BadRequest` naming the sample
        (candidate, the root) and field of a refused request."""
        if not isinstance(request, RequestBody):
            request = scan_request(bytes(request))
        with self.pinned() as version:
            schema = version.base.schema
            decoded = decode_request(request, schema)
            if request.kind == "samples":
                batches = [one_node_per_sample(decoded.slice(s, self.batch_size), schema)
                           for s in range(0, decoded.num_rows, self.batch_size)]
            else:
                batches = [decoded.batch(schema, s, s + self.batch_size)
                           for s in range(0, len(decoded), self.batch_size)]
            return request.kind, self._score(version, batches), version.info()

    def decode(self, request: RequestBody | bytes) -> "Decoded":
        """A request body decoded with the served version's schema, ready to be queued for
        :meth:`predict_decoded`. Raises :class:`trainer.requests.BadRequest` as
        :meth:`predict_request` does (503 before a model is loaded)."""
        if not isinstance(request, RequestBody):
            request = scan_request(bytes(request))
        version = self._current
        if version is None:
            raise BadRequest(f"no model loaded yet: {self.problem}", status=503)
        return Decoded(request, version.base, self._trees(request, version.base.schema))

    def _trees(self, request: RequestBody, schema) -> list:
        """The request decoded as tree batches of at most ``batch_size`` leaves."""
        decoded = decode_request(request, schema)
        if request.kind == "samples":
            return [one_node_per_sample(decoded.slice(s, self.batch_size), schema)
                    for s in range(0, decoded.num_rows, self.batch_size)]
        return [decoded.batch(schema, s, s + self.batch_size)
                for s in range(0, len(decoded), self.batch_size)]

    def predict_decoded(self, requests: list["Decoded"]) -> list:
        """Decoded requests scored together on one pinned version: per request ``(kind,
        probabilities float32[n, heads], Version.info())`` as :meth:`predict_request` answers
        it, or the :class:`BadRequest` that refuses it alone (decoded on a model whose schema
        the pinned one does not share, and refused by that one). Consecutive requests are
        joined into one tree batch of at most ``batch_size`` samples (a ranking request's root
        stays one node); a larger request is split as :meth:`predict_request` splits it."""
        with self.pinned() as version:
            schema = version.base.schema
            results: list = [None] * len(requests)
            trees = []  # (request index, its TreeBatch pieces)
            for i, d in enumerate(requests):
                pieces = d.trees
                if d.base is not version.base and d.base.schema != schema:
                    try:  # another model took over since it was decoded
                        pieces = self._trees(d.request, schema)
                    except BadRequest as e:
                        results[i] = e
                        continue
                trees.append((i, pieces))
            groups, group, size = [], [], 0  # whole requests joined up to batch_size leaves
            for i, pieces in trees:
                n = sum(p.num_leaves for p in pieces)
                if group and (len(pieces) > 1 or size + n > self.batch_size):
                    groups.append(group)
                    group, size = [], 0
                group.append((i, pieces))
                size += n
                if len(pieces) > 1:
                    groups.append(group)
                    group, size = [], 0
            if group:
                groups.append(group)
            info = version.info()
            for group in groups:
                if len(group) == 1:
                    out = self._score(version, group[0][1])
                else:
                    out = self._score(version, [TreeBatch.concat([g[1][0] for g in group])])
                at = 0
                for i, pieces in group:
                    n = sum(p.num_leaves for p in pieces)
                    results[i] = (requests[i].request.kind, out[at:at + n], info)
                    at += n
            return results

    def _score(self, version: Version, batches) -> np.ndarray:
        base = version.base
        tables = version.tables()
        predict = base.predict_fns[version.slot]
        outputs = []
        for batch in batches:
            feed = base.builder.lookup(base.builder.prepare(batch), tables, train=False)
            probabilities = predict(feed.feed)
            outputs.append(np.stack([probabilities[h].numpy() for h in base.heads], axis=1))
        if not outputs:
            return np.zeros((0, len(base.heads)), np.float32)
        return np.concatenate(outputs)

    # -- following ------------------------------------------------------------------------

    def poll(self, reload: bool = False) -> int:
        """Apply, in order, every version published since (or load a new full export; with
        ``reload``, load the full export even of the served lineage); returns the number of
        versions applied. Never raises for what it finds in the export
        directory: a problem is kept in :attr:`problem` (and counted in :attr:`failed`) and
        the served version stays."""
        if self.source != self.directory:  # an object store: its local copy up to date first
            try:
                mirror_export(self.source, self.directory)
            except StorageError as e:  # unreachable, or a version removed while copied
                self.problem = str(e)
                return 0
        lineage = read_lineage(self.directory)
        current = self._current
        if lineage is None:
            what = ("export.json missing" if not os.path.exists(
                os.path.join(self.directory, "export.json")) else "export.json has no lineage")
            # not a refused version: a writer replacing the directory passes through this
            self.problem = f"{self.directory}: {what}; waiting for a full export"
            return 0
        if current is None or lineage != current.lineage or reload:
            started = time.monotonic()
            try:
                loaded = self._rebase(current) if current is not None else None
                if loaded is None:  # nothing served yet, or an export of another model
                    loaded = self._load_full()
                    if current is not None:
                        self.last_reload = {"mode": "full", "lineage": loaded.lineage}
            except Exception as e:  # a half-written or damaged export: keep the old one
                self._refuse(lineage, 0, f"full export of lineage {lineage}: {e}")
                return 0
            self._swap(loaded)
            if current is not None:
                self.reloads += 1
                self.last_reload["seconds"] = round(time.monotonic() - started, 4)
            current = loaded
        applied = 0
        while True:
            number = current.number + 1
            path = f"{version_path(self.directory, number)}.json"
            if not os.path.exists(path):
                later = [v for v in published_versions(self.directory) if v > number]
                if later:
                    self._refuse(lineage, number, f"version {number} is missing but "
                                 f"{later[0]} is published (a gap); waiting for a new full "
                                 "export")
                else:
                    self.problem = None
                return applied
            started = time.monotonic()
            try:
                following = self._prepare(current, read_version_manifest(self.directory, number))
            except Exception as e:  # damaged, foreign or refused: never applied
                self._refuse(lineage, number, f"version {number}: {e}")
                return applied
            self._swap(following)
            self.last_apply_seconds = time.monotonic() - started
            self.applied += 1
            applied += 1
            current = following

    def follow(self, interval: float, stop: threading.Event) -> None:
        """``poll`` every ``interval`` seconds until ``stop`` is set (a thread's loop)."""
        while not stop.is_set():
            self.poll()
            stop.wait(interval)

    def close(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)

    def _refuse(self, lineage, number: int, reason: str) -> None:
        self.problem = reason
        key = (lineage, number, reason)
        if key not in self._failures:
            self._failures.add(key)
            self.failed += 1

    def _load_full(self) -> Version | None:
        if self._current is None and not os.path.exists(
                os.path.join(self.directory, "export.json")):
            self.problem = f"{self.directory}: export.json missing; waiting for an export"
            return None
        base = Base(self.directory, self.memory_budget, self.tier_dir)
        return Version(base, 0, int(base.meta["step"]), 0,
                       published_at=base.meta.get("published_at"))

    def _drain(self, keep: Version | None) -> None:
        """Wait until no request pins a version other than ``keep``."""
        with self._cond:
            while any(v.readers for v in self._retired if v is not keep):
                self._cond.wait()
            self._retired = [v for v in self._retired if v is keep]

    def _swap(self, following: Version) -> None:
        with self._cond:
            if self._current is not None and self._current.base is following.base:
                self._retired.append(self._current)
            self._current = following
        self.problem = None

    def _settle(self, current: Version) -> None:
        """``current``'s staged deltas into the stores (once no request reads the stores
        without ``current``'s overlay): the stores then hold exactly ``current``."""
        self._drain(keep=current)
        for store, copy in current.staged:
            store.apply_delta(copy)
            os.remove(copy)
        current.staged = []
        current.rebased = False

    def _rebase(self, current: Version) -> Version | None:
        """The full export in the directory as version 0 of its lineage, served as the stores
        plus a rebase overlay (see the module's docstring); None when it is an export of
        another model, which must be loaded whole."""
        base = current.base
        path = os.path.join(self.directory, "export.json")
        with open(path) as f:
            meta = json.load(f)
        if not base.same_model(meta):
            return None
        lineage = meta.get("lineage")
        saved = os.path.join(self.directory, "saved_model", "variables", "variables")
        reader = tf.train.load_checkpoint(saved)
        slot_index = 1 - current.slot
        slot = base.slots[slot_index]
        arrays = []
        for i, variable in enumerate(slot.variables_):
            key = f"variables_/{i}/.ATTRIBUTES/VARIABLE_VALUE"
            if not reader.has_tensor(key):
                raise ValueError(f"{saved}: dense variable {i} missing")
            value = reader.get_tensor(key)
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(f"{saved}: dense variable {i} has shape {value.shape}, the "
                                 f"served model {tuple(variable.shape)}")
            arrays.append(value)
        # the stores must hold exactly the served version before they are compared
        self._settle(current)
        folder = os.path.join(self._staging, f"{lineage}-rebase")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        staged, overlays = [], {}
        totals = {"rows": 0, "tombstones": 0, "unchanged": 0, "bytes": 0}
        try:
            for table in base.tables:
                parts = []
                for i, (store, snapshot) in enumerate(zip(
                        base.shard_stores(table), base.snapshot_dirs(self.directory, table))):
                    copy = os.path.join(folder, f"{table}-{i:04d}.bin")
                    for k, v in store.write_rebase_delta(snapshot, copy).items():
                        totals[k] += v
                    parts.append(store.read_delta(copy))
                    staged.append((store, copy))
                overlays[table] = Overlay(parts)
            if read_lineage(self.directory) != lineage:
                raise ValueError("the export directory was replaced while it was read")
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._drain(keep=current)  # nothing pinned reads the free copy any more
        for variable, value in zip(slot.variables_, arrays):
            variable.assign(value)
        self.last_reload = {"mode": "rebase", "lineage": lineage, **totals}
        return Version(base, 0, int(meta["step"]), slot_index, overlays, staged,
                       meta.get("newest_sample_time"), meta.get("published_at"),
                       lineage=lineage, rebased=True)

    def _prepare(self, current: Version, manifest: dict) -> Version:
        """Version ``current.number + 1`` ready to serve; ``current``'s deltas applied to
        the stores on the way (once no request reads the stores without them)."""
        if manifest["lineage"] != current.lineage:
            raise ValueError(f"its manifest names lineage {manifest['lineage']}, the served "
                             f"export is lineage {current.lineage}")
        base = current.base
        number = manifest["version"]
        if current.rebased:  # the next deltas follow the rebase's sequence, not the stores'
            self._settle(current)
        # read and check everything first: a refused version changes nothing
        staged, overlays = [], {}
        folder = os.path.join(self._staging, f"{current.lineage}-{number:08d}")
        os.makedirs(folder, exist_ok=True)
        for table in base.stores:
            paths = manifest["deltas"].get(table)
            shards = base.shard_stores(table)
            if paths is None or len(paths) != len(shards):
                raise ValueError(f"table {table}: {0 if paths is None else len(paths)} delta "
                                 f"files, the export has {len(shards)} stores")
            parts = []
            for i, (store, path) in enumerate(zip(shards, paths)):
                copy = os.path.join(folder, f"{table}-{i:04d}.bin")
                shutil.copyfile(os.path.join(self.directory, path), copy)
                # the stores still lack current's deltas: this one comes one after them
                ahead = sum(1 for s, _ in current.staged if s is store)
                parts.append(store.read_delta(copy, ahead=ahead))
                staged.append((store, copy))
            overlays[table] = Overlay(parts)
        with np.load(os.path.join(self.directory, manifest["dense"])) as npz:
            arrays = {k: npz[k] for k in npz.files}
        slot_index = 1 - current.slot
        slot = base.slots[slot_index]
        names = [dense_name("model", i) for i in range(len(slot.variables_))]
        for name, variable in zip(names, slot.variables_):
            if name not in arrays or tuple(arrays[name].shape) != tuple(variable.shape):
                raise ValueError(f"{manifest['dense']}: {name} missing or of another shape")
        # current's deltas into the stores, once no request reads them without the overlay
        self._settle(current)
        for name, variable in zip(names, slot.variables_):  # the copy no pinned version uses
            variable.assign(arrays[name])
        return Version(base, number, int(manifest["step"]), slot_index, overlays, staged,
                       manifest.get("newest_sample_time"), manifest.get("published_at"),
                       lineage=current.lineage)
