"""TrainConfig: YAML loading, round trips, and the pinned messages of bad configs."""
import os

import pytest

import native
import schemas
from trainer import ConfigError, TrainConfig
from trainer.config import ExpiryConfig

from trainer_data import ROOT

EXAMPLE = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")


def write(tmp_path, text):
    path = tmp_path / "trainer.yaml"
    path.write_text(text)
    return str(path)


def test_example_config_loads_and_fits_the_example_schema(schema):
    config = TrainConfig.load(EXAMPLE)
    tables = config.check(schema)
    assert config.batch_size == 5000 and config.embedding.dim == 18
    assert sum(len(v) for v in tables.values()) == 22  # every id/ids feature, price is dense


def test_yaml_sets_tables_sharing_pooling_filters_and_expiry(tmp_path, schema):
    config = TrainConfig.load(write(tmp_path, """
batch_size: 64
compute: flat
dense_optimizer: {name: adagrad, lr: 0.1}
embedding:
  dim: 8
  optimizer: {name: ftrl, alpha: 0.1}
  filter: {name: counter, min_count: 2}
features:
  clicked_cats: {table: cate, pooling: mean}
  cate_id: {table: cate}
tables:
  cate: {dim: 4, expire: {every_steps: 10, max_idle_steps: 100}, filter: null}
"""))
    assert config.compute == "flat" and config.batch_size == 64
    assert config.dense_optimizer.name == "adagrad" and config.dense_optimizer.lr == 0.1
    assert config.feature("clicked_cats").pooling == "mean"
    assert config.table_of("cate_id") == "cate" and config.table_of("ad_id") == "ad_id"
    cate, other = config.table("cate"), config.table("ad_id")
    assert cate.dim == 4 and cate.entry_filter is None
    assert cate.expire == ExpiryConfig(every_steps=10, max_idle_steps=100)
    assert cate.optimizer == native.FTRL(alpha=0.1)       # inherited from `embedding`
    assert other.dim == 8 and other.entry_filter == native.CounterFilter(2)
    tables = config.check(schema)
    assert tables["cate"] == ["clicked_cats", "cate_id"]
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("text, message", [
    ("features: {clicked_catz: {pooling: sum}}",
     "features.clicked_catz: the schema 'taobao_like' has no feature 'clicked_catz'; features "
     "are user_id, "),
    ("features: {price: {table: p}}",
     "features.price: 'price' is a dense feature and has no embedding table"),
    ("tables: {cate: {dim: 4}}", "tables.cate: no feature uses table 'cate'"),
    ("dense: {cate_id: {transform: log1p}}",
     "dense.cate_id: the schema 'taobao_like' has no dense feature 'cate_id'; dense features "
     "are price"),
])
def test_schema_mismatches_name_the_feature(tmp_path, schema, text, message):
    config = TrainConfig.load(write(tmp_path, text))
    with pytest.raises(ConfigError) as e:
        config.check(schema)
    assert message in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("features: {clicked_cats: {pooling: max}}",
     "features.clicked_cats.pooling: 'max' is not a pooling; use one of sum, mean"),
    ("embedding: {optimizer: {name: rmsprop}}",
     "embedding.optimizer.name: 'rmsprop' is not a known store optimizer; use one of sgd, "
     "adagrad, adam, ftrl"),
    ("embedding: {optimizer: {name: adagrad, lr: -1}}",
     "embedding.optimizer: Adagrad.lr must be in (0, inf], got -1"),
    ("dense_optimizer: {name: lamb}",
     "dense_optimizer.name: 'lamb' is not supported; use one of adam, adagrad, sgd"),
    ("tables: {cate: {filter: {name: counter, count: 3}}}",
     "tables.cate.filter: counter takes min_count, got count"),
    ("embedding: {expire: {every_steps: 10}}",
     "embedding.expire: give max_idle_steps, max_idle_seconds or function (`module:function`)"),
    ("embedding: {expire: {function: stale_rows}}",
     "embedding.expire.function: expected `module:function` (e.g. `my_rules:stale_rows`), "
     "got 'stale_rows'"),
    ("embedding: {expire: {function: 'no_such_module_xyz:stale'}}",
     "embedding.expire.function: cannot import module 'no_such_module_xyz' (No module named "
     "'no_such_module_xyz'); put it on PYTHONPATH or in the working directory"),
    ("embedding: {expire: {function: 'json:no_such_function'}}",
     "embedding.expire.function: module 'json' has no function 'no_such_function'"),
    ("compute: tree", "compute: 'tree' is not a compute mode; use one of structured, flat"),
    ("dense: {price: {transform: sqrt}}",
     "dense.price.transform: 'sqrt' is not a transform; use one of auto, none, log1p"),
    ("batch_size: 0", "batch_size: expected an integer >= 1, got 0"),
    ("dense_optimizer: {epochs: -1}", "dense_optimizer.epochs: expected an integer >= 0, got -1"),
    ("dense_optimizer: {epochs: all}",
     "dense_optimizer.epochs: expected an integer >= 0, got 'all'"),
    ("epochs: 3", "config: unknown key 'epochs'; known keys are batch_size, "),
    ("embedding: {dim: 0}", "embedding.dim: expected an integer in [1, 4096], got 0"),
])
def test_bad_configs_are_refused_with_the_key_and_the_fix(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(path)
    assert str(e.value).startswith(f"{path}: {message}")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        TrainConfig.load(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.load(write(tmp_path, "batch_size: [1"))


def test_expire_every_reschedules_every_configured_expiry(tmp_path):
    config = TrainConfig.load(write(tmp_path, """
embedding: {expire: {every_steps: 1000, max_idle_steps: 5}}
tables: {cate: {dim: 4, expire: null}, brand: {expire: {every_steps: 7, function: 'json:dumps'}}}
"""))
    changed = config.with_expire_every(3)
    assert changed.embedding.expire == ExpiryConfig(every_steps=3, max_idle_steps=5)
    assert changed.table("brand").expire == ExpiryConfig(every_steps=3, function="json:dumps")
    assert changed.table("cate").expire is None
    with pytest.raises(ConfigError, match="--expire-every: no table has an expiry to schedule"):
        TrainConfig().with_expire_every(3)
    with pytest.raises(ConfigError, match="--expire-every: expected an integer >= 1, got 0"):
        config.with_expire_every(0)


def test_dense_epochs_default_to_one_and_null_means_every_pass(tmp_path):
    assert TrainConfig().dense_optimizer.epochs == 1
    config = TrainConfig.load(write(tmp_path, "dense_optimizer: {epochs: null}"))
    assert config.dense_optimizer.epochs is None
    assert TrainConfig.from_dict(config.to_dict()) == config
    config = TrainConfig.load(write(tmp_path, "dense_optimizer: {name: sgd, epochs: 3}"))
    assert (config.dense_optimizer.name, config.dense_optimizer.epochs) == ("sgd", 3)
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("data,message", [
    ("seed: 1 # é\n".encode("latin-1"), r"not UTF-8 text \(byte 0xe9 at offset 10\)"),
    (b"{a: " * 5000, "nested too deeply to be a training config"),
])
def test_a_config_file_not_utf8_or_nested_too_deeply_is_a_config_error(tmp_path, data, message):
    """Found by fuzzing (tests/fuzz_corpus/config_yaml): these escaped as UnicodeDecodeError
    and RecursionError."""
    path = tmp_path / "trainer.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=message) as error:
        TrainConfig.load(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("key", ["features", "tables", "dense"])
def test_a_config_section_that_is_not_a_mapping_is_a_config_error(tmp_path, key):
    """Found by fuzzing (tests/fuzz_corpus/config_yaml/finding-*-not-a-mapping): `features: x`
    raised AttributeError ('str' object has no attribute 'items')."""
    path = tmp_path / "trainer.yaml"
    path.write_text(f"{key}: some text\n")
    with pytest.raises(ConfigError, match=rf"{key}: expected a mapping by name like .*got str"):
        TrainConfig.load(path)


@pytest.mark.parametrize("text,message", [
    ("features:\n  hist: {table: {a: 1}}\n", r"features.hist.table: expected a table name"),
    ("embedding: {optimizer: {name: adam, 1.5: x}}\n", r"embedding.optimizer: adam takes .*"
                                                        r"got 1.5"),
])
def test_a_table_or_argument_name_that_is_not_text_is_a_config_error(tmp_path, text, message):
    """Found by fuzzing (tests/fuzz_corpus/config_yaml): these raised TypeError (an unhashable
    table name in check(), a float key joined into the message)."""
    path = tmp_path / "trainer.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        TrainConfig.load(path).check(schemas.load(os.path.join(ROOT, "schemas", "examples",
                                                               "taobao_like.yaml")))
