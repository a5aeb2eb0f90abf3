"""Property-based test: random operation sequences on the store against a pure-Python model."""
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import native
from store_reference import rows_by_id, sum_duplicates

DIM = 3
LR = 0.5
MIN_COUNT = 2
F32 = np.float32

ids_strategy = st.lists(st.one_of(st.integers(-4, 25), st.sampled_from([2**40, -(2**62), 2**63 - 1])),
                        max_size=30).map(lambda xs: np.array(xs, dtype=np.int64))


class StoreModel:
    """What the store should hold: SGD, CounterFilter(MIN_COUNT), rows keyed by id."""

    def __init__(self, initial_rows):
        self.initial_rows = initial_rows
        self.rows = {}      # id -> (values, update_count, last_step)
        self.counts = {}    # sightings of ids not admitted yet
        self.global_step = 0

    def lookup(self, ids, train):
        if train:
            for id_ in dict.fromkeys(ids.tolist()):  # one sighting per id per call
                if id_ in self.rows:
                    continue
                self.counts[id_] = self.counts.get(id_, 0) + 1
                if self.counts[id_] >= MIN_COUNT:
                    del self.counts[id_]
                    self.rows[id_] = (self.initial_rows(np.array([id_]))[0], 0, self.global_step)
        out = np.zeros((len(ids), DIM), F32)
        for i, id_ in enumerate(ids.tolist()):
            if id_ in self.rows:
                out[i] = self.rows[id_][0]
        return out

    def apply_gradients(self, ids, grads, step):
        for id_, g in zip(*sum_duplicates(ids, grads)):
            if id_ in self.rows:
                w, count, _ = self.rows[id_]
                self.rows[id_] = ((w - F32(LR) * g).astype(F32), count + 1, step)
        self.global_step = max(self.global_step, step)

    def expire(self, max_idle_steps):
        gone = [i for i, (_, _, last) in self.rows.items() if self.global_step - last > max_idle_steps]
        for id_ in gone:
            del self.rows[id_]
        return len(gone)


class StoreMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32), shards=st.sampled_from([1, 3, 16]))
    def start(self, seed, shards):
        self.config = native.StoreConfig(dim=DIM, optimizer=native.SGD(LR), seed=seed,
                                         initializer=native.Uniform(1.0), num_shards=shards,
                                         entry_filter=native.CounterFilter(MIN_COUNT))
        self.store = native.EmbeddingStore(self.config)
        self.model = StoreModel(self.store.initial_rows)
        self.follower = native.EmbeddingStore(self.config)
        self.directory = tempfile.mkdtemp(prefix="store-model-")

    def teardown(self):
        if hasattr(self, "directory"):
            shutil.rmtree(self.directory, ignore_errors=True)

    @rule(ids=ids_strategy, train=st.booleans())
    def lookup(self, ids, train):
        np.testing.assert_array_equal(self.store.lookup(ids, train=train), self.model.lookup(ids, train))

    @rule(ids=ids_strategy, train=st.booleans())
    def lookup_unique(self, ids, train):
        unique, inverse, rows = self.store.lookup_unique(ids, train=train)
        np.testing.assert_array_equal(unique[inverse], ids)
        np.testing.assert_array_equal(rows[inverse], self.model.lookup(ids, train))

    @rule(data=st.data(), ids=ids_strategy, step=st.integers(0, 40))
    def apply_gradients(self, data, ids, step):
        grads = data.draw(arrays(F32, (len(ids), DIM), elements=st.floats(-8, 8, width=32)))
        self.store.apply_gradients(ids, grads, step)
        self.model.apply_gradients(ids, grads, step)

    @rule(max_idle_steps=st.integers(0, 20))
    def expire(self, max_idle_steps):
        assert self.store.expire(max_idle_steps=max_idle_steps) == self.model.expire(max_idle_steps)

    @rule()
    def save_and_reload(self):
        self.store.save(self.directory)
        self.store = native.EmbeddingStore.load(self.directory)

    @rule()
    def follower_catches_up(self):
        self.follower.apply_delta(self.store.export_delta(self.directory))
        self.check_rows(self.follower)

    @precondition(lambda self: hasattr(self, "store"))
    @invariant()
    def rows_match_model(self):
        assert len(self.store) == len(self.model.rows)
        self.check_rows(self.store)

    def check_rows(self, store):
        rows = rows_by_id(store)
        ids = sorted(self.model.rows)
        assert rows["ids"].tolist() == ids
        if ids:
            np.testing.assert_array_equal(rows["values"], np.stack([self.model.rows[i][0] for i in ids]))
        assert rows["update_counts"].tolist() == [self.model.rows[i][1] for i in ids]
        assert rows["last_steps"].tolist() == [self.model.rows[i][2] for i in ids]


StoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_store_matches_model = StoreMachine.TestCase
