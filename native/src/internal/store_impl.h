// The state behind EmbeddingStore, shared by the batch code (embedding_store.cc) and the
// persistence code (persistence.cc).
#ifndef PREFIXREC_INTERNAL_STORE_IMPL_H_
#define PREFIXREC_INTERNAL_STORE_IMPL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "internal/scratch.h"
#include "internal/shard.h"
#include "prefixrec/embedding_store.h"

namespace prefixrec {

// Throws StoreError(kInvalidArgument) naming the first option out of range.
void ValidateOptions(const StoreOptions& options);
// A memory row's share of memory_budget_bytes: row bytes + its table slot (4 / 0.85, rounded up).
uint64_t MemoryRowBytes(const StoreOptions& options);

struct EmbeddingStore::Impl {
  explicit Impl(const StoreOptions& options);

  // Counting Bloom filter size for these options: counters per shard and hash functions.
  static uint64_t BloomCountersPerShard(const StoreOptions& options);
  static int BloomHashes(const StoreOptions& options);

  // Ids of a batch grouped by shard: positions order[offsets[s] .. offsets[s+1]) are shard s's.
  struct Partition {
    std::vector<uint32_t> hash;    // low 32 bits of HashId(ids[i]), per input position
    std::vector<uint32_t> order;   // input positions, grouped by shard, input order kept
    std::vector<size_t> offsets;   // shards + 1 entries
  };
  Partition Bucketize(const int64_t* ids, size_t n) const;
  size_t ShardOf(uint64_t hash) const {
    return static_cast<size_t>(((hash >> 32) * shards.size()) >> 32);
  }
  int ThreadsFor(size_t n) const { return n < 8192 ? 1 : threads; }
  // Position-range tasks for `threads` threads: several per thread, so a thread that starts
  // late (the cores are shared) leaves its share to the others instead of stalling the call.
  static size_t RangeTasks(int threads) { return threads <= 1 ? 1 : static_cast<size_t>(threads) * 4; }

  // Lookup of ids without repeats (repeats work, but each is probed again).
  void LookupDistinct(const int64_t* ids, size_t n, bool train, double now, float* out);
  // Runs unseen ids through the entry filter under their shards' exclusive locks; admitted ids
  // (and ids another thread added meanwhile) get their row copied to missed_rows[i].
  // train = false: only rows on disk come back (no filter, no insert). pins: ids kept in
  // memory through the eviction that follows (null without a budget).
  struct Pins;
  void AdmitMissing(const std::vector<int64_t>& missed_ids, const std::vector<float*>& missed_rows,
                    double now, bool train, const Pins* pins);
  // Two tiers (docs/tiered-store.md). Caller holds shard.mu exclusively for both.
  bool tiered() const { return options.memory_budget_bytes > 0; }
  // Brings back the rows of n distinct ids absent from the shard's memory that its tier holds
  // (one batched Get), bytes unchanged. Returns rows brought back.
  // `counter` counts them (faults, or prefetched).
  size_t FaultIn(internal::Shard& shard, const int64_t* ids, const uint32_t* hashes, size_t n,
                 std::atomic<uint64_t>& counter);
  // Moves the shard's memory rows beyond its cap (down to ~97% of it) to its tier, by the
  // eviction policy, never a pinned id nor one of the last Prefetch. Returns rows moved.
  // A call's ids, kept in memory through evictions. Most calls evict nothing, so the hash set
  // is built on first use (one copy of the ids a call, the set once per eviction at most).
  class IdSet {
   public:
    IdSet(const int64_t* ids, size_t n) : ids_(ids, ids + n) {}
    explicit IdSet(std::vector<int64_t> ids) : ids_(std::move(ids)) {}
    bool Contains(int64_t id) const {
      std::call_once(built_, [this] {
        set_.reserve(ids_.size());
        set_.insert(ids_.begin(), ids_.end());
      });
      return set_.count(id) != 0;
    }

   private:
    std::vector<int64_t> ids_;
    mutable std::once_flag built_;
    mutable std::unordered_set<int64_t> set_;
  };
  size_t EvictToDisk(internal::Shard& shard, const IdSet* pinned, const IdSet* also_pinned = nullptr);
  // The rows a call must not evict: its own ids and those of the training lookup before it
  // (the three-stage pipeline looks up batch k + 1 before it applies batch k's gradients).
  struct Pins {
    std::shared_ptr<const IdSet> own, previous;
  };
  // A lookup's pins; a training lookup becomes the "previous" of the calls after it.
  Pins PinLookup(const int64_t* ids, size_t n, bool train);
  std::shared_ptr<const IdSet> LastTrainingLookup();
  std::mutex pins_mu;
  std::shared_ptr<const IdSet> last_training_lookup;  // guarded by pins_mu
  std::shared_ptr<const IdSet> last_prefetch;         // guarded by pins_mu
  // Copies the rows of ids[begin, end) to out (zeros if absent, position recorded in misses).
  // Caller holds every shard at least shared.
  void ReadRows(const int64_t* ids, size_t begin, size_t end, float* out,
                std::vector<uint32_t>* misses) const;
  // Writes the initial values of `id` (dim floats).
  void InitialValues(int64_t id, float* out) const;
  // Fills a freshly inserted row: values, optimizer state, metadata; marks it dirty.
  void InitRow(internal::Shard& shard, uint32_t row, double now) const;
  // One sighting of an id without a row; true if the entry filter admits it now.
  bool Admit(internal::Shard& shard, size_t shard_index, int64_t id) const;
  // One optimizer step on a row; `t` is the row's update count including this update.
  void Update(float* values, float* state, const float* grad, uint32_t t) const;
  // ApplyGradients' three phases, in order (each needs the one before it; the scratch set's
  // buffers 0 .. 3 + 4 * parts hold their arrays, so the results live as long as the lease).
  // The positions of a batch grouped by part: parts are groups of whole shards, one per thread.
  struct GradientPartition {
    size_t parts = 1;              // groups of whole shards
    size_t tasks = 1;              // position ranges [n * t / tasks, n * (t + 1) / tasks)
    uint32_t* hash = nullptr;      // low 32 bits of HashId(ids[i]), n entries
    uint16_t* shard_of = nullptr;  // shard of ids[i], n entries
    // Input positions, n entries: range t's positions of part p, in input order, are
    // order[cursor[t * (parts + 1) + p] .. cursor[t * (parts + 1) + p + 1]).
    uint32_t* order = nullptr;
    std::vector<size_t> cursor;    // tasks * (parts + 1) entries
  };
  // One part's gradients summed per distinct id, ids in order of first appearance (in the
  // part's position order). Arrays of `distinct` entries (sums: distinct x dim).
  struct GradientSums {
    size_t distinct = 0;
    size_t first_bad = SIZE_MAX;  // smallest position with a non-finite gradient, if any
    uint32_t* first = nullptr;    // the position of each distinct id's first occurrence
    int64_t* key = nullptr;       // the distinct ids
    float* sums = nullptr;        // their summed gradient rows
  };
  using GradientSumsList = std::vector<GradientSums>;  // one per part
  // Phase 1: hashes ids[0, n) and groups their positions by part. O(n + shards).
  GradientPartition PartitionGradients(const int64_t* ids, size_t n, int threads,
                                       internal::ScratchSet& scratch) const;
  // Phase 2: sums equal ids' rows of grads (n x dim) in input order, the first copied (so the
  // sign of zeros is kept). Throws kInvalidArgument naming the first non-finite row. O(n * dim).
  GradientSumsList SumGradients(const GradientPartition& partition, const int64_t* ids,
                                const float* grads, int threads,
                                internal::ScratchSet& scratch) const;
  // Phase 3: one optimizer update (with lazy L2 when l2 > 0) of each distinct id that has a
  // row, stamping step and now, under every shard's exclusive lock. Returns rows updated.
  uint64_t UpdateRows(const GradientPartition& partition, const GradientSumsList& groups,
                      int64_t step, double now, float l2, int threads);
  // Evicts the least recently updated rows until size <= max_rows; returns rows evicted.
  size_t EnforceCapacity();
  // Removes a row and records its tombstone. Caller holds the shard exclusively.
  void RemoveRow(internal::Shard& shard, uint32_t row);

  // Adam's bias corrections 1 - beta1^t and 1 - beta2^t for update counts t below
  // kAdamCorrections (2 floats per t), computed once as Update would: two pow calls per row
  // were a third of an update of a training batch's rows. Empty for other optimizers.
  static constexpr uint32_t kAdamCorrections = 4096;
  std::vector<float> adam_corrections;

  StoreOptions options;
  int dim;
  int state_floats;
  size_t row_bytes;
  int threads;
  uint64_t bloom_counters = 0;  // per shard
  int bloom_hashes = 0;
  std::vector<std::unique_ptr<internal::Shard>> shards;

  std::atomic<uint64_t> rows{0};
  std::atomic<int64_t> global_step{0};
  std::atomic<uint64_t> admitted{0}, rejected{0}, expired{0}, evicted{0}, lookups{0}, updates{0};
  std::atomic<uint64_t> delta_sequence{0};
  std::atomic<uint64_t> faults{0}, evicted_to_disk{0};  // rows read back from / moved to disk
  std::atomic<uint64_t> prefetched{0};                  // rows Prefetch read back
  std::mutex delta_mu;  // one ExportDelta/ApplyDelta at a time
  std::mutex evict_mu;  // one capacity enforcement at a time
};

}  // namespace prefixrec

#endif  // PREFIXREC_INTERNAL_STORE_IMPL_H_
