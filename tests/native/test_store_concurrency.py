"""Several Python threads looking up, updating, expiring and exporting the same store at once."""
import threading
from collections import Counter

import numpy as np

import native
from store_reference import assert_same_rows, rows_by_id

DIM = 8


def run_threads(targets):
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_concurrent_updates_are_exact_and_reads_never_see_torn_rows():
    # SGD with lr 1 on integer gradients is exact in float32 whatever the order of updates, so
    # the final rows are known; every gradient row is constant, so every row read must be too.
    store = native.EmbeddingStore(native.StoreConfig(
        dim=DIM, optimizer=native.SGD(1.0), initializer=native.Zeros(), num_shards=8, num_threads=2))
    writers, rounds, batch, universe = 3, 12, 12000, 3000
    expected = [Counter() for _ in range(writers)]
    updates = [Counter() for _ in range(writers)]
    stop = threading.Event()
    torn = []

    def writer(w):
        rng = np.random.default_rng(w)
        for _ in range(rounds):
            ids = rng.integers(0, universe, size=batch)
            unique, inverse, _ = store.lookup_unique(ids)
            scale = rng.integers(1, 4, size=len(unique))
            grads = np.repeat(scale[:, None], DIM, axis=1).astype(np.float32)
            store.apply_gradients(unique, grads, step=1)
            expected[w].update(dict(zip(unique.tolist(), scale.tolist())))
            updates[w].update(unique.tolist())

    def reader():
        rng = np.random.default_rng(99)
        while not stop.is_set():
            rows = store.lookup(rng.integers(0, universe, size=batch), train=False)
            if not np.all(rows == rows[:, :1]):
                torn.append(rows)

    reader_thread = threading.Thread(target=reader)
    reader_thread.start()
    try:
        run_threads([lambda w=w: writer(w) for w in range(writers)])
    finally:
        stop.set()
        reader_thread.join()
    assert not torn
    total, counts = Counter(), Counter()
    for w in range(writers):
        total.update(expected[w])
        counts.update(updates[w])
    rows = rows_by_id(store)
    assert rows["ids"].tolist() == sorted(total)
    np.testing.assert_array_equal(rows["values"][:, 0], -np.array([total[i] for i in sorted(total)], np.float32))
    assert rows["update_counts"].tolist() == [counts[i] for i in sorted(counts)]
    assert store.stats().updates == sum(counts.values())
    assert store.stats().admitted == len(store) == len(total)


def test_expiry_and_delta_export_while_training_keep_a_follower_exact(tmp_path):
    config = native.StoreConfig(dim=DIM, optimizer=native.Adagrad(0.05), num_shards=8,
                                entry_filter=native.CounterFilter(2))
    trainer, follower = native.EmbeddingStore(config), native.EmbeddingStore(config)
    stop, expired = threading.Event(), threading.Event()

    def train(seed):
        rng = np.random.default_rng(seed)
        for step in range(1, 25):
            if step == 13:
                # training goes on only once the maintainer removed rows: expiry then surely
                # runs while this thread trains (the threads' interleaving is the scheduler's,
                # and a loaded machine may not run the maintainer at all otherwise)
                assert expired.wait(timeout=120), "the maintainer expired no row in 120 s"
            ids = rng.zipf(1.2, size=10000) % 20000
            unique, _, _ = trainer.lookup_unique(ids)
            trainer.apply_gradients(unique, rng.normal(size=(len(unique), DIM)), step)

    def maintain():
        while not stop.is_set():
            trainer.expire(max_idle_steps=3)
            follower.apply_delta(trainer.export_delta(tmp_path))
            if trainer.stats().expired:
                expired.set()
            len(trainer.to_numpy()["ids"])

    maintainer = threading.Thread(target=maintain)
    maintainer.start()
    try:
        run_threads([lambda s=s: train(s) for s in range(2)])
    finally:
        stop.set()
        maintainer.join()
    follower.apply_delta(trainer.export_delta(tmp_path))
    assert_same_rows(follower, trainer)
    assert trainer.stats().expired > 0
