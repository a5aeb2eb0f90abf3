"""A served table as one pending version sees it (trainer.live.VersionedTable): which ids have
a row, what a cold table's routing asks, follows the version's delta (rows it writes are
there, rows it removes are not) before the delta is applied to the store."""
import numpy as np

import native
from trainer.live import Overlay, VersionedTable


def test_contains_follows_the_pending_versions_delta(tmp_path):
    config = native.StoreConfig(dim=2, entry_filter=native.CounterFilter(min_count=1))
    trainer = native.EmbeddingStore(config)
    served = native.EmbeddingStore(config)
    first = np.arange(10, dtype=np.int64)
    unique, _, _ = trainer.lookup_unique(first, train=True)
    trainer.apply_gradients(unique, np.ones((10, 2), np.float32), 1)
    trainer.export_delta(tmp_path / "d1")
    served.apply_delta(next((tmp_path / "d1").glob("delta-*.bin")))
    # the next version: ids 10..14 get rows, 0..2 are removed
    unique, _, _ = trainer.lookup_unique(np.arange(10, 15, dtype=np.int64), train=True)
    trainer.apply_gradients(unique, np.ones((5, 2), np.float32), 2)
    trainer.expire_where(lambda ids, *rest: ids < 3)
    trainer.export_delta(tmp_path / "d2")
    delta = served.read_delta(next((tmp_path / "d2").glob("delta-*.bin")))
    ids = np.array([14, 0, 5, 2, 11, 99, 3], np.int64)
    np.testing.assert_array_equal(VersionedTable(served, None).contains(ids),
                                  [False, True, True, True, False, False, True])
    pending = VersionedTable(served, Overlay([delta]))
    np.testing.assert_array_equal(pending.contains(ids), trainer.contains(ids))
    np.testing.assert_array_equal(pending.contains(ids),
                                  [True, False, True, False, True, False, True])
    assert pending.contains(np.zeros(0, np.int64)).shape == (0,)
