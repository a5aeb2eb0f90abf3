"""The structured-compute trainer: Keras dense networks over native embedding stores, on trees.

    import schemas, trainer
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    t = trainer.Trainer(schema, trainer.models.MLP(), trainer.TrainConfig(batch_size=5000))
    t.fit("trees/*.parquet")
    t.evaluate("test_trees/*.parquet")     # {'auc': ..., 'logloss': ..., 'samples': ...}

The only package that imports TensorFlow; it reads data through ``compression`` and keeps its
sparse parameters in ``native`` stores.
"""

from trainer import models
from trainer.config import (ConfigError, DenseOptimizerConfig, ExpiryConfig, FeatureConfig,
                            TableConfig, TrainConfig)
from trainer.trainer import Trainer

__all__ = ["ConfigError", "DenseOptimizerConfig", "ExpiryConfig", "FeatureConfig",
           "TableConfig", "TrainConfig", "Trainer", "models"]
