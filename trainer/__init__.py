"""The structured-compute trainer: Keras dense networks over native embedding stores, on trees.

    import schemas, trainer
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    t = trainer.Trainer(schema, trainer.models.MLP(), trainer.TrainConfig(batch_size=5000))
    t.fit("trees/*.parquet")
    t.evaluate("test_trees/*.parquet")     # {'auc': ..., 'logloss': ..., 'samples': ...}

The only package that imports TensorFlow; it reads data through ``compression`` and keeps its
sparse parameters in ``native`` stores.
"""

import importlib

from trainer import _no_sklearn

# keras imports scikit-learn for wrappers prefixrec does not use (~1-2 CPU-s per process)
_no_sklearn.install()

# Imported on first use (PEP 562), so ``python -m trainer.train --help`` and argument errors do
# not pay for importing TensorFlow.
_LAZY = {"models": "trainer.models", "Trainer": "trainer.trainer", "ModelCore": "trainer.model_core",
         "FitState": "trainer.fitting",
         **{name: "trainer.config" for name in ("ConfigError", "DenseOptimizerConfig",
                                                "ExpiryConfig", "FeatureConfig", "TableConfig",
                                                "TrainConfig")}}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    module = importlib.import_module(module)
    value = module if module.__name__ == f"trainer.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

__all__ = ["ConfigError", "DenseOptimizerConfig", "ExpiryConfig", "FeatureConfig", "FitState",
           "ModelCore", "TableConfig", "TrainConfig", "Trainer", "models"]
