"""The single-process reference of the distributed tests: the workers' batches side by side."""
import dataclasses

import numpy as np

from compression import TreeBatch
from trainer import Trainer, distributed


def union_batches(schema, cfg, data, epoch: int, workers: int) -> list:
    """Batch k of pass ``epoch`` is the ``workers``' batches k side by side."""
    parts = [list(distributed.worker_batches(data, schema, cfg, w, workers, epoch, shuffle=True))
             for w in range(workers)]
    steps = max(len(p) for p in parts)
    return [TreeBatch.concat([p[k] for p in parts if k < len(p)]) for k in range(steps)]


def single_process_run(schema, model, cfg, data, epochs: int, workers: int,
                       one_fit: bool = True):
    """A ``Trainer`` trained on the union batches of ``epochs`` passes, one fit per pass, and
    its per-step losses. With ``one_fit`` the passes follow the rule of one ``fit`` making them
    all (as the distributed run does): the dense network trains in the first
    ``dense_optimizer.epochs`` of them and stays frozen after (``epochs: 0`` for those fits)."""
    single = Trainer(schema, model, cfg)
    losses = []
    limit = cfg.dense_optimizer.epochs
    for epoch in range(1, epochs + 1):
        if one_fit and limit is not None and epoch > limit:
            single.config = single.config.replace(
                dense_optimizer=dataclasses.replace(cfg.dense_optimizer, epochs=0))
        single.fit(union_batches(schema, cfg, data, epoch, workers), shuffle=False,
                   callback=lambda t, loss, p, y: losses.append(loss))
    return single, losses


def sorted_rows(rows: dict) -> dict:
    """A table's row arrays (``EmbeddingStore.to_numpy``, or the shards' joined) by id."""
    order = np.argsort(rows["ids"])
    return {k: v[order] for k, v in rows.items()}


def assert_rows_equal(tables: dict, stores: dict, label: str = "") -> None:
    """The distributed run's rows (``DistributedTrainer.table_rows()``) equal the single
    stores': the same ids, values and optimizer state to float rounding, the same update
    counts and last steps."""
    assert tables.keys() == stores.keys()
    for table, store in stores.items():
        got, want = sorted_rows(tables[table]), sorted_rows(store.to_numpy())
        np.testing.assert_array_equal(got["ids"], want["ids"], err_msg=f"{label}{table}")
        for key in ("values", "state"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{label}{table} {key}")
        for key in ("update_counts", "last_steps"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{label}{table} {key}")
