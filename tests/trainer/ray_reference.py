"""The single-process reference of the distributed tests: the workers' batches side by side."""
import dataclasses

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
