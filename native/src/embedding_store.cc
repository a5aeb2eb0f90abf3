// Batch operations of the embedding store: lookup, filters, optimizers, expiry, eviction.
#include "prefixrec/embedding_store.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "internal/disk_tier_io.h"
#include "internal/hash.h"
#include "internal/kernels.h"
#include "internal/scratch.h"
#include "internal/parallel.h"
#include "internal/store_impl.h"

namespace prefixrec {

using internal::HashId;
using internal::Mix64;
using internal::ParallelFor;
using internal::RowHeader;
using internal::Shard;
using internal::UnitDouble;

namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw StoreError(ErrorCode::kInvalidArgument, message);
}

bool Finite(float x) { return std::isfinite(x); }

// Small open-addressing set/map of int64 used inside one batch call (not shared).
class LocalIndex {
 public:
  explicit LocalIndex(size_t expected) {
    size_t capacity = 16;
    while (capacity < expected * 2) capacity <<= 1;
    keys_.resize(capacity);
    values_.assign(capacity, kNone);
    mask_ = capacity - 1;
  }
  static constexpr uint32_t kNone = 0xffffffffu;
  // Returns the value stored for key, inserting `value` if absent.
  uint32_t FindOrInsert(int64_t key, uint32_t value, bool* inserted) {
    for (size_t i = Mix64(static_cast<uint64_t>(key)) & mask_;; i = (i + 1) & mask_) {
      if (values_[i] == kNone) {
        keys_[i] = key;
        values_[i] = value;
        *inserted = true;
        return value;
      }
      if (keys_[i] == key) {
        *inserted = false;
        return values_[i];
      }
    }
  }

 private:
  std::vector<int64_t> keys_;
  std::vector<uint32_t> values_;
  size_t mask_;
};

uint64_t ColumnBits(uint64_t key, uint64_t counter) {
  return Mix64(key ^ Mix64(counter + 0x632be59bd9b4e019ULL));
}

// Open-addressing table of 4-byte indices into a dense key array, in scratch memory. It starts
// at about n/2 slots (batches are mostly repeats, and a small table stays in L2) and doubles
// when 5/8 full, rebuilt from the keys.
class ScratchIndex {
 public:
  ScratchIndex(internal::ScratchSet& scratch, size_t buffer, size_t n)
      : scratch_(scratch), buffer_(buffer) {
    size_t capacity = 64;
    while (capacity < n / 2) capacity <<= 1;
    Resize(capacity, nullptr, 0);
  }
  // Slot of `key` (hash `h`) in keys[0 .. count): its index, or kNone where it would go.
  uint32_t* Slot(const int64_t* keys, int64_t key, uint64_t h) {
    for (size_t slot = h & mask_;; slot = (slot + 1) & mask_) {
      uint32_t u = table_[slot];
      if (u == LocalIndex::kNone || keys[u] == key) return &table_[slot];
    }
  }
  // Call after adding key number count - 1; may move the slots.
  void Added(const int64_t* keys, size_t count, uint64_t (*hash)(int64_t)) {
    if (count * 8 > (mask_ + 1) * 5) Resize((mask_ + 1) * 2, keys, count, hash);
  }

 private:
  void Resize(size_t capacity, const int64_t* keys, size_t count,
              uint64_t (*hash)(int64_t) = nullptr) {
    table_ = scratch_.Get<uint32_t>(buffer_, capacity);
    mask_ = capacity - 1;
    std::fill(table_, table_ + capacity, LocalIndex::kNone);
    for (size_t u = 0; u < count; ++u) {
      size_t slot = hash(keys[u]) & mask_;
      while (table_[slot] != LocalIndex::kNone) slot = (slot + 1) & mask_;
      table_[slot] = static_cast<uint32_t>(u);
    }
  }

  internal::ScratchSet& scratch_;
  size_t buffer_;
  uint32_t* table_ = nullptr;
  size_t mask_ = 0;
};

// Hash of the private dedup tables: one multiply, its high half folded into the low bits the
// table uses (a full Mix64 was a tenth of a dim-8 lookup). A bad spread only slows a table down.
uint64_t DedupHash(int64_t id) {
  const uint64_t h = static_cast<uint64_t>(id) * 0x9e3779b97f4a7c15ULL;
  return h ^ (h >> 32);
}
uint64_t LowStoreHash(int64_t id) { return static_cast<uint32_t>(HashId(id)); }

// unique[0 .. result) = distinct ids in order of first appearance, inverse[i] = index of ids[i];
// unique has room for n ids. The table lives in scratch buffer `buffer`. (A table of (id, index)
// pairs with the slot kAhead ids on prefetched was tried: no faster.)
size_t DeduplicateRaw(const int64_t* ids, size_t n, internal::ScratchSet& scratch, size_t buffer,
                      int64_t* unique, uint32_t* inverse) {
  ScratchIndex index(scratch, buffer, n);
  uint32_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    uint32_t* slot = index.Slot(unique, id, DedupHash(id));
    if (*slot != LocalIndex::kNone) {
      inverse[i] = *slot;
      continue;
    }
    *slot = count;
    unique[count] = id;
    inverse[i] = count++;
    index.Added(unique, count, DedupHash);
  }
  return count;
}

// unique = distinct ids in order of first appearance, inverse[i] = index of ids[i] in unique.
// The table holds only indices into `unique` (4 bytes a slot), so it stays in L2 longer than a
// table of (id, index) pairs would.
template <typename Index>
void DeduplicateInto(const int64_t* ids, size_t n, std::vector<int64_t>* unique, Index* inverse) {
  unique->clear();
  unique->reserve(n / 4 + 16);
  size_t capacity = 16;
  while (capacity < n + n / 2) capacity <<= 1;
  const size_t mask = capacity - 1;
  std::unique_ptr<uint32_t[]> table(new uint32_t[capacity]);
  std::fill(table.get(), table.get() + capacity, LocalIndex::kNone);
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    size_t slot = Mix64(static_cast<uint64_t>(id)) & mask;
    for (;; slot = (slot + 1) & mask) {
      uint32_t u = table[slot];
      if (u == LocalIndex::kNone) {
        u = static_cast<uint32_t>(unique->size());
        table[slot] = u;
        unique->push_back(id);
        inverse[i] = static_cast<Index>(u);
        break;
      }
      if ((*unique)[u] == id) {
        inverse[i] = static_cast<Index>(u);
        break;
      }
    }
  }
}

}  // namespace

int OptimizerStateWidth(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return 0;
    case OptimizerKind::kAdagrad: return 1;
    case OptimizerKind::kAdam: return 2;
    case OptimizerKind::kFtrl: return 2;
  }
  return -1;
}

void ValidateOptions(const StoreOptions& o) {
  auto positive_finite = [](float x) { return std::isfinite(x) && x > 0; };
  if (o.dim < 1 || o.dim > 4096) Invalid("dim must be in 1..4096, got " + std::to_string(o.dim));
  if (o.num_shards < 1 || o.num_shards > 4096) {
    Invalid("num_shards must be in 1..4096, got " + std::to_string(o.num_shards));
  }
  if (o.num_threads < 0 || o.num_threads > 256) {
    Invalid("num_threads must be in 0..256, got " + std::to_string(o.num_threads));
  }
  // As the Python facade: at most 2**63 - 1, so the value fits an int64 on every side.
  if (o.max_rows > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    Invalid("max_rows must be in 0..2**63-1 (0: unbounded), got " + std::to_string(o.max_rows));
  }
  const OptimizerOptions& opt = o.optimizer;
  switch (opt.kind) {
    case OptimizerKind::kSgd:
      if (!positive_finite(opt.learning_rate)) Invalid("SGD learning rate must be > 0");
      break;
    case OptimizerKind::kAdagrad:
      if (!positive_finite(opt.learning_rate)) Invalid("Adagrad learning rate must be > 0");
      if (!positive_finite(opt.initial_accumulator)) Invalid("Adagrad initial_accumulator must be > 0");
      break;
    case OptimizerKind::kAdam:
      if (!positive_finite(opt.learning_rate)) Invalid("Adam learning rate must be > 0");
      if (!(opt.beta1 >= 0 && opt.beta1 < 1)) Invalid("Adam beta1 must be in [0, 1)");
      if (!(opt.beta2 >= 0 && opt.beta2 < 1)) Invalid("Adam beta2 must be in [0, 1)");
      if (!positive_finite(opt.epsilon)) Invalid("Adam epsilon must be > 0");
      break;
    case OptimizerKind::kFtrl:
      if (!positive_finite(opt.alpha)) Invalid("FTRL alpha must be > 0");
      if (!(std::isfinite(opt.beta) && opt.beta >= 0)) Invalid("FTRL beta must be >= 0");
      if (!(std::isfinite(opt.l1) && opt.l1 >= 0)) Invalid("FTRL l1 must be >= 0");
      if (!(std::isfinite(opt.l2) && opt.l2 >= 0)) Invalid("FTRL l2 must be >= 0");
      break;
    default:
      Invalid("unknown optimizer kind " + std::to_string(static_cast<uint32_t>(opt.kind)));
  }
  switch (o.initializer.kind) {
    case InitializerKind::kZeros: break;
    case InitializerKind::kUniform:
    case InitializerKind::kTruncatedNormal:
      if (!(std::isfinite(o.initializer.scale) && o.initializer.scale >= 0)) {
        Invalid("initializer scale must be a finite number >= 0");
      }
      break;
    default:
      Invalid("unknown initializer kind " + std::to_string(static_cast<uint32_t>(o.initializer.kind)));
  }
  const FilterOptions& f = o.filter;
  switch (f.kind) {
    case FilterKind::kNone: break;
    case FilterKind::kProbability:
      if (!(f.probability >= 0 && f.probability <= 1)) Invalid("filter probability must be in [0, 1]");
      break;
    case FilterKind::kCountingBloom:
      if (f.min_count < 1 || f.min_count > 255) {
        Invalid("CountingBloomFilter min_count must be in 1..255, got " + std::to_string(f.min_count));
      }
      if (f.capacity < 1 || f.capacity > (uint64_t{1} << 36)) {
        Invalid("CountingBloomFilter capacity must be in 1..2**36, got " + std::to_string(f.capacity));
      }
      if (!(f.false_positive_rate > 0 && f.false_positive_rate < 1)) {
        Invalid("CountingBloomFilter false_positive_rate must be in (0, 1)");
      }
      break;
    case FilterKind::kCounter:
      if (f.min_count < 1) Invalid("CounterFilter min_count must be >= 1");
      break;
    default:
      Invalid("unknown filter kind " + std::to_string(static_cast<uint32_t>(f.kind)));
  }
  if (o.eviction != EvictionKind::kLru && o.eviction != EvictionKind::kLfu) {
    Invalid("unknown eviction kind " + std::to_string(static_cast<uint32_t>(o.eviction)));
  }
  if (o.memory_budget_bytes == 0) {
    if (!o.disk_dir.empty()) Invalid("disk_dir is set but memory_budget_bytes is 0 (unbounded)");
    return;
  }
  if (o.disk_dir.empty()) Invalid("memory_budget_bytes needs a disk_dir for the rows beyond it");
  if (o.max_rows != 0) Invalid("max_rows is not supported yet with memory_budget_bytes");
  const uint64_t min_budget = static_cast<uint64_t>(o.num_shards) * MemoryRowBytes(o);
  if (o.memory_budget_bytes < min_budget) {
    Invalid("memory_budget_bytes must hold at least one row a shard: >= num_shards x " +
            std::to_string(MemoryRowBytes(o)) + " = " + std::to_string(min_budget) + ", got " +
            std::to_string(o.memory_budget_bytes));
  }
}

// A memory row's share of the budget: its bytes plus its table slot at the table's highest
// load (4 / 0.85 bytes, rounded up).
uint64_t MemoryRowBytes(const StoreOptions& o) {
  const uint64_t floats = static_cast<uint64_t>(o.dim) * (1 + OptimizerStateWidth(o.optimizer.kind));
  return sizeof(RowHeader) + 4 * floats + 5;
}

namespace {

// Adam's bias correction 1 - beta^t of a row's t-th update.
float AdamCorrection(float beta, uint32_t t) {
  return static_cast<float>(1.0 - std::pow(static_cast<double>(beta), t));
}

}  // namespace

EmbeddingStore::Impl::Impl(const StoreOptions& o) : options(o) {
  ValidateOptions(o);
  dim = o.dim;
  state_floats = o.dim * OptimizerStateWidth(o.optimizer.kind);
  row_bytes = sizeof(RowHeader) + sizeof(float) * static_cast<size_t>(dim + state_floats);
  threads = o.num_threads > 0 ? o.num_threads
                              : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  bloom_counters = BloomCountersPerShard(o);
  bloom_hashes = BloomHashes(o);
  if (o.optimizer.kind == OptimizerKind::kAdam) {
    adam_corrections.resize(2 * static_cast<size_t>(kAdamCorrections));
    for (uint32_t t = 0; t < kAdamCorrections; ++t) {
      adam_corrections[2 * t] = AdamCorrection(o.optimizer.beta1, t);
      adam_corrections[2 * t + 1] = AdamCorrection(o.optimizer.beta2, t);
    }
  }
  shards.reserve(o.num_shards);
  for (int s = 0; s < o.num_shards; ++s) {
    shards.emplace_back(new Shard(row_bytes));
    if (bloom_counters > 0) shards.back()->bloom.assign(bloom_counters, 0);
  }
  if (o.memory_budget_bytes > 0) {
    const size_t cap = static_cast<size_t>(o.memory_budget_bytes / static_cast<uint64_t>(o.num_shards) /
                                           MemoryRowBytes(o));
    internal::disk_tier_io::MakeDir(o.disk_dir);
    internal::DiskTierOptions tier_options;
    tier_options.row_bytes = row_bytes;
    for (int s = 0; s < o.num_shards; ++s) {
      char name[32];
      std::snprintf(name, sizeof name, "/shard-%04d", s);
      Shard& shard = *shards[s];
      shard.memory_rows_cap = std::max<size_t>(cap, 1);
      // kCreate: the tier extends memory; whatever a previous process left is discarded.
      shard.tier = internal::OpenSlotFileTier(o.disk_dir + name, tier_options,
                                              internal::DiskTierOpen::kCreate);
    }
  }
}

// Standard sizing: m = -n ln(p) / ln(2)^2 counters in all, k = m/n ln(2) hash functions.
uint64_t EmbeddingStore::Impl::BloomCountersPerShard(const StoreOptions& o) {
  if (o.filter.kind != FilterKind::kCountingBloom) return 0;
  double ln2 = std::log(2.0);
  double total = std::ceil(-static_cast<double>(o.filter.capacity) *
                           std::log(o.filter.false_positive_rate) / (ln2 * ln2));
  return std::max<uint64_t>(64, static_cast<uint64_t>(std::ceil(total / o.num_shards)));
}

int EmbeddingStore::Impl::BloomHashes(const StoreOptions& o) {
  if (o.filter.kind != FilterKind::kCountingBloom) return 0;
  return std::max(1, static_cast<int>(std::lround(-std::log(o.filter.false_positive_rate) / std::log(2.0))));
}

EmbeddingStore::Impl::Partition EmbeddingStore::Impl::Bucketize(const int64_t* ids, size_t n) const {
  // Two-pass parallel counting sort by shard over contiguous position ranges, so positions of a
  // shard stay in input order (gradient sums depend on that order).
  Partition p;
  const size_t num_shards = shards.size();
  const int threads_here = ThreadsFor(n);
  const size_t workers = RangeTasks(threads_here);  // tasks over position ranges
  p.hash.resize(n);
  p.order.resize(n);
  p.offsets.assign(num_shards + 1, 0);
  std::vector<uint16_t> shard_of(n);
  std::vector<size_t> counts(workers * num_shards, 0);
  auto range = [&](size_t w) { return std::make_pair(n * w / workers, n * (w + 1) / workers); };
  ParallelFor(threads_here, workers, [&](size_t w) {
    size_t* count = counts.data() + w * num_shards;
    auto [begin, end] = range(w);
    for (size_t i = begin; i < end; ++i) {
      uint64_t h = HashId(ids[i]);
      p.hash[i] = static_cast<uint32_t>(h);
      shard_of[i] = static_cast<uint16_t>(ShardOf(h));
      ++count[shard_of[i]];
    }
  });
  size_t running = 0;
  for (size_t shard = 0; shard < num_shards; ++shard) {
    p.offsets[shard] = running;
    for (size_t w = 0; w < workers; ++w) {
      size_t c = counts[w * num_shards + shard];
      counts[w * num_shards + shard] = running;  // becomes worker w's cursor in this shard
      running += c;
    }
  }
  p.offsets[num_shards] = running;
  ParallelFor(threads_here, workers, [&](size_t w) {
    size_t* cursor = counts.data() + w * num_shards;
    auto [begin, end] = range(w);
    for (size_t i = begin; i < end; ++i) p.order[cursor[shard_of[i]]++] = static_cast<uint32_t>(i);
  });
  return p;
}

void EmbeddingStore::Impl::ReadRows(const int64_t* ids, size_t begin, size_t end, float* out,
                                    std::vector<uint32_t>* misses) const {
  // Software pipeline over three stages, kDistance positions apart: hash and prefetch the slot;
  // read the slot and prefetch the row it points to; compare the key and copy the row. It keeps
  // ~2 * kDistance cache misses in flight instead of two dependent misses per id.
  constexpr size_t kDistance = 32, kRing = 128;
  const size_t dim = static_cast<size_t>(this->dim);
  uint64_t hash[kRing];
  uint32_t candidate[kRing];
  for (size_t i = begin; i < end + 2 * kDistance; ++i) {
    if (i < end) {
      uint64_t h = HashId(ids[i]);
      hash[i % kRing] = h;
      shards[ShardOf(h)]->Prefetch(static_cast<uint32_t>(h));
    }
    if (i >= begin + kDistance && i - kDistance < end) {
      size_t j = (i - kDistance) % kRing;
      candidate[j] = shards[ShardOf(hash[j])]->PrefetchCandidate(static_cast<uint32_t>(hash[j]),
                                                                sizeof(RowHeader) + 4 * dim);
    }
    if (i >= begin + 2 * kDistance) {
      size_t k = i - 2 * kDistance;
      uint64_t h = hash[k % kRing];
      const Shard& shard = *shards[ShardOf(h)];
      uint32_t row = candidate[k % kRing];
      if (row == Shard::kEmpty || shard.IdOf(row) != ids[k]) {
        row = row == Shard::kEmpty ? Shard::kEmpty : shard.Find(ids[k], static_cast<uint32_t>(h));
      }
      float* dst = out + k * dim;
      if (row == Shard::kEmpty) {
        std::fill(dst, dst + dim, 0.0f);
        if (misses) misses->push_back(static_cast<uint32_t>(k));
      } else {
        internal::CopyRow(dst, shard.Floats(row), dim);
      }
    }
  }
}

void EmbeddingStore::Impl::InitialValues(int64_t id, float* out) const {
  const InitializerOptions& init = options.initializer;
  uint64_t key = Mix64(options.seed ^ 0x3c6ef372fe94f82bULL) ^ HashId(id);
  switch (init.kind) {
    case InitializerKind::kZeros:
      std::fill(out, out + dim, 0.0f);
      break;
    case InitializerKind::kUniform:
      for (int c = 0; c < dim; ++c) {
        double u = UnitDouble(ColumnBits(key, static_cast<uint64_t>(c)));
        out[c] = static_cast<float>((2.0 * u - 1.0) * init.scale);
      }
      break;
    case InitializerKind::kTruncatedNormal: {
      // Box-Muller on counter-based uniforms, both outputs used; a value beyond 2 stddev is
      // dropped and the next one taken (p ~ 4.6% each), as TensorFlow's truncated_normal does.
      int c = 0;
      for (uint64_t counter = 0; c < dim && counter < 64 * static_cast<uint64_t>(dim) + 64;
           counter += 2) {
        double u1 = UnitDouble(ColumnBits(key, counter));
        double u2 = UnitDouble(ColumnBits(key, counter + 1));
        double radius = std::sqrt(-2.0 * std::log(1.0 - u1));
        double angle = 6.283185307179586 * u2;
        double z0 = radius * std::cos(angle), z1 = radius * std::sin(angle);
        if (std::fabs(z0) <= 2.0) out[c++] = static_cast<float>(z0 * init.scale);
        if (c < dim && std::fabs(z1) <= 2.0) out[c++] = static_cast<float>(z1 * init.scale);
      }
      for (; c < dim; ++c) out[c] = 0.0f;  // unreachable in practice (p < 1e-80)
      break;
    }
  }
}

void EmbeddingStore::Impl::InitRow(Shard& shard, uint32_t row, double now) const {
  RowHeader* header = shard.Header(row);
  header->count = RowHeader::kDirtyBit;  // no updates yet
  header->step = static_cast<uint32_t>(global_step.load(std::memory_order_relaxed));
  header->time = internal::EncodeTime(now);
  float* values = shard.Floats(row);
  InitialValues(header->id(), values);
  if (options.optimizer.kind == OptimizerKind::kAdagrad) {
    std::fill(values + dim, values + dim + state_floats, options.optimizer.initial_accumulator);
  }
}

bool EmbeddingStore::Impl::Admit(Shard& shard, size_t shard_index, int64_t id) const {
  const FilterOptions& f = options.filter;
  switch (f.kind) {
    case FilterKind::kNone:
      return true;
    case FilterKind::kProbability: {
      uint64_t stream = Mix64(options.seed ^ 0x5bd1e9955bd1e995ULL ^ (uint64_t{shard_index} << 40));
      double u = UnitDouble(Mix64(stream + shard.draw_counter++));
      return u < f.probability;
    }
    case FilterKind::kCountingBloom: {
      uint64_t g = Mix64((static_cast<uint64_t>(id) * 0xd6e8feb86659fd93ULL) ^ options.seed);
      uint64_t h1 = static_cast<uint32_t>(g), h2 = (g >> 32) | 1;
      uint32_t smallest = 255;
      for (int i = 0; i < bloom_hashes; ++i) {
        uint8_t& counter = shard.bloom[(h1 + static_cast<uint64_t>(i) * h2) % bloom_counters];
        if (counter < 255) ++counter;
        smallest = std::min<uint32_t>(smallest, counter);
      }
      return smallest >= f.min_count;
    }
    case FilterKind::kCounter: {
      uint32_t& count = shard.counts[id];
      if (++count < f.min_count) return false;
      shard.counts.erase(id);
      return true;
    }
  }
  return false;
}

void EmbeddingStore::Impl::Update(float* w, float* state, const float* g, uint32_t t) const {
  const OptimizerOptions& o = options.optimizer;
  switch (o.kind) {
    case OptimizerKind::kSgd:
      for (int j = 0; j < dim; ++j) w[j] -= o.learning_rate * g[j];
      break;
    case OptimizerKind::kAdagrad:
      internal::AdagradRow(w, state, g, static_cast<size_t>(dim), o.learning_rate);
      break;
    case OptimizerKind::kAdam: {
      float* m = state;
      float* v = state + dim;
      const bool cached = t < kAdamCorrections;
      const float correction1 = cached ? adam_corrections[2 * t] : AdamCorrection(o.beta1, t);
      const float correction2 = cached ? adam_corrections[2 * t + 1] : AdamCorrection(o.beta2, t);
      for (int j = 0; j < dim; ++j) {
        m[j] = o.beta1 * m[j] + (1.0f - o.beta1) * g[j];
        v[j] = o.beta2 * v[j] + (1.0f - o.beta2) * (g[j] * g[j]);
        w[j] -= o.learning_rate * (m[j] / correction1) / (std::sqrt(v[j] / correction2) + o.epsilon);
      }
      break;
    }
    case OptimizerKind::kFtrl: {
      float* z = state;
      float* n = state + dim;
      for (int j = 0; j < dim; ++j) {
        float n_new = n[j] + g[j] * g[j];
        float sigma = (std::sqrt(n_new) - std::sqrt(n[j])) / o.alpha;
        z[j] += g[j] - sigma * w[j];
        n[j] = n_new;
        if (std::fabs(z[j]) <= o.l1) {
          w[j] = 0.0f;
        } else {
          float sign_l1 = z[j] > 0 ? o.l1 : -o.l1;
          w[j] = -(z[j] - sign_l1) / ((o.beta + std::sqrt(n[j])) / o.alpha + o.l2);
        }
      }
      break;
    }
  }
}

void EmbeddingStore::Impl::RemoveRow(Shard& shard, uint32_t row) {
  int64_t id = shard.IdOf(row);
  shard.tombstones.push_back(id);
  shard.Remove(row, static_cast<uint32_t>(HashId(id)));
  rows.fetch_sub(1, std::memory_order_relaxed);
}

// Rows a disk tier's ForEach hands over at once (memory: one block, never every row on disk).
constexpr size_t kTierBlockRows = 16384;

size_t EmbeddingStore::Impl::FaultIn(Shard& shard, const int64_t* ids, const uint32_t* hashes,
                                     size_t n, std::atomic<uint64_t>& counter) {
  if (!shard.tier || n == 0 || shard.tier->Count() == 0) return 0;
  static thread_local std::vector<uint8_t> block, found;  // reused: no fresh pages per call
  block.resize(n * row_bytes);
  found.assign(n, 0);
  // Read, placed in memory, then erased from disk: a failure in between (a shard at its
  // maximum rows) leaves every row in exactly one tier.
  const size_t got = shard.tier->Get(ids, n, block.data(), found.data(), /*take=*/false);
  std::vector<int64_t> moved;
  moved.reserve(got);
  try {
    for (size_t i = 0; i < n && got > 0; ++i) {
      if (!found[i]) continue;
      const uint32_t row = shard.Insert(ids[i], hashes[i]);
      std::memcpy(shard.Row(row), block.data() + i * row_bytes, row_bytes);  // bytes unchanged
      moved.push_back(ids[i]);
    }
  } catch (...) {
    shard.tier->Erase(moved.data(), moved.size());
    throw;
  }
  shard.tier->Erase(moved.data(), moved.size());
  // Rows that moved up leave holes the next eviction refills; while the tier holds many more
  // slots than rows, each fault-in also fills twice as many holes as it opened (not all at
  // once: a lookup's time stays proportional to its own rows), so the file shrinks back.
  if (got > 0 && shard.tier->NeedsReclaim()) shard.tier->Reclaim(2 * got);
  counter.fetch_add(got, std::memory_order_relaxed);
  return got;
}

EmbeddingStore::Impl::Pins EmbeddingStore::Impl::PinLookup(const int64_t* ids, size_t n, bool train) {
  Pins pins;
  pins.own = std::make_shared<const IdSet>(ids, n);
  std::lock_guard<std::mutex> lock(pins_mu);
  pins.previous = last_training_lookup;
  if (train) last_training_lookup = pins.own;
  return pins;
}

std::shared_ptr<const EmbeddingStore::Impl::IdSet> EmbeddingStore::Impl::LastTrainingLookup() {
  std::lock_guard<std::mutex> lock(pins_mu);
  return last_training_lookup;
}

size_t EmbeddingStore::Impl::EvictToDisk(Shard& shard, const IdSet* pinned, const IdSet* also_pinned) {
  if (!shard.tier || shard.size() <= shard.memory_rows_cap) return 0;
  // Down to ~94% of the cap: the selection is O(shard rows), paid once per ~6% of new rows,
  // and the rows go to disk in one batched Put.
  const size_t target = shard.memory_rows_cap - shard.memory_rows_cap / 16;
  struct Candidate {
    int64_t first;
    int64_t second;
    int64_t id;
    uint32_t row;
  };
  // Kept per thread: a fresh vector of every row each eviction was mostly the kernel zeroing
  // new pages (the allocator maps blocks this large anew each time).
  static thread_local std::vector<Candidate> candidates;
  candidates.clear();
  candidates.reserve(shard.size());
  const int64_t current_step = global_step.load();
  const bool lfu = options.eviction == EvictionKind::kLfu;
  for (uint32_t r = 0; r < shard.size(); ++r) {
    const RowHeader* h = shard.Header(r);
    const int64_t last_step = internal::StepOf(h->step, current_step);
    if (lfu) {
      candidates.push_back({static_cast<int64_t>(h->update_count()), last_step, h->id(), r});
    } else {
      candidates.push_back({last_step, static_cast<int64_t>(h->time), h->id(), r});
    }
  }
  std::shared_ptr<const IdSet> prefetch;
  {
    std::lock_guard<std::mutex> lock(pins_mu);
    prefetch = last_prefetch;
  }
  auto kept = [&](int64_t id) {  // the current batch's rows, the previous lookup's, the next's
    return (pinned != nullptr && pinned->Contains(id)) ||
           (also_pinned != nullptr && also_pinned->Contains(id)) ||
           (prefetch != nullptr && prefetch->Contains(id));
  };
  auto first_out = [](const Candidate& a, const Candidate& b) {
    return std::tie(a.first, a.second, a.id) < std::tie(b.first, b.second, b.id);
  };
  // The `want` first rows in eviction order that are not kept: the first few rows in order
  // are sorted and checked, then the next ones (twice as many each round), so only the rows
  // looked at are checked against the pins. The order is strict (ids differ), so the rows
  // chosen are the same as checking every row first.
  const size_t want = shard.size() - target;
  std::vector<uint32_t> chosen;
  chosen.reserve(want);
  auto from = candidates.begin();
  for (size_t round = 0; chosen.size() < want && from != candidates.end(); ++round) {
    const size_t need = want - chosen.size();
    const size_t left = static_cast<size_t>(candidates.end() - from);
    const size_t take = std::min(left, (need + 64) << std::min<size_t>(round, 20));
    if (take < left) std::nth_element(from, from + (take - 1), candidates.end(), first_out);
    std::sort(from, from + take, first_out);
    for (auto it = from; it != from + take && chosen.size() < want; ++it) {
      if (!kept(it->id)) chosen.push_back(it->row);
    }
    from += take;
  }
  const size_t excess = chosen.size();
  if (excess == 0) return 0;
  static thread_local std::vector<int64_t> ids;
  static thread_local std::vector<uint8_t> block;
  ids.resize(excess);
  block.resize(excess * row_bytes);
  for (size_t i = 0; i < excess; ++i) {
    ids[i] = shard.IdOf(chosen[i]);
    std::memcpy(block.data() + i * row_bytes, shard.Row(chosen[i]), row_bytes);
  }
  // Written before anything leaves memory: a failed Put leaves every row in memory, and the
  // part of the batch it did write is erased again (no row is ever in both tiers).
  try {
    shard.tier->Put(ids.data(), block.data(), excess);
  } catch (...) {
    try {
      shard.tier->Erase(ids.data(), excess);
    } catch (...) {
    }
    throw;
  }
  for (size_t i = 0; i < excess; ++i) {
    const uint32_t hash = static_cast<uint32_t>(HashId(ids[i]));
    shard.Remove(shard.Find(ids[i], hash), hash);  // moved, not removed: no tombstone, rows kept
  }
  evicted_to_disk.fetch_add(excess, std::memory_order_relaxed);
  return excess;
}

size_t EmbeddingStore::Impl::EnforceCapacity() {
  if (options.max_rows == 0 || rows.load() <= options.max_rows) return 0;
  std::lock_guard<std::mutex> evict_lock(evict_mu);
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  locks.reserve(shards.size());
  for (auto& shard : shards) locks.emplace_back(shard->mu);  // always in shard order
  size_t total = 0;
  for (auto& shard : shards) total += shard->size();
  if (total <= options.max_rows) return 0;
  // Evict down to 1% below the cap: the scan is O(rows) with every shard locked, so a store that
  // sits at its cap pays it once per ~1% of new rows, not on every batch.
  size_t excess = total - (options.max_rows - options.max_rows / 100);
  struct Candidate {
    int64_t last_step;
    double last_time;
    int64_t id;
    uint32_t shard;
  };
  std::vector<Candidate> candidates;
  candidates.reserve(total);
  const int64_t current_step = global_step.load();
  for (uint32_t s = 0; s < shards.size(); ++s) {
    for (uint32_t r = 0; r < shards[s]->size(); ++r) {
      const RowHeader* h = shards[s]->Header(r);
      candidates.push_back({internal::StepOf(h->step, current_step), internal::DecodeTime(h->time),
                            h->id(), s});
    }
  }
  auto older = [](const Candidate& a, const Candidate& b) {
    return std::tie(a.last_step, a.last_time, a.id) < std::tie(b.last_step, b.last_time, b.id);
  };
  std::nth_element(candidates.begin(), candidates.begin() + (excess - 1), candidates.end(), older);
  for (size_t i = 0; i < excess; ++i) {
    Shard& shard = *shards[candidates[i].shard];
    uint32_t row = shard.Find(candidates[i].id, static_cast<uint32_t>(HashId(candidates[i].id)));
    RemoveRow(shard, row);
  }
  evicted.fetch_add(excess, std::memory_order_relaxed);
  return excess;
}

EmbeddingStore::EmbeddingStore(const StoreOptions& options) : impl_(new Impl(options)) {}
EmbeddingStore::EmbeddingStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EmbeddingStore::~EmbeddingStore() = default;

const StoreOptions& EmbeddingStore::options() const { return impl_->options; }
int EmbeddingStore::dim() const { return impl_->dim; }
int EmbeddingStore::state_floats() const { return impl_->state_floats; }
size_t EmbeddingStore::size() const { return impl_->rows.load(std::memory_order_relaxed); }

void EmbeddingStore::Lookup(const int64_t* ids, size_t n, bool train, double now, float* out) {
  Impl& s = *impl_;
  const size_t dim = static_cast<size_t>(s.dim);
  if (n < 4096) {
    s.LookupDistinct(ids, n, train, now, out);
    s.lookups.fetch_add(n, std::memory_order_relaxed);
    return;
  }
  // Batches of real (Zipf-like) traffic are mostly repeats: each task deduplicates its own range
  // of positions in a private table, reads each distinct id once and expands into its own part
  // of `out`, with no step that waits for the other tasks (a hot id in two ranges is read twice,
  // from cache). Only a training lookup that met unseen ids has a second, exclusive phase.
  // One task per thread: each task's range dedups more repeats away (two tasks per thread read
  // ~12% more distinct rows in all), and at 1M x 8 / 18 / 64 this measured 9-13% / 9% / 6%
  // faster than two per thread (paired runs in one process; still 4% faster at dim 8 with a
  // memory-bound job on the other core).
  const int threads = s.ThreadsFor(n);
  const size_t tasks = threads <= 1 ? 1 : static_cast<size_t>(threads);
  struct Range {
    int64_t* unique = nullptr;
    size_t distinct = 0;
    uint32_t* inverse = nullptr;
    float* rows = nullptr;
    std::vector<uint32_t> misses;  // indices into unique
  };
  std::vector<Range> ranges(tasks);
  internal::ScratchLease scratch;
  scratch->Reserve(4 * tasks);
  auto expand = [&](size_t t) {
    size_t begin = n * t / tasks, end = n * (t + 1) / tasks;
    internal::GatherRows(out + begin * dim, ranges[t].rows, ranges[t].inverse, end - begin, dim);
  };
  {
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    locks.reserve(s.shards.size());
    for (auto& shard : s.shards) locks.emplace_back(shard->mu);
    ParallelFor(threads, tasks, [&](size_t t) {
      size_t begin = n * t / tasks, end = n * (t + 1) / tasks;
      Range& r = ranges[t];
      const size_t count = end - begin;
      r.inverse = scratch->Get<uint32_t>(4 * t, count);
      r.unique = scratch->Get<int64_t>(4 * t + 1, count);
      r.distinct = DeduplicateRaw(ids + begin, count, *scratch, 4 * t + 2, r.unique, r.inverse);
      // The distinct rows are copied to a dense block first (measured faster than gathering
      // straight from the scattered store rows: the block stays in L2 at small dims).
      r.rows = scratch->Get<float>(4 * t + 3, r.distinct * dim);
      s.ReadRows(r.unique, 0, r.distinct, r.rows, train || s.tiered() ? &r.misses : nullptr);
      if (r.misses.empty()) expand(t);
    });
  }
  Impl::Pins pins;
  if (s.tiered()) pins = s.PinLookup(ids, n, train);
  if (train || s.tiered()) {
    std::vector<int64_t> missed_ids;
    std::vector<float*> missed_rows;
    std::vector<size_t> pending;
    for (size_t t = 0; t < tasks; ++t) {
      if (ranges[t].misses.empty()) continue;
      pending.push_back(t);
      for (uint32_t u : ranges[t].misses) {
        missed_ids.push_back(ranges[t].unique[u]);
        missed_rows.push_back(ranges[t].rows + static_cast<size_t>(u) * dim);
      }
    }
    if (!pending.empty()) {
      s.AdmitMissing(missed_ids, missed_rows, now, train, pins.own ? &pins : nullptr);
      ParallelFor(threads, pending.size(), [&](size_t k) { expand(pending[k]); });
    }
  }
  s.lookups.fetch_add(n, std::memory_order_relaxed);
}

void EmbeddingStore::LookupUnique(const int64_t* ids, size_t n, bool train, double now,
                                  std::vector<int64_t>* unique, int64_t* inverse,
                                  std::vector<float>* rows) {
  // Serial dedup: a parallel one (per-task tables merged in task order) was measured no faster
  // at 100k-id batches on 2 shared cores (its merge and extra pass ate the second core's gain).
  Deduplicate(ids, n, unique, inverse);
  rows->resize(unique->size() * static_cast<size_t>(impl_->dim));
  impl_->LookupDistinct(unique->data(), unique->size(), train, now, rows->data());
  impl_->lookups.fetch_add(n, std::memory_order_relaxed);
}

void EmbeddingStore::Impl::LookupDistinct(const int64_t* ids, size_t n, bool train, double now,
                                          float* out) {
  Impl& s = *this;
  const size_t dim = static_cast<size_t>(s.dim);
  const int threads = s.ThreadsFor(n);
  const size_t workers = Impl::RangeTasks(threads);
  // Phase 1: read every id under shared locks of all shards, split by position so each thread
  // writes a contiguous part of `out`. Locks are always taken in shard order.
  std::vector<std::vector<uint32_t>> misses(workers);
  {
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    locks.reserve(s.shards.size());
    for (auto& shard : s.shards) locks.emplace_back(shard->mu);
    ParallelFor(threads, workers, [&](size_t w) {
      s.ReadRows(ids, n * w / workers, n * (w + 1) / workers, out,
                 train || s.tiered() ? &misses[w] : nullptr);
    });
  }
  if (!train && !s.tiered()) return;
  // Phase 2 (training only): unseen ids go through the filter under their shard's exclusive lock.
  std::vector<int64_t> missed_ids;
  std::vector<float*> missed_rows;
  for (auto& m : misses) {
    for (uint32_t pos : m) {
      missed_ids.push_back(ids[pos]);
      missed_rows.push_back(out + static_cast<size_t>(pos) * dim);
    }
  }
  if (missed_ids.empty()) {
    if (train && s.tiered()) s.PinLookup(ids, n, true);  // later calls keep this batch's rows
    return;
  }
  Impl::Pins pins;
  if (s.tiered()) pins = s.PinLookup(ids, n, train);
  s.AdmitMissing(missed_ids, missed_rows, now, train, pins.own ? &pins : nullptr);
}

void EmbeddingStore::Impl::AdmitMissing(const std::vector<int64_t>& missed_ids,
                                        const std::vector<float*>& missed_rows, double now,
                                        bool train, const Pins* pins) {
  Impl& s = *this;
  const size_t dim = static_cast<size_t>(s.dim);
  Impl::Partition p = s.Bucketize(missed_ids.data(), missed_ids.size());

  std::atomic<uint64_t> admitted{0}, rejected{0};
  // With a disk tier every thread works: a shard's reads and writes of rows are system calls
  // (~1-3 us a row), not memory work.
  const int threads = s.tiered() ? s.threads : s.ThreadsFor(missed_ids.size());
  ParallelFor(threads, s.shards.size(), [&](size_t shard_index) {
    size_t begin = p.offsets[shard_index], end = p.offsets[shard_index + 1];
    if (begin == end) return;
    Shard& shard = *s.shards[shard_index];
    uint64_t shard_admitted = 0, shard_rejected = 0;
    LocalIndex sighted(end - begin);  // one filter sighting per id per call
    std::unique_lock<std::shared_mutex> lock(shard.mu);
    if (shard.tier) {  // rows on disk come back first: only ids in neither tier meet the filter
      std::vector<int64_t> absent;
      std::vector<uint32_t> absent_hash;
      LocalIndex seen(end - begin);
      for (size_t k = begin; k < end; ++k) {
        const uint32_t local = p.order[k];
        const int64_t id = missed_ids[local];
        if (shard.Find(id, p.hash[local]) != Shard::kEmpty) continue;
        bool first;
        seen.FindOrInsert(id, 0, &first);
        if (!first) continue;
        absent.push_back(id);
        absent_hash.push_back(p.hash[local]);
      }
      s.FaultIn(shard, absent.data(), absent_hash.data(), absent.size(), s.faults);
    }
    for (size_t k = begin; k < end; ++k) {
      uint32_t local = p.order[k];
      int64_t id = missed_ids[local];
      float* dst = missed_rows[local];
      uint32_t row = shard.Find(id, p.hash[local]);  // another thread may have added it
      if (row == Shard::kEmpty) {
        if (!train) continue;  // a read: stays zeros
        bool first_sighting;
        sighted.FindOrInsert(id, 0, &first_sighting);
        if (!first_sighting || !s.Admit(shard, shard_index, id)) {
          shard_rejected += first_sighting ? 1 : 0;
          continue;  // stays zeros
        }
        row = shard.Insert(id, p.hash[local]);
        s.InitRow(shard, row, now);
        s.rows.fetch_add(1, std::memory_order_relaxed);
        ++shard_admitted;
      }
      std::memcpy(dst, shard.Floats(row), dim * sizeof(float));
    }
    if (shard.tier && pins != nullptr) s.EvictToDisk(shard, pins->own.get(), pins->previous.get());
    admitted.fetch_add(shard_admitted, std::memory_order_relaxed);
    rejected.fetch_add(shard_rejected, std::memory_order_relaxed);
  });
  s.admitted.fetch_add(admitted.load(), std::memory_order_relaxed);
  s.rejected.fetch_add(rejected.load(), std::memory_order_relaxed);
  s.EnforceCapacity();
}

size_t EmbeddingStore::Prefetch(const int64_t* ids, size_t n) {
  Impl& s = *impl_;
  if (!s.tiered() || n == 0) return 0;
  auto own = std::make_shared<const Impl::IdSet>(ids, n);
  std::shared_ptr<const Impl::IdSet> previous;
  {
    std::lock_guard<std::mutex> lock(s.pins_mu);
    s.last_prefetch = own;  // kept by every eviction from now on, until the next Prefetch
    previous = s.last_training_lookup;
  }
  Impl::Partition p = s.Bucketize(ids, n);
  size_t total = 0;
  std::vector<int64_t> absent;
  std::vector<uint32_t> absent_hash;
  // One shard at a time: the step running meanwhile waits for at most one shard's read.
  for (size_t k = 0; k < s.shards.size(); ++k) {
    const size_t begin = p.offsets[k], end = p.offsets[k + 1];
    if (begin == end) continue;
    Shard& shard = *s.shards[k];
    std::unique_lock<std::shared_mutex> lock(shard.mu);
    if (shard.tier->Count() == 0) continue;
    absent.clear();
    absent_hash.clear();
    LocalIndex seen(end - begin);
    for (size_t j = begin; j < end; ++j) {
      const uint32_t local = p.order[j];
      if (shard.Find(ids[local], p.hash[local]) != Shard::kEmpty) continue;
      bool first;
      seen.FindOrInsert(ids[local], 0, &first);
      if (!first) continue;
      absent.push_back(ids[local]);
      absent_hash.push_back(p.hash[local]);
    }
    const size_t got = s.FaultIn(shard, absent.data(), absent_hash.data(), absent.size(),
                                 s.prefetched);
    if (got > 0) s.EvictToDisk(shard, own.get(), previous.get());
    total += got;
  }
  return total;
}

void EmbeddingStore::Deduplicate(const int64_t* ids, size_t n, std::vector<int64_t>* unique,
                                 int64_t* inverse) {
  DeduplicateInto(ids, n, unique, inverse);
}

void EmbeddingStore::ApplyGradients(const int64_t* ids, const float* grads, size_t n, int64_t step,
                                    double now, float l2) {
  Impl& s = *impl_;
  if (step < 0) Invalid("step must be >= 0, got " + std::to_string(step));
  if (!std::isfinite(now)) Invalid("now must be a finite number of seconds");
  if (!(std::isfinite(l2) && l2 >= 0.0f)) {
    Invalid("l2 must be a finite number >= 0, got " + std::to_string(l2));
  }
  // Ids are split by shard into `parts` groups of whole shards (PartitionGradients); each group
  // sums the rows of its equal ids and checks that every gradient is finite (SumGradients);
  // only when all are, the distinct ids are updated under every shard's exclusive lock
  // (UpdateRows).
  const int threads = s.ThreadsFor(n);
  internal::ScratchLease scratch;
  const Impl::GradientPartition partition = s.PartitionGradients(ids, n, threads, *scratch);
  const Impl::GradientSumsList sums =
      s.SumGradients(partition, ids, grads, threads, *scratch);
  s.updates.fetch_add(s.UpdateRows(partition, sums, step, now, l2, threads),
                      std::memory_order_relaxed);
  int64_t seen = s.global_step.load();
  while (step > seen && !s.global_step.compare_exchange_weak(seen, step)) {
  }
}

// The shards are dealt to the parts by their number of positions (largest first, each to the
// part with the fewest so far), since a Zipf batch is far from even over shards (at 1M x 100k
// the hottest shard has 20% of the positions, and the halves of 8 shards each held 37% and 63%).
EmbeddingStore::Impl::GradientPartition EmbeddingStore::Impl::PartitionGradients(
    const int64_t* ids, size_t n, int threads, internal::ScratchSet& scratch) const {
  const Impl& s = *this;
  const size_t num_shards = s.shards.size();
  GradientPartition result;
  const size_t parts = result.parts =
      std::min(num_shards, threads <= 1 ? size_t{1} : static_cast<size_t>(threads));
  scratch.Reserve(3 + 4 * parts);  // SumGradients uses buffers 3 .. 3 + 4 * parts
  uint32_t* hash = result.hash = scratch.Get<uint32_t>(0, n);
  uint16_t* shard_of = result.shard_of = scratch.Get<uint16_t>(1, n);
  uint32_t* order = result.order = scratch.Get<uint32_t>(2, n);
  const size_t tasks = result.tasks = Impl::RangeTasks(threads);
  std::vector<size_t> shard_counts(tasks * num_shards, 0);  // [t * num_shards + shard]
  ParallelFor(threads, tasks, [&](size_t t) {
    const size_t begin = n * t / tasks, end = n * (t + 1) / tasks;
    size_t* counts = shard_counts.data() + t * num_shards;
    for (size_t i = begin; i < end; ++i) {
      uint64_t h = HashId(ids[i]);
      hash[i] = static_cast<uint32_t>(h);
      uint16_t sh = static_cast<uint16_t>(s.ShardOf(h));
      shard_of[i] = sh;
      ++counts[sh];
    }
  });
  std::vector<uint16_t> part_of_shard(num_shards, 0);
  if (parts > 1) {
    std::vector<std::pair<size_t, size_t>> by_size(num_shards);  // (positions, shard)
    for (size_t sh = 0; sh < num_shards; ++sh) {
      size_t total = 0;
      for (size_t t = 0; t < tasks; ++t) total += shard_counts[t * num_shards + sh];
      by_size[sh] = {total, sh};
    }
    std::sort(by_size.begin(), by_size.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    std::vector<size_t> load(parts, 0);
    for (const auto& [total, sh] : by_size) {
      const auto p = std::min_element(load.begin(), load.end()) - load.begin();
      part_of_shard[sh] = static_cast<uint16_t>(p);
      load[p] += total;
    }
  }
  // order: each range task's positions grouped by part (input order kept within a group), so a
  // part reads its positions, in input order, from every range in turn.
  result.cursor.assign((parts + 1) * tasks, 0);
  std::vector<size_t>& cursor = result.cursor;  // [t * (parts + 1) + p]: start of part p
  for (size_t t = 0; t < tasks; ++t) {
    size_t* starts = cursor.data() + t * (parts + 1);  // zero from the vector's construction
    for (size_t sh = 0; sh < num_shards; ++sh) {
      starts[part_of_shard[sh]] += shard_counts[t * num_shards + sh];
    }
    size_t running = n * t / tasks;
    for (size_t p = 0; p < parts; ++p) {
      const size_t count = starts[p];
      starts[p] = running;
      running += count;
    }
    starts[parts] = running;
  }
  ParallelFor(threads, tasks, [&](size_t t) {
    const size_t begin = n * t / tasks, end = n * (t + 1) / tasks;
    const size_t* starts = cursor.data() + t * (parts + 1);
    std::vector<size_t> next(starts, starts + parts);
    for (size_t i = begin; i < end; ++i) {
      order[next[part_of_shard[shard_of[i]]]++] = static_cast<uint32_t>(i);
    }
  });
  return result;
}

// Each part sums the rows of its equal ids in input order (so each distinct id gets exactly one
// optimizer step; the first occurrence is copied, not added to zero, to keep the sign of zeros).
EmbeddingStore::Impl::GradientSumsList EmbeddingStore::Impl::SumGradients(
    const GradientPartition& partition, const int64_t* ids, const float* grads, int threads,
    internal::ScratchSet& scratch) const {
  const size_t dim = static_cast<size_t>(this->dim);
  const size_t parts = partition.parts, tasks = partition.tasks;
  const uint32_t* hash = partition.hash;
  const uint32_t* order = partition.order;
  const std::vector<size_t>& cursor = partition.cursor;
  GradientSumsList groups(parts);
  ParallelFor(threads, parts, [&](size_t part) {
    GradientSums& group = groups[part];
    size_t count = 0;
    for (size_t t = 0; t < tasks; ++t) {
      count += cursor[t * (parts + 1) + part + 1] - cursor[t * (parts + 1) + part];
    }
    if (count == 0) return;
    ScratchIndex index(scratch, 3 + 4 * part, count);
    uint32_t* first = group.first = scratch.Get<uint32_t>(4 + 4 * part, count);
    int64_t* key = group.key = scratch.Get<int64_t>(5 + 4 * part, count);
    float* sums = group.sums = scratch.Get<float>(6 + 4 * part, count * dim);
    size_t distinct = 0;
    // A group reads its gradient rows in shard order, i.e. scattered over the whole batch, and
    // waiting for them is most of this loop at large dims: they are prefetched kAhead positions
    // ahead. With one group per thread (denser positions; two per thread before) this took
    // 1M x 64 updates from ~145 to ~115-130 CPU-ns per id on the 2-core VM. The prefetches are
    // plain (into all cache levels), not non-temporal: with both threads reading interleaved
    // rows of the same batch, prefetchnta made 1M x 64 updates 12-35% slower (paired runs
    // in one process, 2 threads; no change on 1 thread).
    constexpr size_t kAhead = 16;
    const size_t grad_bytes = std::min<size_t>(dim * sizeof(float), 1024);
    for (size_t t = 0; t < tasks; ++t) {
      const size_t* starts = cursor.data() + t * (parts + 1);
      for (size_t k = starts[part], k_end = starts[part + 1]; k < k_end; ++k) {
        const size_t i = order[k];
        const int64_t id = ids[i];
        const float* g = grads + i * dim;
#if defined(__GNUC__) || defined(__clang__)
        if (k + kAhead < k_end) {
          const char* ahead = reinterpret_cast<const char*>(grads + order[k + kAhead] * dim);
          for (size_t b = 0; b < grad_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
          __builtin_prefetch(ahead + grad_bytes - 1, 0, 3);
        }
#endif
        // The table hashes with the store's hash (recomputed only when the table grows).
        uint32_t* slot = index.Slot(key, id, hash[i]);
        if (*slot == LocalIndex::kNone) {
          *slot = static_cast<uint32_t>(distinct);
          first[distinct] = static_cast<uint32_t>(i);
          key[distinct] = id;
          float* sum = sums + distinct * dim;
          for (size_t j = 0; j < dim; ++j) sum[j] = g[j];
          ++distinct;
          index.Added(key, distinct, LowStoreHash);
        } else {
          float* sum = sums + static_cast<size_t>(*slot) * dim;
          for (size_t j = 0; j < dim; ++j) sum[j] += g[j];
        }
        if (!internal::AllFinite(g, dim)) {
          group.first_bad = i;  // positions grow: the first found is this group's smallest
          return;
        }
      }
    }
    group.distinct = distinct;
  });
  size_t bad_row = SIZE_MAX;
  for (const GradientSums& group : groups) bad_row = std::min(bad_row, group.first_bad);
  if (bad_row != SIZE_MAX) {
    size_t j = 0;
    while (j + 1 < dim && Finite(grads[bad_row * dim + j])) ++j;
    std::ostringstream message;
    message << "grads row " << bad_row << " (id " << ids[bad_row] << ") contains "
            << grads[bad_row * dim + j] << "; gradients must be finite";
    Invalid(message.str());
  }
  return groups;
}

// Holds every shard exclusively (in shard order, as every multi-shard lock is taken), so its
// chunks need no locks of their own: the groups' distinct ids are disjoint.
uint64_t EmbeddingStore::Impl::UpdateRows(const GradientPartition& partition,
                                          const GradientSumsList& groups, int64_t step, double now,
                                          float l2, int threads) {
  Impl& s = *this;
  const size_t dim = static_cast<size_t>(s.dim);
  const size_t parts = partition.parts;
  const uint32_t* hash = partition.hash;
  const uint16_t* shard_of = partition.shard_of;
  std::atomic<uint64_t> updated{0};
  const uint32_t step32 = static_cast<uint32_t>(step);
  const uint32_t time32 = internal::EncodeTime(now);
  std::vector<size_t> group_start(parts + 1, 0);  // groups' distinct ids, numbered in turn
  for (size_t part = 0; part < parts; ++part) {
    group_start[part + 1] = group_start[part] + groups[part].distinct;
  }
  const size_t total_distinct = group_start[parts];
  // Equal chunks, several per thread: a thread the shared cores start late leaves its chunks to
  // the others (the groups themselves can differ by 2x in distinct ids).
  const size_t chunks =
      std::min(std::max<size_t>(total_distinct / 256, 1), Impl::RangeTasks(threads));
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  locks.reserve(s.shards.size());
  for (auto& shard : s.shards) locks.emplace_back(shard->mu);
  // Two tiers: a row evicted since its lookup (not in the pipeline, whose pins keep a batch's
  // rows until its update, but after other calls) is not found by the loop below, which notes
  // it; such rows come back from disk after the loop and get their update then (each distinct
  // id is updated once, in any order).
  const bool tiered = s.tiered();
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> not_found(tiered ? chunks : 0);
  // One row's update: the summed gradient `sums` (plus the L2 decay of its idle steps).
  auto update_row = [&](Shard& shard, uint32_t row, const float* g, std::vector<float>& decayed) {
    RowHeader* header = shard.Header(row);
    float* values = shard.Floats(row);
    if (l2 > 0.0f) {  // the decay of the steps since the row's last update
      const int64_t idle = std::max<int64_t>(step - internal::StepOf(header->step, step), 1);
      // in double, clamped: a huge l2 or idle makes a huge but finite step, never inf/NaN
      const double scale = static_cast<double>(l2) * static_cast<double>(idle);
      constexpr double kMax = std::numeric_limits<float>::max();
      for (size_t j = 0; j < dim; ++j) {
        decayed[j] = static_cast<float>(std::clamp(g[j] + scale * values[j], -kMax, kMax));
      }
      g = decayed.data();
    }
    header->add_update();
    header->set_dirty();
    header->step = step32;
    header->time = time32;
    s.Update(values, values + dim, g, header->update_count());
  };
  ParallelFor(threads, chunks, [&](size_t c) {
    const size_t chunk_begin = total_distinct * c / chunks;
    const size_t chunk_end = total_distinct * (c + 1) / chunks;
    uint64_t chunk_updated = 0;
    std::vector<float> decayed(l2 > 0.0f ? dim : 0);  // a row's gradient plus its L2 decay
    for (size_t part = 0; part < parts; ++part) {
      const size_t begin = std::max(chunk_begin, group_start[part]);
      const size_t end = std::min(chunk_end, group_start[part + 1]);
      if (begin >= end) continue;
      const GradientSums& group = groups[part];
      // This chunk's share of the group, as offsets into its arrays.
      const size_t d_begin = begin - group_start[part], count = end - begin;
      const uint32_t* first = group.first + d_begin;
      const int64_t* key = group.key + d_begin;
      const float* sums = group.sums + d_begin * dim;
      // Same pipeline as ReadRows: slot 2 * kAhead ahead, then the row it points to kAhead
      // ahead (the candidate is kept: a discarded result would let the compiler drop the probe).
      constexpr size_t kAhead = 8, kRing = 16;
      uint32_t candidate[kRing];
      const size_t prefetch_bytes = s.row_bytes;
      for (size_t k = 0; k < count + 2 * kAhead; ++k) {
        if (k < count) s.shards[shard_of[first[k]]]->Prefetch(hash[first[k]]);
        if (k >= kAhead && k - kAhead < count) {
          const uint32_t i = first[k - kAhead];
          candidate[(k - kAhead) % kRing] =
              s.shards[shard_of[i]]->PrefetchCandidate(hash[i], prefetch_bytes);
        }
        if (k < 2 * kAhead) continue;
        const size_t d = k - 2 * kAhead;
        const uint32_t i = first[d];
        Shard& shard = *s.shards[shard_of[i]];
        uint32_t row = candidate[d % kRing];
        if (row != Shard::kEmpty && shard.IdOf(row) != key[d]) row = shard.Find(key[d], hash[i]);
        if (row == Shard::kEmpty) {  // never admitted, expired, or (two tiers) on disk
          if (tiered) not_found[c].emplace_back(static_cast<uint32_t>(part), static_cast<uint32_t>(d_begin + d));
          continue;
        }
        update_row(shard, row, sums + d * dim, decayed);
        ++chunk_updated;
      }
    }
    updated.fetch_add(chunk_updated, std::memory_order_relaxed);
  });
  if (tiered) {
    std::vector<std::vector<int64_t>> absent(s.shards.size());
    std::vector<std::vector<uint32_t>> absent_hash(s.shards.size());
    std::vector<std::pair<uint32_t, uint32_t>> missing;  // (part, index in its group)
    for (const auto& chunk : not_found) missing.insert(missing.end(), chunk.begin(), chunk.end());
    std::vector<int64_t> pinned_ids;
    for (const auto& [part, d] : missing) {
      const uint32_t i = groups[part].first[d];
      if (!s.shards[shard_of[i]]->tier->Contains(groups[part].key[d])) continue;
      absent[shard_of[i]].push_back(groups[part].key[d]);
      absent_hash[shard_of[i]].push_back(hash[i]);
    }
    size_t brought = 0;
    for (size_t k = 0; k < s.shards.size(); ++k) {
      brought += s.FaultIn(*s.shards[k], absent[k].data(), absent_hash[k].data(), absent[k].size(),
                           s.faults);
    }
    if (brought > 0) {
      std::vector<float> decayed(l2 > 0.0f ? dim : 0);
      for (const auto& [part, d] : missing) {
        const GradientSums& group = groups[part];
        const uint32_t i = group.first[d];
        Shard& shard = *s.shards[shard_of[i]];
        const uint32_t row = shard.Find(group.key[d], hash[i]);
        if (row == Shard::kEmpty) continue;  // not on disk either: reads as zeros
        update_row(shard, row, group.sums + size_t{d} * dim, decayed);
        updated.fetch_add(1, std::memory_order_relaxed);
      }
    }
    // Shards over their cap (rows brought back here, or kept for the lookup before this one)
    // evict, keeping this call's rows and those of the training lookup made last (batch k + 1
    // in the pipeline).
    bool over = false;
    for (auto& shard : s.shards) over = over || shard->size() > shard->memory_rows_cap;
    if (over) {
      for (size_t part = 0; part < parts; ++part) {
        pinned_ids.insert(pinned_ids.end(), groups[part].key, groups[part].key + groups[part].distinct);
      }
      const Impl::IdSet pinned(std::move(pinned_ids));
      const std::shared_ptr<const IdSet> next = s.LastTrainingLookup();
      for (auto& shard : s.shards) s.EvictToDisk(*shard, &pinned, next.get());
    }
  }
  locks.clear();
  return updated.load();
}

size_t EmbeddingStore::Expire(int64_t max_idle_steps, double max_idle_seconds, double now) {
  Impl& s = *impl_;
  int64_t current_step = s.global_step.load();
  std::atomic<size_t> removed{0};
  ParallelFor(s.threads, s.shards.size(), [&](size_t shard_index) {
    Shard& shard = *s.shards[shard_index];
    std::unique_lock<std::shared_mutex> lock(shard.mu);
    size_t count = 0;
    // Walk down so that the row moved into a hole has already been looked at.
    for (size_t r = shard.size(); r-- > 0;) {
      const RowHeader* h = shard.Header(static_cast<uint32_t>(r));
      bool idle = (max_idle_steps >= 0 && internal::IdleSteps(h->step, current_step) > max_idle_steps) ||
                  (max_idle_seconds >= 0 && now - internal::DecodeTime(h->time) > max_idle_seconds);
      if (idle) {
        s.RemoveRow(shard, static_cast<uint32_t>(r));
        ++count;
      }
    }
    if (shard.tier && shard.tier->Count() > 0) {  // the same test on the rows on disk, streamed
      std::vector<int64_t> drop;
      shard.tier->ForEach(kTierBlockRows, [&](const uint8_t* rows, size_t n) {
        for (size_t i = 0; i < n; ++i) {
          const RowHeader* h = reinterpret_cast<const RowHeader*>(rows + i * s.row_bytes);
          bool idle = (max_idle_steps >= 0 && internal::IdleSteps(h->step, current_step) > max_idle_steps) ||
                      (max_idle_seconds >= 0 && now - internal::DecodeTime(h->time) > max_idle_seconds);
          if (idle) drop.push_back(h->id());
        }
      });
      if (!drop.empty()) {
        shard.tier->Erase(drop.data(), drop.size());
        internal::ReclaimIfNeeded(shard.tier.get());
        shard.tombstones.insert(shard.tombstones.end(), drop.begin(), drop.end());
        s.rows.fetch_sub(drop.size(), std::memory_order_relaxed);
        count += drop.size();
      }
    }
    removed.fetch_add(count);
  });
  s.expired.fetch_add(removed.load());
  return removed.load();
}

size_t EmbeddingStore::Remove(const int64_t* ids, size_t n) {
  Impl& s = *impl_;
  Impl::Partition p = s.Bucketize(ids, n);
  std::atomic<size_t> removed{0};
  ParallelFor(s.ThreadsFor(n), s.shards.size(), [&](size_t shard_index) {
    size_t begin = p.offsets[shard_index], end = p.offsets[shard_index + 1];
    if (begin == end) return;
    Shard& shard = *s.shards[shard_index];
    std::unique_lock<std::shared_mutex> lock(shard.mu);
    size_t count = 0;
    for (size_t k = begin; k < end; ++k) {
      uint32_t pos = p.order[k];
      uint32_t row = shard.Find(ids[pos], p.hash[pos]);
      if (row == Shard::kEmpty) {
        if (shard.tier && shard.tier->Contains(ids[pos])) {  // on disk: removed there
          shard.tier->Erase(&ids[pos], 1);
          shard.tombstones.push_back(ids[pos]);
          s.rows.fetch_sub(1, std::memory_order_relaxed);
          ++count;
        }
        continue;
      }
      s.RemoveRow(shard, row);
      ++count;
    }
    internal::ReclaimIfNeeded(shard.tier.get());
    removed.fetch_add(count);
  });
  s.expired.fetch_add(removed.load());
  return removed.load();
}

void EmbeddingStore::Contains(const int64_t* ids, size_t n, uint8_t* out) const {
  const Impl& s = *impl_;
  if (n == 0) return;
  Impl::Partition p = s.Bucketize(ids, n);
  ParallelFor(s.ThreadsFor(n), s.shards.size(), [&](size_t shard_index) {
    size_t begin = p.offsets[shard_index], end = p.offsets[shard_index + 1];
    if (begin == end) return;
    const Shard& shard = *s.shards[shard_index];
    // Exclusive with a tier (one call at a time uses it), shared otherwise (as ExportRows).
    std::unique_lock<std::shared_mutex> tier_lock(shard.mu, std::defer_lock);
    std::shared_lock<std::shared_mutex> lock(shard.mu, std::defer_lock);
    if (shard.tier) tier_lock.lock(); else lock.lock();
    for (size_t k = begin; k < end; ++k) {
      uint32_t pos = p.order[k];
      bool found = shard.Find(ids[pos], p.hash[pos]) != Shard::kEmpty ||
                   (shard.tier && shard.tier->Contains(ids[pos]));
      out[pos] = found ? 1 : 0;
    }
  });
}

RowArrays EmbeddingStore::ExportRows(bool with_values) const {
  const Impl& s = *impl_;
  RowArrays out;
  const size_t dim = static_cast<size_t>(s.dim), state = static_cast<size_t>(s.state_floats);
  for (const auto& shard_ptr : s.shards) {
    const Shard& shard = *shard_ptr;
    // Exclusive with a tier (one call at a time uses it), shared otherwise.
    std::unique_lock<std::shared_mutex> tier_lock(shard.mu, std::defer_lock);
    std::shared_lock<std::shared_mutex> lock(shard.mu, std::defer_lock);
    if (shard.tier) tier_lock.lock(); else lock.lock();
    const int64_t current_step = s.global_step.load();
    auto add = [&](const uint8_t* row) {
      const RowHeader* h = reinterpret_cast<const RowHeader*>(row);
      const float* values = reinterpret_cast<const float*>(row + sizeof(RowHeader));
      out.ids.push_back(h->id());
      out.update_counts.push_back(h->update_count());
      out.last_steps.push_back(internal::StepOf(h->step, current_step));
      out.last_times.push_back(internal::DecodeTime(h->time));
      double norm = 0;
      for (size_t j = 0; j < dim; ++j) norm += static_cast<double>(values[j]) * values[j];
      out.l2_norms.push_back(static_cast<float>(std::sqrt(norm)));
      if (with_values) {
        out.values.insert(out.values.end(), values, values + dim);
        out.state.insert(out.state.end(), values + dim, values + dim + state);
      }
    };
    for (uint32_t r = 0; r < shard.size(); ++r) add(shard.Row(r));
    if (shard.tier) {  // then the rows on disk, a block at a time
      shard.tier->ForEach(kTierBlockRows, [&](const uint8_t* rows, size_t n) {
        for (size_t i = 0; i < n; ++i) add(rows + i * s.row_bytes);
      });
    }
  }
  return out;
}

void EmbeddingStore::InitialRows(const int64_t* ids, size_t n, float* out) const {
  for (size_t i = 0; i < n; ++i) impl_->InitialValues(ids[i], out + i * impl_->dim);
}

FilterState EmbeddingStore::ExportFilter() const {
  const Impl& s = *impl_;
  FilterState out;
  std::vector<std::pair<int64_t, uint32_t>> pending;
  for (const auto& shard_ptr : s.shards) {
    const Shard& shard = *shard_ptr;
    std::shared_lock<std::shared_mutex> lock(shard.mu);
    out.bloom.insert(out.bloom.end(), shard.bloom.begin(), shard.bloom.end());
    pending.insert(pending.end(), shard.counts.begin(), shard.counts.end());
  }
  std::sort(pending.begin(), pending.end());  // by id, so equal filters give equal arrays
  out.ids.reserve(pending.size());
  out.counts.reserve(pending.size());
  for (const auto& [id, count] : pending) {
    out.ids.push_back(id);
    out.counts.push_back(count);
  }
  return out;
}

size_t EmbeddingStore::MergeFilter(const int64_t* ids, const uint32_t* counts, size_t n,
                                   const uint8_t* bloom, size_t bloom_size) {
  Impl& s = *impl_;
  const FilterOptions& f = s.options.filter;
  // Everything is checked before anything changes.
  if (n > 0 && f.kind != FilterKind::kCounter) {
    Invalid("filter counts merge into a CounterFilter only; this store's filter keeps none");
  }
  const uint64_t bloom_total = s.bloom_counters * s.shards.size();
  if (bloom_size > 0 && f.kind != FilterKind::kCountingBloom) {
    Invalid("Bloom counters merge into a CountingBloomFilter only; this store's filter keeps none");
  }
  if (f.kind == FilterKind::kCountingBloom && bloom_size != 0 && bloom_size != bloom_total) {
    Invalid("Bloom counters: got " + std::to_string(bloom_size) + ", this store's filter has " +
            std::to_string(bloom_total) + " (another capacity, false_positive_rate or num_shards)");
  }
  if (n > 0 && (ids == nullptr || counts == nullptr)) Invalid("filter counts without ids");
  if (n >= 0xffffffffULL) Invalid("at most 2**32 - 2 filter counts per call");
  if (bloom_size > 0 && bloom == nullptr) Invalid("Bloom counters without data");
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] == 0) Invalid("filter count of id " + std::to_string(ids[i]) + " is 0");
  }
  if (n > 1) {
    std::vector<int64_t> sorted(ids, ids + n);
    std::sort(sorted.begin(), sorted.end());
    auto twice = std::adjacent_find(sorted.begin(), sorted.end());
    if (twice != sorted.end()) Invalid("filter counts: id " + std::to_string(*twice) + " given twice");
  }
  std::atomic<size_t> changed{0};
  const uint64_t cap = f.min_count > 0 ? f.min_count - 1 : 0;
  if (n > 0) {
    Impl::Partition p = s.Bucketize(ids, n);
    ParallelFor(s.ThreadsFor(n), s.shards.size(), [&](size_t shard_index) {
      size_t begin = p.offsets[shard_index], end = p.offsets[shard_index + 1];
      if (begin == end) return;
      Shard& shard = *s.shards[shard_index];
      std::unique_lock<std::shared_mutex> lock(shard.mu);
      size_t count = 0;
      for (size_t k = begin; k < end; ++k) {
        uint32_t pos = p.order[k];
        if (cap == 0 || shard.Find(ids[pos], p.hash[pos]) != Shard::kEmpty) continue;
        if (shard.tier && shard.tier->Contains(ids[pos])) continue;  // a row on disk
        auto found = shard.counts.find(ids[pos]);
        uint64_t total = uint64_t{counts[pos]} + (found == shard.counts.end() ? 0 : found->second);
        shard.counts[ids[pos]] = static_cast<uint32_t>(std::min(total, cap));
        ++count;
      }
      changed.fetch_add(count);
    });
  }
  if (bloom_size > 0) {
    const size_t per_shard = static_cast<size_t>(s.bloom_counters);
    ParallelFor(s.ThreadsFor(bloom_size), s.shards.size(), [&](size_t shard_index) {
      Shard& shard = *s.shards[shard_index];
      const uint8_t* add = bloom + shard_index * per_shard;
      std::unique_lock<std::shared_mutex> lock(shard.mu);
      size_t count = 0;
      for (size_t i = 0; i < per_shard; ++i) {
        if (add[i] == 0) continue;
        shard.bloom[i] = static_cast<uint8_t>(std::min<uint32_t>(255, uint32_t{shard.bloom[i]} + add[i]));
        ++count;
      }
      changed.fetch_add(count);
    });
  }
  return changed.load();
}

StoreStats EmbeddingStore::Stats() const {
  const Impl& s = *impl_;
  StoreStats stats;
  for (const auto& shard : s.shards) {
    std::shared_lock<std::shared_mutex> lock(shard->mu);
    stats.bytes += shard->Bytes();
    stats.filter_bytes += shard->FilterBytes();
    stats.memory_rows += shard->size();
    if (shard->tier) {
      stats.disk_rows += shard->tier->Count();
      stats.disk_bytes += shard->tier->BytesOnDisk();
      stats.disk_reads += shard->tier->RowsRead();
      stats.disk_writes += shard->tier->RowsWritten();
      stats.bytes += shard->tier->IndexBytes();
    }
  }
  stats.bytes += sizeof(Impl) + s.shards.size() * sizeof(Shard);
  stats.rows = s.rows.load();
  stats.faults = s.faults.load();
  stats.prefetched = s.prefetched.load();
  stats.evicted_to_disk = s.evicted_to_disk.load();
  stats.admitted = s.admitted.load();
  stats.rejected = s.rejected.load();
  stats.expired = s.expired.load();
  stats.evicted = s.evicted.load();
  stats.lookups = s.lookups.load();
  stats.updates = s.updates.load();
  stats.global_step = s.global_step.load();
  stats.delta_sequence = s.delta_sequence.load();
  return stats;
}

}  // namespace prefixrec
