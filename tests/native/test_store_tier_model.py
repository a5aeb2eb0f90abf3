"""Property-based exactness of the two tiers (docs/tiered-store.md, "Exactness"): random programs
of lookups, updates, expiry, removals, entry filters, snapshots (save/load) and deltas
(export/read/apply) run on a store whose memory budget holds a few rows a shard and on an
unbounded store with the same options; both must agree bit for bit after every call (outputs,
counts, every row's bytes and metadata, stats, files' contents). Derandomized, so a run is the
same on every machine; `make test-asan` runs it under ASan + UBSan with the rest of
tests/native."""
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import native

DIM = 3
F32 = np.float32
STATE = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 2}

ids_strategy = st.lists(st.one_of(st.integers(0, 60), st.sampled_from([2**40, -(2**62), 2**63 - 1])),
                        min_size=1, max_size=40).map(lambda xs: np.array(xs, dtype=np.int64))


def _optimizer(name):
    return {"sgd": lambda: native.SGD(0.5), "adagrad": lambda: native.Adagrad(0.3),
            "adam": lambda: native.Adam(0.05), "ftrl": lambda: native.FTRL(0.2, l1=0.01)}[name]()


def _filter(name):
    return {"none": None, "counter": native.CounterFilter(2),
            "bloom": native.CountingBloomFilter(min_count=2, capacity=1000),
            "probability": native.ProbabilityFilter(0.5)}[name]


def _rows(store) -> dict:
    rows = store.to_numpy()
    order = np.argsort(rows["ids"], kind="stable")
    return {k: v[order] for k, v in rows.items()}


def _assert_same_rows(a, b, where):
    ra, rb = _rows(a), _rows(b)
    assert ra.keys() == rb.keys()
    for column in ra:
        assert ra[column].tobytes() == rb[column].tobytes(), f"{where}: {column} differs"


class TieredStoreMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), shards=st.sampled_from([1, 3]),
                optimizer=st.sampled_from(sorted(STATE)),
                entry_filter=st.sampled_from(["none", "counter", "bloom", "probability"]),
                eviction=st.sampled_from(["lru", "lfu"]), rows_a_shard=st.integers(1, 5),
                fill=st.integers(0, 50))
    def start(self, seed, shards, optimizer, entry_filter, eviction, rows_a_shard, fill):
        self.directory = tempfile.mkdtemp(prefix="store-tier-model-")
        self.options = dict(dim=DIM, optimizer=_optimizer(optimizer), seed=seed,
                            initializer=native.Uniform(1.0), num_shards=shards,
                            entry_filter=_filter(entry_filter))
        memory_row = 20 + 4 * DIM * (1 + STATE[optimizer]) + 5
        self.tiers = dict(memory_budget_bytes=shards * rows_a_shard * memory_row, eviction=eviction)
        self.generation = 0
        self.plain = native.EmbeddingStore(self.config(budget=False))
        self.tiered = native.EmbeddingStore(self.config(budget=True))
        self.plain_follower = native.EmbeddingStore(self.config(budget=False))
        self.tiered_follower = native.EmbeddingStore(self.config(budget=True))
        self.step = 0
        self.now = 1.8e9
        # Most programs start with more rows than the budget holds (ids 0..fill-1, seen twice
        # to pass the entry filters), so their calls meet rows on disk from the start.
        for _ in range(2):
            self.lookup(np.arange(fill, dtype=np.int64), True)

    def config(self, budget: bool) -> native.StoreConfig:
        if not budget:
            return native.StoreConfig(**self.options)
        self.generation += 1  # every budgeted store its own tier directory
        return native.StoreConfig(**self.options, **self.tiers,
                                  disk_dir=f"{self.directory}/tiers-{self.generation}")

    def teardown(self):
        if hasattr(self, "directory"):
            shutil.rmtree(self.directory, ignore_errors=True)

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now

    @rule(ids=ids_strategy, train=st.booleans())
    def lookup(self, ids, train):
        now = self.tick()
        a = self.plain.lookup(ids, train=train, now=now)
        b = self.tiered.lookup(ids, train=train, now=now)
        assert a.tobytes() == b.tobytes()

    @rule(ids=ids_strategy, train=st.booleans())
    def lookup_unique(self, ids, train):
        now = self.tick()
        a = self.plain.lookup_unique(ids, train=train, now=now)
        b = self.tiered.lookup_unique(ids, train=train, now=now)
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()

    @rule(data=st.data(), ids=ids_strategy, advance=st.integers(0, 3))
    def apply_gradients(self, data, ids, advance):
        self.step += advance
        grads = data.draw(arrays(F32, (len(ids), DIM), elements=st.floats(-4, 4, width=32)))
        now = self.tick()
        self.plain.apply_gradients(ids, grads, self.step, now=now)
        self.tiered.apply_gradients(ids, grads, self.step, now=now)

    @rule(data=st.data(), ids=ids_strategy, advance=st.integers(0, 2))
    def training_step(self, data, ids, advance):
        """A trainer's step: training lookup, then the update of the same ids."""
        self.lookup(ids, True)
        self.apply_gradients(data, ids, advance)

    @rule(max_idle_steps=st.integers(0, 6))
    def expire_steps(self, max_idle_steps):
        now = self.tick(0)
        assert (self.plain.expire(max_idle_steps=max_idle_steps, now=now)
                == self.tiered.expire(max_idle_steps=max_idle_steps, now=now))

    @rule(max_idle_seconds=st.integers(0, 30))
    def expire_seconds(self, max_idle_seconds):
        now = self.tick(0)
        assert (self.plain.expire(max_idle_seconds=max_idle_seconds, now=now)
                == self.tiered.expire(max_idle_seconds=max_idle_seconds, now=now))

    @rule(modulus=st.integers(2, 7), residue=st.integers(0, 6))
    def remove_where(self, modulus, residue):
        doomed = lambda ids, *rest: ids % modulus == residue % modulus  # noqa: E731
        assert self.plain.expire_where(doomed) == self.tiered.expire_where(doomed)

    @rule()
    def save_and_load(self):
        self.generation += 1
        plain_dir, tiered_dir = (f"{self.directory}/snap-{side}-{self.generation}"
                                 for side in ("plain", "tiered"))
        self.plain.save(plain_dir)
        self.tiered.save(tiered_dir)
        self.plain = native.EmbeddingStore.load(plain_dir)
        self.tiered = native.EmbeddingStore.load(tiered_dir, self.config(budget=True))

    @rule()
    def export_and_apply_delta(self):
        self.generation += 1
        plain_dir, tiered_dir = (f"{self.directory}/delta-{side}-{self.generation}"
                                 for side in ("plain", "tiered"))
        a = self.plain.export_delta(plain_dir)
        b = self.tiered.export_delta(tiered_dir)
        da, db = self.plain_follower.read_delta(a), self.tiered_follower.read_delta(b)
        for key in ("sequence", "global_step"):
            assert da[key] == db[key], key
        order_a, order_b = np.argsort(da["ids"]), np.argsort(db["ids"])
        assert da["ids"][order_a].tobytes() == db["ids"][order_b].tobytes()
        assert da["rows"][order_a].tobytes() == db["rows"][order_b].tobytes()
        assert np.sort(da["tombstones"]).tobytes() == np.sort(db["tombstones"]).tobytes()
        # The followers (one unbounded, one budgeted) apply every delta; the invariant
        # compares their rows.
        assert self.plain_follower.apply_delta(a) == self.tiered_follower.apply_delta(b)

    @rule()
    def merge_filter_state(self):
        state = self.plain.filter_state()
        assert (self.plain_follower.merge_filter_state(**state)
                == self.tiered_follower.merge_filter_state(**state))

    @precondition(lambda self: hasattr(self, "plain"))
    @invariant()
    def stores_agree(self):
        assert len(self.plain) == len(self.tiered)
        _assert_same_rows(self.plain, self.tiered, "stores")
        sa, sb = self.plain.stats(), self.tiered.stats()
        for field in ("rows", "admitted", "rejected", "expired", "updates", "global_step",
                      "delta_sequence"):
            assert getattr(sa, field) == getattr(sb, field), field
        tiers = self.tiered._native.tier_stats()
        assert tiers["memory_rows"] + tiers["disk_rows"] == sb.rows
        _assert_same_rows(self.plain_follower, self.tiered_follower, "followers")


TieredStoreMachine.TestCase.settings = settings(
    derandomize=True, max_examples=30, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_budgeted_store_equals_unbounded_store_on_random_programs = TieredStoreMachine.TestCase


def test_the_programs_reach_the_disk_tier(tmp_path):
    """The budget the machine uses does move rows: a fixed program of its own kinds of calls
    leaves rows on disk, faults them back, and keeps the two stores equal."""
    memory_row = 20 + 4 * DIM * 2 + 5
    options = dict(dim=DIM, optimizer=native.Adagrad(0.3), seed=1, num_shards=3,
                   entry_filter=native.CounterFilter(2))
    plain = native.EmbeddingStore(native.StoreConfig(**options))
    tiered = native.EmbeddingStore(native.StoreConfig(
        **options, memory_budget_bytes=3 * 2 * memory_row, disk_dir=str(tmp_path / "t")))
    rng = np.random.default_rng(0)
    for step in range(30):
        ids = rng.integers(0, 60, size=20)
        for store in (plain, tiered):
            store.lookup(ids, train=True, now=1.8e9 + step)
            store.apply_gradients(ids, np.ones((20, DIM), F32), step, now=1.8e9 + step)
    tiers = tiered._native.tier_stats()
    assert tiers["disk_rows"] > tiers["memory_rows"] > 0 and tiers["faults"] > 0
    _assert_same_rows(plain, tiered, "stores")
