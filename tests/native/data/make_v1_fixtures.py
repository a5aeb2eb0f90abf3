"""Writes the version-1 snapshot/delta fixtures of test_store_format.py.

Only works with a build that writes format version 1 (the session-2 store, commit 558126a):
    PYTHONPATH=<checkout of that commit> python tests/native/data/make_v1_fixtures.py /tmp/out
then copy snapshot/ to v1_snapshot/, deltas/ to v1_deltas/ and v1_expected.json here.
"""
import json, os, shutil, sys
import numpy as np
import native

out = sys.argv[1]
config = native.StoreConfig(dim=3, optimizer=native.Adagrad(0.05), entry_filter=native.CounterFilter(2),
                            seed=5, num_shards=3)
store = native.EmbeddingStore(config)
follower_start = native.EmbeddingStore(config)
ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 2**40 + 3, -9], np.int64)
store.apply_gradients([], np.zeros((0, 3), np.float32), step=2**32 - 5, now=999.0)
store.lookup(ids, now=1000.25)
store.lookup(ids, now=1000.75)            # second sighting admits (counter filter 2)
store.lookup([77], now=1001.0)            # one sighting: stays in the filter's counts
store.apply_gradients(ids[:6], np.arange(18, dtype=np.float32).reshape(6, 3) / 10, step=2**32 - 2, now=1002.4)
store.apply_gradients(ids[:2], np.ones((2, 3), np.float32), step=2**32 + 3, now=1003.6)
d1 = store.export_delta(os.path.join(out, "deltas"))
store.expire_where(lambda i, *r: i == 8)   # tombstone pending
store.apply_gradients(ids[2:4], np.full((2, 3), 0.5, np.float32), step=2**32 + 9, now=1010.5)
d2 = store.export_delta(os.path.join(out, "deltas"))
store.apply_gradients([5], np.full((1, 3), 0.25, np.float32), step=2**32 + 10, now=1011.0)  # pending
store.save(os.path.join(out, "snapshot"))
rows = store.to_numpy()
order = np.argsort(rows["ids"])
expected = {k: v[order].tolist() for k, v in rows.items()}
expected["stats"] = {k: v for k, v in store.stats().as_dict().items() if k not in ("bytes", "filter_bytes")}
follower = native.EmbeddingStore(config)
follower.apply_delta(d1); follower.apply_delta(d2)
frows = follower.to_numpy(); o = np.argsort(frows["ids"])
expected["follower"] = {k: v[o].tolist() for k, v in frows.items()}
json.dump(expected, open(os.path.join(out, "v1_expected.json"), "w"), indent=1)
