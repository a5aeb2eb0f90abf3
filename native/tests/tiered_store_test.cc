// Two tiers (docs/tiered-store.md): a store with a small memory budget answers lookups and
// takes updates bit for bit as an unbounded store does on the same calls, while its rows move
// to disk and back; and the budget's options are checked at the boundary.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "internal/store_impl.h"
#include "prefixrec/embedding_store.h"
#include "prefixrec/store_error.h"

namespace prefixrec {
namespace {

class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/tiered_store_test.XXXXXX";
    char* made = mkdtemp(pattern);
    REQUIRE(made != nullptr);
    path_ = made;
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

StoreOptions BaseOptions(OptimizerKind kind, FilterKind filter) {
  StoreOptions o;
  o.dim = 4;
  o.optimizer.kind = kind;
  o.optimizer.learning_rate = 0.05f;
  o.initializer.kind = InitializerKind::kUniform;
  o.initializer.scale = 0.1f;
  o.seed = 7;
  o.num_shards = 4;
  o.num_threads = 2;
  o.filter.kind = filter;
  o.filter.min_count = 2;
  o.filter.probability = 0.5;
  return o;
}

// ExportRows as one string per row (id, count, step, time, norm, values, state), sorted.
std::vector<std::string> SortedRows(const EmbeddingStore& store) {
  const RowArrays r = store.ExportRows(true);
  const size_t dim = static_cast<size_t>(store.dim()), state = static_cast<size_t>(store.state_floats());
  std::vector<std::string> rows;
  for (size_t i = 0; i < r.ids.size(); ++i) {
    std::string row(reinterpret_cast<const char*>(&r.ids[i]), 8);
    row.append(reinterpret_cast<const char*>(&r.update_counts[i]), 4);
    row.append(reinterpret_cast<const char*>(&r.last_steps[i]), 8);
    row.append(reinterpret_cast<const char*>(&r.last_times[i]), 8);
    row.append(reinterpret_cast<const char*>(&r.l2_norms[i]), 4);
    row.append(reinterpret_cast<const char*>(&r.values[i * dim]), 4 * dim);
    row.append(reinterpret_cast<const char*>(&r.state[i * state]), 4 * state);
    rows.push_back(row);
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Skewed ids in [0, 3000): a few hot ones, a long tail that keeps leaving memory.
std::vector<int64_t> Batch(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> ids(n);
  for (auto& id : ids) {
    const double x = u(rng);
    id = static_cast<int64_t>(3000.0 * x * x * x);
  }
  return ids;
}

// prefetch: b is also given batch k + 1's ids between batch k's lookup and its update, as the
// trainer's pipeline does; then no lookup or update of b reads from disk.
void CheckSameAsUnbounded(OptimizerKind kind, FilterKind filter, EvictionKind eviction,
                          bool prefetch = false) {
  TempDir dir;
  StoreOptions plain = BaseOptions(kind, filter);
  StoreOptions tiered = plain;
  tiered.memory_budget_bytes = 4 * 40 * MemoryRowBytes(plain);  // 40 rows a shard in memory
  tiered.disk_dir = dir.path() + "/tiers";
  tiered.eviction = eviction;
  EmbeddingStore a(plain), b(tiered);
  // Followers of each: the deltas of the two stores must carry the same rows and tombstones.
  StoreOptions tiered_follower = tiered;
  tiered_follower.disk_dir = dir.path() + "/follower-tiers";
  EmbeddingStore follow_a(plain), follow_b(tiered_follower);  // b's follower is budgeted too
  std::mt19937_64 rng(20261128);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const size_t dim = 4;
  // Mostly small batches; every 20th one takes the large-batch path (n >= 4096).
  auto draw = [&](int step) { return Batch(rng, step % 20 == 0 ? 5000 : 1 + rng() % 200); };
  std::vector<int64_t> upcoming = draw(1);
  for (int step = 1; step <= 121; ++step) {
    const std::vector<int64_t> ids = upcoming;
    const size_t n = ids.size();
    const double now = 1.8e9 + step;
    std::vector<float> out_a(n * dim), out_b(n * dim);
    const uint64_t faults_before = b.Stats().faults;
    a.Lookup(ids.data(), n, /*train=*/true, now, out_a.data());
    b.Lookup(ids.data(), n, /*train=*/true, now, out_b.data());
    REQUIRE_MESSAGE(SameBits(out_a, out_b), "training lookup differs at step " << step);
    upcoming = draw(step + 1);
    if (prefetch) b.Prefetch(upcoming.data(), upcoming.size());
    std::vector<float> grads(n * dim);
    for (auto& x : grads) x = g(rng);
    const float l2 = step % 3 == 0 ? 0.01f : 0.0f;
    a.ApplyGradients(ids.data(), grads.data(), n, step, now, l2);
    b.ApplyGradients(ids.data(), grads.data(), n, step, now, l2);
    if (prefetch && step > 1) {
      CHECK_MESSAGE(b.Stats().faults == faults_before, "a prefetched batch read disk at step " << step);
    }
    if (step % 7 == 0) {  // a serving read of other ids: faults rows in, admits none
      const std::vector<int64_t> read = Batch(rng, 300);
      std::vector<float> ra(read.size() * dim), rb(read.size() * dim);
      a.Lookup(read.data(), read.size(), /*train=*/false, now, ra.data());
      b.Lookup(read.data(), read.size(), /*train=*/false, now, rb.data());
      REQUIRE_MESSAGE(SameBits(ra, rb), "serving lookup differs at step " << step);
    }
    if (step % 11 == 0) {  // removals and expiry reach rows in either tier
      const std::vector<int64_t> gone = Batch(rng, 50);
      REQUIRE(a.Remove(gone.data(), gone.size()) == b.Remove(gone.data(), gone.size()));
      REQUIRE(a.Expire(30, -1.0, now) == b.Expire(30, -1.0, now));
    }
    if (step % 13 == 0) {  // a row updated then moved to disk is still in its delta
      const std::string path_a = a.ExportDelta(dir.path() + "/deltas-a");
      const std::string path_b = b.ExportDelta(dir.path() + "/deltas-b");
      const auto da = follow_a.ReadDelta(path_a), db = follow_b.ReadDelta(path_b);
      CHECK(da.sequence == db.sequence);
      CHECK(da.ids == db.ids);
      CHECK(da.tombstones == db.tombstones);
      CHECK(SameBits(da.embeddings, db.embeddings));
      follow_a.ApplyDelta(path_a);
      follow_b.ApplyDelta(path_b);
    }
    REQUIRE(a.size() == b.size());
  }
  CHECK(SortedRows(follow_a) == SortedRows(follow_b));
  CHECK(follow_b.size() > 0);
  CHECK(follow_b.Stats().disk_rows > 0);
  // Every row, with its optimizer state and metadata, wherever it lives.
  CHECK(SortedRows(a) == SortedRows(b));
  const StoreStats sa = a.Stats(), sb = b.Stats();
  CHECK(sa.rows == sb.rows);
  CHECK(sa.admitted == sb.admitted);
  CHECK(sa.rejected == sb.rejected);
  CHECK(sa.updates == sb.updates);
  CHECK(sb.memory_rows + sb.disk_rows == sb.rows);
  // The budget, overrun at most by the last batch's pinned rows (step 121: at most 200 ids).
  CHECK(sb.memory_rows <= 4 * 40 + 200);
  CHECK(sb.disk_rows > 0);          // the budget did push rows out ...
  CHECK(sb.faults + sb.prefetched > 0);  // ... and some came back
  CHECK((sb.prefetched > 0) == prefetch);
  CHECK(sb.evicted_to_disk >= sb.disk_rows);
  CHECK(sb.disk_reads >= sb.faults + sb.prefetched);  // and the streams of exports and expiry
  CHECK(sb.disk_writes >= sb.evicted_to_disk);
  CHECK(sa.disk_rows == 0);
  CHECK(sa.memory_rows == sa.rows);
  // With rows on disk: its snapshot loads (unbounded) to the unbounded store's rows.
  a.Save(dir.path() + "/snap-a");
  b.Save(dir.path() + "/snap-b");
  const auto loaded_a = EmbeddingStore::Load(dir.path() + "/snap-a");
  const auto loaded_b = EmbeddingStore::Load(dir.path() + "/snap-b");
  CHECK(SortedRows(*loaded_b) == SortedRows(*loaded_a));
  CHECK(SortedRows(*loaded_b) == SortedRows(a));
  CHECK(loaded_b->Stats().admitted == loaded_a->Stats().admitted);
  CHECK(loaded_b->ExportFilter().ids == loaded_a->ExportFilter().ids);
  // A rebase delta towards another store's snapshot: the same rows and tombstones.
  {
    StoreOptions other_options = plain;
    other_options.seed = 99;
    EmbeddingStore other(other_options);
    std::vector<int64_t> some = Batch(rng, 400);
    std::vector<float> rows(some.size() * dim);
    other.Lookup(some.data(), some.size(), true, 1.8e9, rows.data());
    other.Lookup(some.data(), some.size(), true, 1.8e9, rows.data());  // counter filter: 2nd sighting
    other.Save(dir.path() + "/snap-other");
    CHECK(b.Stats().disk_rows > 0);
    const auto ra = a.WriteRebaseDelta(dir.path() + "/snap-other", dir.path() + "/rebase-a.bin");
    const auto rb = b.WriteRebaseDelta(dir.path() + "/snap-other", dir.path() + "/rebase-b.bin");
    CHECK(ra.rows == rb.rows);
    CHECK(ra.tombstones == rb.tombstones);
    CHECK(ra.unchanged == rb.unchanged);
    CHECK(ra.tombstones > 0);
    const auto da = a.ReadDelta(dir.path() + "/rebase-a.bin");
    const auto db = b.ReadDelta(dir.path() + "/rebase-b.bin");
    CHECK(da.ids == db.ids);
    CHECK(da.tombstones == db.tombstones);
    CHECK(SameBits(da.embeddings, db.embeddings));
  }
  // Loaded into a budget: rows beyond it go to disk as they are read; the rows are the same.
  const auto loaded_tiered = EmbeddingStore::Load(dir.path() + "/snap-a", tiered.memory_budget_bytes,
                                                  dir.path() + "/loaded-tiers", eviction);
  CHECK(SortedRows(*loaded_tiered) == SortedRows(a));
  CHECK(loaded_tiered->Stats().disk_rows > 0);
  CHECK(loaded_tiered->Stats().memory_rows <= 4 * 40);
  if (filter == FilterKind::kCounter) {  // pending sightings merge only into ids without a row
    std::vector<int64_t> ids(3000);
    std::vector<uint32_t> counts(3000, 1);
    for (int64_t i = 0; i < 3000; ++i) ids[i] = i;
    CHECK(b.Stats().disk_rows > 0);
    CHECK(a.MergeFilter(ids.data(), counts.data(), ids.size(), nullptr, 0) ==
          b.MergeFilter(ids.data(), counts.data(), ids.size(), nullptr, 0));
    CHECK(a.ExportFilter().ids == b.ExportFilter().ids);
  }
  // Every id, read back: the same rows (and zeros) whichever tier holds them.
  std::vector<int64_t> all(3000);
  for (int64_t i = 0; i < 3000; ++i) all[i] = i;
  std::vector<float> ra(all.size() * dim), rb(all.size() * dim);
  a.Lookup(all.data(), all.size(), false, 0.0, ra.data());
  b.Lookup(all.data(), all.size(), false, 0.0, rb.data());
  CHECK(SameBits(ra, rb));
  // The call's ids are pinned: reading all 3000 brought every row back to memory.
  CHECK(b.Stats().disk_rows == 0);
}

TEST_CASE("a budgeted store looks up and updates as an unbounded one (LRU, Adagrad, counter filter)") {
  CheckSameAsUnbounded(OptimizerKind::kAdagrad, FilterKind::kCounter, EvictionKind::kLru);
}

TEST_CASE("a budgeted store looks up and updates as an unbounded one (LFU, Adam, probability filter)") {
  CheckSameAsUnbounded(OptimizerKind::kAdam, FilterKind::kProbability, EvictionKind::kLfu);
}

TEST_CASE("a budgeted store looks up and updates as an unbounded one (LRU, FTRL, no filter)") {
  CheckSameAsUnbounded(OptimizerKind::kFtrl, FilterKind::kNone, EvictionKind::kLru);
}

TEST_CASE("a budgeted store given the next batch's ids ahead reads no row from disk in its lookups and updates and equals an unbounded one") {
  CheckSameAsUnbounded(OptimizerKind::kAdagrad, FilterKind::kCounter, EvictionKind::kLru, true);
  CheckSameAsUnbounded(OptimizerKind::kAdam, FilterKind::kNone, EvictionKind::kLfu, true);
}

TEST_CASE("threads looking up and updating while rows move between tiers lose and mix no row") {
  TempDir dir;
  StoreOptions o = BaseOptions(OptimizerKind::kSgd, FilterKind::kNone);
  o.optimizer.learning_rate = 1.0f;
  o.initializer.kind = InitializerKind::kZeros;
  o.memory_budget_bytes = 4 * 30 * MemoryRowBytes(o);
  o.disk_dir = dir.path();
  o.num_threads = 1;
  EmbeddingStore store(o);
  // Thread t owns ids t, t + 4, t + 8, ... below 2000; each update adds exactly 1 to every
  // value of the row (SGD, lr 1, gradient -1), so a row's values are its update count.
  constexpr int kThreads = 4, kSteps = 150;
  std::vector<std::vector<float>> expected(kThreads, std::vector<float>(2000, 0.0f));
  std::atomic<int> wrong_reads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int step = 1; step <= kSteps; ++step) {
        std::vector<int64_t> ids(1 + rng() % 64);
        for (auto& id : ids) id = t + 4 * static_cast<int64_t>(rng() % 500);
        std::vector<float> rows(ids.size() * 4), grads(ids.size() * 4, -1.0f);
        store.Lookup(ids.data(), ids.size(), true, 1.8e9, rows.data());
        for (size_t i = 0; i < ids.size(); ++i) {
          for (int j = 0; j < 4; ++j) {
            if (rows[i * 4 + j] != expected[t][ids[i]]) wrong_reads.fetch_add(1);
          }
        }
        store.ApplyGradients(ids.data(), grads.data(), ids.size(), step, 1.8e9);
        std::vector<int64_t> distinct(ids);
        std::sort(distinct.begin(), distinct.end());
        distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
        for (int64_t id : distinct) expected[t][id] += static_cast<float>(std::count(ids.begin(), ids.end(), id));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(wrong_reads.load() == 0);
  const StoreStats stats = store.Stats();
  CHECK(stats.disk_rows > 0);
  CHECK(stats.faults > 0);
  const RowArrays rows = store.ExportRows(true);
  size_t checked = 0;
  for (size_t i = 0; i < rows.ids.size(); ++i) {
    const int64_t id = rows.ids[i];
    for (int j = 0; j < 4; ++j) CHECK(rows.values[i * 4 + j] == expected[id % 4][id]);
    ++checked;
  }
  size_t touched = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (float v : expected[t]) touched += v > 0 ? 1 : 0;
  }
  CHECK(checked == touched);
}

std::string InvalidMessage(const StoreOptions& o) {
  try {
    ValidateOptions(o);
  } catch (const StoreError& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST_CASE("the memory budget's options are checked before anything is created") {
  StoreOptions o = BaseOptions(OptimizerKind::kAdagrad, FilterKind::kNone);
  o.memory_budget_bytes = 1 << 20;
  CHECK(InvalidMessage(o).find("needs a disk_dir") != std::string::npos);
  o.memory_budget_bytes = 0;
  o.disk_dir = "/tmp/unused";
  CHECK(InvalidMessage(o).find("disk_dir is set but memory_budget_bytes is 0") != std::string::npos);
  o.memory_budget_bytes = 4 * MemoryRowBytes(o) - 1;  // less than a row a shard
  CHECK(InvalidMessage(o).find("at least one row a shard") != std::string::npos);
  o.memory_budget_bytes = 4 * MemoryRowBytes(o);
  CHECK(InvalidMessage(o).empty());
  o.eviction = static_cast<EvictionKind>(9);
  CHECK(InvalidMessage(o).find("unknown eviction kind 9") != std::string::npos);
  o.eviction = EvictionKind::kLfu;
  o.max_rows = 10;
  CHECK(InvalidMessage(o).find("max_rows is not supported yet") != std::string::npos);
  // Adagrad at dim 4: 20-byte header + 8 floats + a 5-byte slot share.
  CHECK(MemoryRowBytes(o) == 20 + 32 + 5);
}

TEST_CASE("Contains answers which ids have a row, in memory or on disk, and changes nothing") {
  TempDir dir;
  StoreOptions plain = BaseOptions(OptimizerKind::kAdagrad, FilterKind::kCounter);
  StoreOptions tiered = plain;
  tiered.memory_budget_bytes = 4 * 40 * MemoryRowBytes(plain);
  tiered.disk_dir = dir.path() + "/tiers";
  EmbeddingStore a(plain), b(tiered);
  // 20,000 ids seen twice (admitted), 20,000 once (pending in the filter), in steps so that
  // most of the tiered store's rows go to disk
  std::vector<int64_t> ids(20000), once(20000);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int64_t>(i) * 3 - 7000;
    once[i] = ids[i] + 1;
  }
  std::vector<float> rows(ids.size() * 4), grads(ids.size() * 4, 0.01f);
  for (int step = 1; step <= 2; ++step) {
    for (EmbeddingStore* s : {&a, &b}) {
      s->Lookup(ids.data(), ids.size(), true, 100.0 + step, rows.data());
      s->ApplyGradients(ids.data(), grads.data(), ids.size(), step, 100.0 + step);
    }
  }
  for (EmbeddingStore* s : {&a, &b}) {  // a step on a few ids: the others go to disk
    s->Lookup(ids.data(), 40, true, 103.0, rows.data());
    s->ApplyGradients(ids.data(), grads.data(), 40, 3, 103.0);
    s->Lookup(once.data(), once.size(), true, 104.0, rows.data());
  }
  REQUIRE(b.Stats().disk_rows > 0);
  std::vector<int64_t> asked(ids);
  asked.insert(asked.end(), once.begin(), once.end());
  const StoreStats before_a = a.Stats(), before_b = b.Stats();
  const std::vector<std::string> rows_b = SortedRows(b);
  std::vector<uint8_t> in_a(asked.size(), 7), in_b(asked.size(), 7);
  a.Contains(asked.data(), asked.size(), in_a.data());
  b.Contains(asked.data(), asked.size(), in_b.data());
  for (size_t i = 0; i < asked.size(); ++i) {
    CHECK(in_a[i] == (i < ids.size() ? 1 : 0));
    CHECK(in_b[i] == in_a[i]);
  }
  CHECK(a.Stats().lookups == before_a.lookups);
  CHECK(a.Stats().rejected == before_a.rejected);
  CHECK(b.Stats().disk_rows == before_b.disk_rows);
  CHECK(b.Stats().faults == before_b.faults);
  CHECK(SortedRows(b) == rows_b);
}

}  // namespace
}  // namespace prefixrec
