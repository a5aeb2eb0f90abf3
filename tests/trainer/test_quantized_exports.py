"""Quantized serving exports (README, "Smaller exports"): trainer.train --export-format, the
per-table export_format key, and the Predictor / LiveModel serving float16, int8 and int4
tables as stored, within the formats' bounds of the float32 export of the same model, following
quantized deltas and rebases as float32 ones."""
import json
import os

import numpy as np
import pyarrow as pa
import pytest
from commands import in_process
from trainer_data import SCHEMA_PATH

import compression
import native
import schemas
from native import quantized as q
from trainer import models
from trainer.config import ConfigError, TrainConfig
from trainer.live import LiveModel
from trainer.serving import Predictor, export_increment, restart_lineage
from trainer.trainer import Trainer

# -- config ---------------------------------------------------------------------------------


def test_export_format_is_checked_up_front_naming_the_table():
    with pytest.raises(ConfigError, match=r"tables\.cate\.export_format: 'int3' is not an "
                                          r"export format; use one of float32, float16, "
                                          r"int8, int4"):
        TrainConfig.from_dict({"tables": {"cate": {"export_format": "int3"}}})
    with pytest.raises(ConfigError, match=r"embedding\.export_format: 8"):
        TrainConfig.from_dict({"embedding": {"export_format": 8}})
    with pytest.raises(ConfigError, match="--export-format: 'fp8'"):
        TrainConfig().with_export_format("fp8")


def test_export_format_per_table_the_flag_over_it_and_float32_configs_unchanged():
    config = TrainConfig.from_dict({"embedding": {"export_format": "int8"},
                                    "tables": {"cate": {"export_format": "int4"},
                                               "user_id": {"dim": 8}}})
    assert [config.export_format(t) for t in ("cate", "user_id", "other")] == \
        ["int4", "int8", "int8"]
    assert TrainConfig.from_dict(config.to_dict()) == config
    flagged = config.with_export_format("float16")
    assert {flagged.export_format(t) for t in ("cate", "user_id", "other")} == {"float16"}
    assert config.with_export_format(None) is config
    plain = TrainConfig.from_dict({"tables": {"cate": {"dim": 4}}})
    assert "export_format" not in json.dumps(plain.to_dict())  # what it always wrote
    assert plain.export_format("cate") == "float32"


# -- a real trainer.train run ---------------------------------------------------------------

def write_split(schema, tmp_path):
    from trainer_data import generated

    raw = generated(schema, 3000, seed=21).drop_columns(["p_click", "p_conversion"])
    import pyarrow.parquet as pq

    pq.write_table(raw.slice(0, 2400), tmp_path / "train.parquet")
    pq.write_table(raw.slice(2400), tmp_path / "eval.parquet")
    return raw.slice(2400)


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantized-run")
    schema = schemas.load(SCHEMA_PATH)
    eval_raw = write_split(schema, tmp)
    config = tmp / "config.yaml"
    config.write_text("batch_size: 400\nthreads: 1\nembedding: {dim: 8}\n"
                      "tables: {cate_id: {export_format: int4}}\n")
    out = in_process("trainer.train", "--schema", SCHEMA_PATH, "--config", config,
                     "--train-data", tmp / "train.parquet", "--out", tmp / "run",
                     "--export-dir", tmp / "export-int8", "--export-format", "int8",
                     "--hidden", "16", "--no-progress")
    assert out.returncode == 0, out.stderr
    # the float32 export of the same model, and its exports in the other formats
    trainer = Trainer.restore(tmp / "run" / "checkpoint")
    exports = {"int8": tmp / "export-int8"}
    for export_format in ("float32", "float16", "int4"):
        trainer.config = trainer.config.with_export_format(export_format)
        exports[export_format] = trainer.export(tmp / f"export-{export_format}")
    return schema, eval_raw, exports


def test_the_flag_sets_every_table_and_is_recorded_per_table(int8_run):
    schema, _, exports = int8_run
    with open(os.path.join(exports["int8"], "export.json")) as f:
        meta = json.load(f)
    assert set(meta["export_formats"].values()) == {"int8"}  # over the config's int4
    for table in meta["tables"]:
        files = os.listdir(os.path.join(exports["int8"], "stores", table))
        assert files == [q.SNAPSHOT_FILE], files
    with open(os.path.join(exports["float32"], "export.json")) as f:
        assert set(json.load(f)["export_formats"].values()) == {"float32"}
    assert os.path.exists(os.path.join(exports["float32"], "stores", "cate_id",
                                       "store.snapshot"))


@pytest.mark.parametrize("export_format", ["float16", "int8", "int4"])
def test_a_quantized_export_serves_within_the_bound_of_the_float32_predictor(
        int8_run, export_format):
    schema, eval_raw, exports = int8_run
    whole = Predictor(exports["float32"])
    served = Predictor(exports[export_format])
    assert served.export_formats == {t: export_format for t in served.stores}
    for table, store in served.stores.items():
        assert isinstance(store, native.QuantizedStore) and store.format == export_format
        reference = whole.stores[table]
        ids = np.sort(reference.to_numpy()["ids"])
        assert len(store) == len(reference)
        probe = np.concatenate([ids, [ids.max() + 1, -12345]])  # unknown ids read zeros
        want = reference.lookup(probe, train=False)
        got = store.lookup(probe)
        assert (np.abs(got - want) <= q.error_bound(export_format, want)).all(), table
        assert not got[-2:].any()
        # rows kept as stored: a fraction of the float32 store's memory
        assert store.stats().bytes < reference.stats().bytes / 2
    samples = eval_raw.drop_columns(list(schema.labels))
    p32, pq_ = whole.predict(samples), served.predict(samples)
    # the embeddings move within their bound; the network maps that to small moves of the
    # probabilities (measured: float16 ~1e-5, int8 ~1e-4, int4 ~2e-3 on this model)
    tolerance = {"float16": 1e-3, "int8": 5e-3, "int4": 5e-2}[export_format]
    assert np.abs(p32 - pq_).max() < tolerance
    assert np.corrcoef(p32.ravel(), pq_.ravel())[0, 1] > 0.99


def test_memory_budgets_are_refused_for_a_quantized_export(int8_run, tmp_path):
    _, _, exports = int8_run
    with pytest.raises(ConfigError, match="--memory-budget applies to exports of float32 "
                                          "tables only; table .* is exported as int8"):
        Predictor(exports["int8"], memory_budget=1 << 30, tier_dir=str(tmp_path))
    live = LiveModel(exports["int8"], memory_budget=1 << 30, tier_dir=str(tmp_path / "t"))
    try:
        assert not live.ready and "--memory-budget" in live.problem
    finally:
        live.close()


# -- a lineage of quantized versions ---------------------------------------------------------

SCHEMA = schemas.from_dict({"name": "quantized_serve", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                  {"name": "age", "kind": "id"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})
# a mixed model: item int4, uid int8, age float32 (the store's own files)
CONFIG = TrainConfig.from_dict({
    "batch_size": 500, "seed": 3, "threads": 1,
    "embedding": {"dim": 6, "optimizer": {"name": "adagrad", "lr": 0.2}},
    "tables": {"item": {"export_format": "int4"}, "uid": {"export_format": "int8"}}})
FORMATS = {"item": "int4", "uid": "int8", "age": "float32"}


def samples(n, seed, users=1500):
    rng = np.random.default_rng(seed)
    uid, item = rng.integers(0, users, n), rng.integers(0, 2500, n)
    return [{"uid": int(u), "age": int(u % 5), "item": int(i), "click": float(c)}
            for u, i, c in zip(uid, item, rng.random(n) < 0.3)]


def train(trainer, seed, n=3000, users=1500):
    trees = compression.build_trees(pa.Table.from_pylist(samples(n, seed, users)), SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 500):
        trainer.train_batch(batch)


def probe(seed=9, n=400):
    return [{k: s[k] for k in ("uid", "age", "item")} for s in samples(n, seed)]


def assert_within_bound(stores, trainer):
    for table, store in stores.items():
        reference = trainer.stores[table]
        ids = np.arange(-5, 3000)
        want = reference.lookup(ids, train=False)
        got = store.lookup(ids, train=False)
        assert len(store) == len(reference), table
        assert (np.abs(got - want) <= q.error_bound(FORMATS[table], want)).all(), table


def test_quantized_versions_apply_in_order_and_rebase_like_float32_ones(tmp_path):
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    train(trainer, 0)
    export = tmp_path / "export"
    export_increment(trainer, export)
    predictor, live = Predictor(export), LiveModel(export)
    try:
        assert {t: type(s).__name__ for t, s in predictor.stores.items()} == {
            "item": "QuantizedStore", "uid": "QuantizedStore", "age": "EmbeddingStore"}
        for seed in (1, 2):  # new users and items, updated rows, and removed ones
            train(trainer, seed, users=2000)
            removed = trainer.stores["uid"].expire_where(lambda ids, *_: ids % 7 == seed)
            assert removed > 0
            version = export_increment(trainer, export)
            for table, path in version["deltas"].items():
                with open(path, "rb") as f:
                    magic = f.read(8)
                assert magic == (b"PRXDELT1" if FORMATS[table] == "float32" else b"PRXQDLT1")
        assert predictor.update() == 2 * len(FORMATS)
        assert live.poll() == 2 and live.ready
        assert_within_bound(predictor.stores, trainer)
        rows = probe()
        scores, info = live.predict(rows)
        assert info["version"] == 2
        np.testing.assert_allclose(scores[:, 0], predictor.predict(rows), rtol=1e-5,
                                   atol=1e-7)

        # a new full export of the same model (a new lineage): the live model rebases
        restart_lineage(trainer)
        train(trainer, 3, users=2500)
        assert "full" in export_increment(trainer, export)
        assert live.poll() == 0 and live.ready
        assert live.last_reload["mode"] == "rebase" and live.last_reload["rows"] > 0
        fresh = Predictor(export)
        assert_within_bound(fresh.stores, trainer)
        scores, info = live.predict(rows)
        np.testing.assert_allclose(scores[:, 0], fresh.predict(rows), rtol=1e-5, atol=1e-7)
        # and follows the new lineage's quantized deltas (after the rebase's sequence)
        train(trainer, 4, users=2500)
        export_increment(trainer, export)
        assert live.poll() == 1
        base = live.version.base
        live._settle(live.version)  # the stores themselves hold the version now
        assert_within_bound(base.stores, trainer)
    finally:
        live.close()


# -- trainer.online's flag ------------------------------------------------------------------

def test_online_export_format_sets_every_table_of_a_new_or_restored_run(tmp_path):
    import types

    from trainer.distributed.online import OnlineDistributedTrainer
    from trainer.models import MODELS
    from trainer.online import parse_options
    from trainer.online_process import restore_process_trainer

    config = tmp_path / "config.yaml"
    config.write_text("embedding: {dim: 4}\ntables: {cate_id: {export_format: float16}}\n")
    argv = ["--schema", SCHEMA_PATH, "--bootstrap-servers", "127.0.0.1:1", "--topic", "t",
            "--group", "g", "--run-dir", str(tmp_path / "run"), "--config", str(config)]
    schema = schemas.load(SCHEMA_PATH)
    _, options = parse_options(argv + ["--export-format", "int4"])
    trainer, _ = restore_process_trainer(options, schema, None, MODELS)
    assert {trainer.config.export_format(t) for t in trainer.tables} == {"int4"}
    _, options = parse_options(argv)  # without the flag: the config's
    trainer, _ = restore_process_trainer(options, schema, None, MODELS)
    assert trainer.config.export_format("cate_id") == "float16"
    assert trainer.config.export_format("user_id") == "float32"
    # on Ray: the config a new run or a checkpoint goes on with
    ray_run = types.SimpleNamespace(memory_budget=None, expire_every=None,
                                    export_format="int8")
    saved = TrainConfig.load(config)
    assert OnlineDistributedTrainer.run_config(ray_run, saved).export_format("cate_id") == "int8"
    with pytest.raises(SystemExit):
        parse_options(argv + ["--export-format", "int3"])
