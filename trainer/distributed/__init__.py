"""Distributed training on Ray: embedding-store shards and data-parallel workers as actors.

    from trainer.distributed import DistributedTrainer
    with DistributedTrainer(schema, models.MLP(), TrainConfig(batch_size=5000),
                            workers=2, shards=2) as dt:           # a local Ray cluster
        dt.fit("trees/*.parquet")
        print(dt.evaluate("test_trees/*.parquet"))
        dt.save("run/checkpoint")

    # on an existing cluster (`ray start --head` on one machine, `ray start --address=HEAD:6379`
    # on the others, the project installed on every node):
    DistributedTrainer(schema, model, config, workers=8, shards=4, ray_address="HEAD:6379")

Design (synchronous data parallelism over a sharded parameter server, all on Ray actors):

- **Store shards** (one actor each) own one native :class:`native.EmbeddingStore` per table,
  built with the table's settings (optimizer, initializer, seed, entry filter, expiry). An id
  lives on shard :func:`id_shards` ``(id, S)``. The pybind11 stores never leave their actor; only
  numpy arrays cross processes.
- **Workers** (one actor each) hold the TensorFlow network, built from the same schema, model
  and config (same seed), so their initial dense weights are equal. Trees are dealt to workers by
  a hash of their root key (:func:`tree_shards`), so no tree crosses workers. ``batch_size`` is
  the global batch: each worker's batches hold its share (:func:`worker_batch_size`), so a
  step trains on ``batch_size`` leaves whatever the number of workers.
- **One synchronous step** ``k``, as a graph of actor calls whose arrays flow between the
  actors through Ray's object store (the driver passes references and reads small metadata);
  every worker's reader thread prepares its batches ahead, deduplicated per table and split by
  shard (one request per shard, all tables in it):

  1. every worker computes its batch's loss, dense gradients and row gradients on the rows the
     shards sent, and hands out its next batch's requests (``Worker.train_step``);
  2. every worker applies step ``k``'s dense update: all workers' dense gradients, their
     leaf-weighted mean in worker order, the same numbers on every worker, so their weights
     stay identical (``Worker.apply_dense``; it runs while the shards work; a worker keeps
     its own gradients, only the others' travel; a lone worker applies its update inside its
     ``train_step``, as a single process does, and makes no ``apply_dense`` call);
  3. every shard, in one call (``Shard.step``), concatenates the gradients of all workers per
     table and calls ``apply_gradients`` once per table with step ``k`` (the store sums a
     row's gradients over the workers), runs the configured expiry when ``k`` is a multiple of
     ``every_steps``, then receives the requests of all workers for step ``k+1`` and runs ONE
     ``lookup_unique`` per table over their concatenation (so an entry filter counts an id once
     per step, as the single store does for the union batch), and sends each worker its rows.

  So a step is two hops on its critical path (worker, shard). The driver submits step
  ``k+1``'s calls before it reads step ``k``'s results; Ray runs an actor's calls in the order
  one caller submitted them. A step submitted past the end of the data changes nothing (its
  shards skip the update). Before a checkpoint or an evaluation the shards apply step ``k``
  without the lookup of ``k+1`` (the pipeline drains), so nothing of step ``k+1`` has run.
- **Checkpoints** (:meth:`DistributedTrainer.save`): between steps, every shard writes its
  snapshots, worker 0 gives the dense weights and optimizer state, and the driver writes
  ``manifest.json`` last, with every worker's input position (the pass, and the batches each
  worker took from it); :meth:`DistributedTrainer.restore` reads the manifest and may use
  another number of workers or shards (resharding moves every row and a counter filter's
  pending counts exactly; a counting Bloom filter's counters cannot be split by id, so every
  new shard starts from their sum: ``Shard._reshard``).
- **Faults** (``fit(checkpoint_dir=..., checkpoint_every=...)``): actors are created with
  ``max_restarts`` and no task retries. When an actor's process dies, the calls that needed it
  fail; Ray restarts the process (the constructor runs again, so its state is fresh, and it
  refuses step calls until it is rolled back); the driver waits until every actor answers,
  loads the last checkpoint of this fit into all of them (:meth:`DistributedTrainer.load`),
  forgets the steps since, and restarts the pass at the manifest's input positions (the
  workers batch their first trees again and skip them). The run then ends as an uninterrupted
  one (``tests/trainer/test_distributed_faults.py``).

- **Online learning** (``python -m trainer.online ... --workers W --shards S``,
  :mod:`trainer.distributed.online`): the same shards and step, workers that read their Kafka
  partitions (:mod:`trainer.distributed.online_worker`), and checkpoints whose manifest holds
  every partition's trained offset.

**Exactness.** With workers holding ``n_w`` leaves (``N = sum n_w``), the single-process loss
of the union batch is the mean over its ``N`` leaves, so ``L = sum_w (n_w / N) L_w`` and every
gradient of ``L`` is the ``n_w / N``-weighted sum of the workers' gradients. Workers therefore
send ``n_w * grad`` (the per-sample sums); the dense update divides their sum by ``N``; row
gradients in ``row_gradients: sum`` mode are exactly the summed per-sample gradients (the
single trainer multiplies the mean loss's gradient by ``N``), and in ``mean`` mode the shard
divides by ``N``. Synchronous training is therefore equal to single-process training on the
union of the workers' batches up to float rounding (summation order), which
``tests/trainer/test_distributed.py`` checks: per-step loss, dense weights, and every row of the
stores (values, optimizer state, update counts, last steps).

What is exact and what is not: the counter entry filter, expiry by steps and by a function of
the row statistics, rows, optimizer state and counters are exact (every shard receives an
``apply_gradients`` every step, so its global step equals the single store's). The probability
filter draws from per-store random streams and a counting Bloom filter's false positives
depend on which ids share a filter: both are statistically, not bitwise, equal to one store.
``max_rows`` caps each shard at ``ceil(max_rows / S)`` rows. The store's ``lookups`` counter
counts each worker's distinct ids (workers deduplicate before sending). Dropout draws
different masks in different processes.
"""

import importlib

# Imported on first use (PEP 562): a shard process imports trainer.distributed.shard without
# the driver (Ray) or the worker (TensorFlow); serving imports placement without either.
_LAZY = {"DistributedTrainer": "driver", "run_training": "train_run", "MAX_SHARDS": "driver",
         "read_manifest": "manifest", "MANIFEST_VERSION": "manifest",
         "id_shards": "placement", "tree_shards": "placement", "own_trees": "placement",
         "Shard": "shard", "worker_batches": "worker", "worker_batch_size": "worker",
         "resolve_dense": "worker",
         "dense_sample": "worker"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainer.distributed.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
