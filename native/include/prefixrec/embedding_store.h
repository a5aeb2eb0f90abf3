// EmbeddingStore: a dynamic, sharded hash map from int64 ids to trainable float rows.
//
// Each row holds `dim` embedding values, the optimizer's state for them and a little metadata
// (update count, last step, last wall time). Ids need no vocabulary: a training lookup of an
// unseen id asks the entry filter whether to admit it; an admitted id gets a row initialised
// deterministically from (seed, id), a rejected one reads as zeros and is never updated.
//
//   StoreOptions options;
//   options.dim = 8;
//   options.optimizer.kind = OptimizerKind::kAdagrad;
//   EmbeddingStore store(options);
//   std::vector<float> rows(n * 8);
//   store.Lookup(ids, n, /*train=*/true, /*now=*/time_seconds, rows.data());
//   store.ApplyGradients(ids, grads, n, /*step=*/1, time_seconds);
//   store.ExportDelta("/serving/deltas");     // rows changed since the last delta + tombstones
//
// Layout: ids are hashed (splitmix64 finaliser); the high 32 bits choose one of `num_shards`
// shards, the low 32 bits the home slot inside the shard. A shard is an open-addressing table
// (linear probing, backward-shift deletion, no tombstone slots, 74-85% full; any size, not a
// power of two) of 4-byte slots (row index + a hash tag) pointing into a row arena of
// fixed-size chunks; rows are kept dense (a removal moves the last row into the hole), so
// expiry, export and snapshots walk contiguous memory. A row is a 20-byte header (id, update
// count with the delta's dirty bit, low 32 bits of the last step, last time in whole seconds)
// then the values and optimizer state: 84 bytes at dim 8 with Adagrad. Chunks are one 2 MiB
// huge page each (the last grows to that size), because random probes over gigabytes of rows
// are otherwise dominated by TLB misses. Batch calls first deduplicate the ids (a private
// 4-byte-slot table that stays in L2), then probe the shared table once per distinct id with
// slots and rows prefetched ahead.
//
// Row metadata limits: update counts saturate at 2**31 - 1; last steps are exact while a row is
// less than 2**31 steps behind (or ahead of) the global step; last times are kept to the second
// (rounded to nearest) within 1970-2106, so idle-seconds expiry is exact to +-0.5 s.
//
// Thread safety: every public method may be called from any number of threads at once. Each
// shard has a reader/writer lock. Reads take every shard's lock shared (in shard order) and
// split the batch by position over up to `num_threads` threads. Training lookups insert unseen
// ids shard by shard, each shard's lock taken exclusively in turn; ApplyGradients sums and
// checks the gradients without locks, then holds every shard's lock exclusively (taken in shard
// order) while its threads update the rows. Methods that span shards (Save, ExportDelta,
// Stats, ExportRows) see each shard at one instant but not all shards at the same instant;
// pause writers for a globally consistent snapshot.
//
// Numbers are little-endian on disk; the store refuses to build on big-endian machines.
#ifndef PREFIXREC_EMBEDDING_STORE_H_
#define PREFIXREC_EMBEDDING_STORE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "prefixrec/store_error.h"

namespace prefixrec {

enum class OptimizerKind : uint32_t { kSgd = 0, kAdagrad = 1, kAdam = 2, kFtrl = 3 };

// Optimizer hyper-parameters; only those of `kind` are read. All arithmetic is float32.
struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSgd;
  float learning_rate = 0.01f;        // SGD, Adagrad, Adam
  float initial_accumulator = 0.1f;   // Adagrad: accumulator of a new row (> 0)
  float beta1 = 0.9f;                 // Adam
  float beta2 = 0.999f;               // Adam
  float epsilon = 1e-8f;              // Adam
  float alpha = 0.05f;                // FTRL learning rate
  float beta = 1.0f;                  // FTRL
  float l1 = 0.0f;                    // FTRL
  float l2 = 0.0f;                    // FTRL
};

// Floats of optimizer state per embedding value: SGD 0, Adagrad 1 (accumulator),
// Adam 2 (m, v; the row's update count is Adam's t), FTRL 2 (z, n).
int OptimizerStateWidth(OptimizerKind kind);

enum class InitializerKind : uint32_t { kZeros = 0, kUniform = 1, kTruncatedNormal = 2 };

struct InitializerOptions {
  InitializerKind kind = InitializerKind::kTruncatedNormal;
  // kUniform: values in [-scale, scale). kTruncatedNormal: stddev, cut at 2 stddev.
  float scale = 0.01f;
};

enum class FilterKind : uint32_t { kNone = 0, kProbability = 1, kCountingBloom = 2, kCounter = 3 };

// Entry filter. One sighting = one training lookup call that contains the unseen id (duplicates
// inside a call count once).
struct FilterOptions {
  FilterKind kind = FilterKind::kNone;
  double probability = 1.0;           // kProbability: each sighting admits with this probability
  uint32_t min_count = 1;             // kCountingBloom (<= 255), kCounter: admit on this sighting
  uint64_t capacity = 0;              // kCountingBloom: distinct ids the filter is sized for
  double false_positive_rate = 0.01;  // kCountingBloom: target rate at `capacity` ids
};

// Which memory rows move to the disk tier first when a shard is over its memory budget
// (docs/tiered-store.md): kLru = oldest (last step, last time, id), kLfu = fewest (update
// count, last step, id). Both read only the row header: no per-row bytes beyond it.
enum class EvictionKind : uint32_t { kLru = 0, kLfu = 1 };

struct StoreOptions {
  int dim = 8;                        // embedding values per row, 1..4096
  OptimizerOptions optimizer;         // the update rule and the state it keeps per row
  InitializerOptions initializer;     // the values a newly admitted row starts with
  uint64_t seed = 0;                  // with the id, determines initial rows and filter draws
  int num_shards = 16;                // independent locks/tables, 1..4096
  FilterOptions filter;               // which unseen ids get a row
  uint64_t max_rows = 0;              // 0 = unbounded; else when a training lookup exceeds it,
                                      // evict least recently updated rows (by last step, last
                                      // time, id) down to max_rows - max_rows / 100
  int num_threads = 0;                // threads per batch call; 0 = hardware concurrency
  // Two tiers (docs/tiered-store.md): 0 = every row in memory. Else each shard keeps at most
  // (memory_budget_bytes / num_shards) / (row bytes + 5) rows in memory (rows of the current
  // batch excepted) and the rest in its disk tier under <disk_dir>/shard-NNNN, started empty.
  // Lookups and updates give the same results as without a budget.
  uint64_t memory_budget_bytes = 0;
  std::string disk_dir;               // required with a budget, refused without one
  EvictionKind eviction = EvictionKind::kLru;
};

// Counters since construction (they survive Save/Load).
struct StoreStats {
  uint64_t rows = 0;          // rows held now
  uint64_t bytes = 0;         // heap bytes of rows, tables, filter and tombstones
  uint64_t filter_bytes = 0;  // of which the entry filter
  uint64_t admitted = 0;      // ids given a row by a training lookup
  uint64_t rejected = 0;      // sightings the filter turned down
  uint64_t expired = 0;       // rows removed by Expire/Remove
  uint64_t evicted = 0;       // rows removed to respect max_rows
  uint64_t lookups = 0;       // ids looked up (duplicates included)
  uint64_t updates = 0;       // row updates (one per distinct admitted id per ApplyGradients)
  int64_t global_step = 0;    // largest step given to ApplyGradients or received in a delta
  uint64_t delta_sequence = 0;  // sequence of the last delta exported or applied
  // Two tiers (0 without a memory budget; `rows` counts both tiers, `bytes` adds the disk
  // tier's index).
  uint64_t memory_rows = 0;      // rows in memory
  uint64_t disk_rows = 0;        // rows in the disk tier
  uint64_t disk_bytes = 0;       // bytes the disk tier's files take
  uint64_t faults = 0;           // rows a lookup or update had to read back from disk
  uint64_t prefetched = 0;       // rows Prefetch read back from disk ahead of their lookup
  uint64_t evicted_to_disk = 0;  // rows moved from memory to disk
  uint64_t disk_reads = 0;       // rows read from the disk tiers (faults, prefetches, streams)
  uint64_t disk_writes = 0;      // rows written to the disk tiers (evictions, clean write-backs)
};

// Column copies of all rows, shard by shard. values/state are filled only when asked for.
struct RowArrays {
  std::vector<int64_t> ids;
  std::vector<uint32_t> update_counts;
  std::vector<int64_t> last_steps;
  std::vector<double> last_times;
  std::vector<float> l2_norms;  // of the embedding values
  std::vector<float> values;    // rows x dim
  std::vector<float> state;     // rows x dim * OptimizerStateWidth
};

// An entry filter's state, to carry it from store to store (e.g. when a sharded table is
// split anew). kCounter: the pending sightings of ids without a row, sorted by id.
// kCountingBloom: every counter, num_shards x BloomCountersPerShard (shard after shard); the
// same options give every store the same layout, so counters of stores with equal options add
// up element-wise. Empty for the other filters.
struct FilterState {
  std::vector<int64_t> ids;      // kCounter
  std::vector<uint32_t> counts;  // kCounter: sightings of ids[i], 1 .. min_count - 1
  std::vector<uint8_t> bloom;    // kCountingBloom
};

class EmbeddingStore {
 public:
  // Throws StoreError(kInvalidArgument) naming the first bad option.
  explicit EmbeddingStore(const StoreOptions& options);
  ~EmbeddingStore();
  EmbeddingStore(const EmbeddingStore&) = delete;
  EmbeddingStore& operator=(const EmbeddingStore&) = delete;

  const StoreOptions& options() const;
  int dim() const;
  int state_floats() const;  // optimizer floats per row = dim * OptimizerStateWidth
  size_t size() const;       // rows held; O(1)

  // out[i*dim .. (i+1)*dim) = row of ids[i], zeros for ids without a row. O(n).
  // train=true runs unseen ids through the filter, one sighting per distinct id per call (may
  // insert rows, then evicts down to max_rows); train=false only reads (it still counts
  // `lookups`). `now` (seconds) stamps new rows.
  void Lookup(const int64_t* ids, size_t n, bool train, double now, float* out);

  // Lookup of the distinct ids only: unique = distinct ids in order of first appearance,
  // inverse[i] = index of ids[i] in unique, rows = their rows (unique.size() x dim). O(n).
  void LookupUnique(const int64_t* ids, size_t n, bool train, double now,
                    std::vector<int64_t>* unique, int64_t* inverse, std::vector<float>* rows);

  // Two tiers: brings the rows of `ids` that are on disk back into memory ahead of their lookup
  // (one batched read per shard, one shard locked at a time), and keeps them there through
  // later evictions until the next Prefetch. Changes no row's bytes, counter or filter state, so
  // a prefetched run equals one without. The trainer calls it with batch k + 1's ids while
  // batch k trains. No-op without a memory budget. Returns rows brought back. O(n).
  size_t Prefetch(const int64_t* ids, size_t n);

  // unique = distinct ids in order of first appearance, inverse[i] = index of ids[i] in unique.
  // Pure function of its input; O(n).
  static void Deduplicate(const int64_t* ids, size_t n, std::vector<int64_t>* unique,
                          int64_t* inverse);

  // grads is n x dim. Rows of equal ids are summed (in input order), then each distinct id that
  // has a row gets one optimizer update and records (update_count + 1, step, now); ids without a
  // row are ignored. Throws kInvalidArgument before changing anything if a gradient is NaN/Inf,
  // step < 0 or l2 is not a finite number >= 0. O(n * dim).
  //
  // l2 > 0: lazy L2 regularization, as if every step's loss held (l2 / 2) * |w|^2 of every row.
  // A row's gradient gets l2 * idle * w added before its update, idle = step - the row's last
  // step (at least 1; a new row's last step is the step it was admitted at), so a row idle for
  // k steps takes the k steps of decay it missed in one update. Rows that are never updated
  // again keep their values (a lookup does not decay them).
  void ApplyGradients(const int64_t* ids, const float* grads, size_t n, int64_t step, double now,
                      float l2 = 0.0f);

  // Removes rows idle for more than max_idle_steps (global_step - last_step; < 0 = not used) or
  // more than max_idle_seconds (now - last_time, last_time being whole seconds; < 0 = not
  // used). Returns rows removed. O(rows).
  size_t Expire(int64_t max_idle_steps, double max_idle_seconds, double now);

  // Removes the rows of the given ids (counted as expired). Returns rows removed. O(n).
  size_t Remove(const int64_t* ids, size_t n);

  // out[i] = 1 if ids[i] has a row (in memory or on the disk tier), else 0. Reads only: no
  // filter sighting, no counter, no row moves between the tiers. O(n).
  void Contains(const int64_t* ids, size_t n, uint8_t* out) const;

  RowArrays ExportRows(bool with_values) const;  // O(rows)

  // The entry filter's state (see FilterState). O(pending ids + Bloom counters).
  FilterState ExportFilter() const;
  // Adds `state` (as ExportFilter gives it) to this store's filter. kCounter: each id's count
  // is added to its pending count, capped at min_count - 1 (its next sighting admits it); ids
  // that hold a row are left out (a row needs no count). kCountingBloom: counters added
  // element-wise, saturating at 255. Throws kInvalidArgument, changing nothing, when the state
  // does not fit this store's filter: another kind, another Bloom size, a count of 0, an id
  // twice, ids and counts of different lengths. Returns the counter entries and Bloom
  // counters changed. O(n + Bloom counters).
  size_t MergeFilter(const int64_t* ids, const uint32_t* counts, size_t n, const uint8_t* bloom,
                     size_t bloom_size);

  // The row a newly admitted id would start with (values only). O(n * dim).
  void InitialRows(const int64_t* ids, size_t n, float* out) const;

  StoreStats Stats() const;  // O(shards)

  // Full snapshot (rows, optimizer state, metadata, pending delta state, filter state, counters)
  // written to <dir>/store.snapshot atomically (temp file, fsync, rename, fsync dir). Returns
  // bytes written.
  uint64_t Save(const std::string& dir) const;
  // Throws kCorruptFile/kIo; nothing is created on failure.
  static std::unique_ptr<EmbeddingStore> Load(const std::string& dir);
  // Load into a store with a memory budget (StoreOptions::memory_budget_bytes, disk_dir,
  // eviction; not part of snapshots): each shard's rows beyond its budget go to its disk tier
  // as they are read (by the eviction policy), so a snapshot larger than memory loads.
  static std::unique_ptr<EmbeddingStore> Load(const std::string& dir, uint64_t memory_budget_bytes,
                                              const std::string& disk_dir, EvictionKind eviction);

  // Writes <dir>/delta-NNNNNN.bin (atomically) with the rows inserted or changed since the
  // previous delta and tombstones for rows removed since then; returns its path. On failure the
  // pending changes stay pending and the sequence does not advance.
  std::string ExportDelta(const std::string& dir, uint64_t* bytes_written = nullptr);
  // Applies a delta: refuses (changing nothing) a corrupt file, another dim/optimizer
  // (kIncompatible) or a sequence other than delta_sequence + 1 (kOutOfOrder). Returns the
  // sequence applied.
  uint64_t ApplyDelta(const std::string& path);
  // What a delta holds, read without applying it (a serving copy answers on "this store + the
  // delta" before it applies the delta): checked as ApplyDelta checks it (structure, checksum,
  // dim/optimizer, sequence == delta_sequence + 1 + `ahead`), embeddings only (no optimizer
  // state). Its net effect, as ApplyDelta would leave it: an id appears once, in `ids` if the
  // last section naming it holds its row, in `tombstones` if it removes it.
  struct DeltaContents {
    uint64_t sequence = 0;
    int64_t global_step = 0;
    std::vector<int64_t> ids;         // upserted rows, ascending
    std::vector<float> embeddings;    // ids.size() x dim
    std::vector<int64_t> tombstones;  // removed ids, ascending
    bool rebase = false;              // a rebase delta (WriteRebaseDelta): applying it sets
    uint64_t rebase_sequence = 0;     // the delta sequence to this and the global step to
  };                                  // global_step
  DeltaContents ReadDelta(const std::string& path, uint64_t ahead = 0) const;

  // A delta (of sequence delta_sequence + 1) that turns this store's rows into those of the
  // snapshot in `snapshot_dir`, a store of the same dim and optimizer (say another lineage's
  // export of the same model): every snapshot row whose bytes differ from this store's row
  // (the dirty mark aside) or that this store lacks, and a tombstone for every id of this
  // store that the snapshot lacks. Applying it also sets the delta sequence and the global step
  // to the snapshot's, so the snapshot's own deltas apply next; filter state and counters stay
  // this store's. The snapshot is streamed and checked as Load checks it (a damaged one writes
  // nothing): memory is a block of rows and a byte per row of this store, not a second store.
  // Written atomically to `path`. Safe beside lookups (shared locks), not beside writers.
  struct RebaseStats {
    uint64_t rows = 0;        // rows written (differing or new)
    uint64_t tombstones = 0;  // ids removed
    uint64_t unchanged = 0;   // snapshot rows equal to this store's
    uint64_t bytes = 0;       // size of the delta file
  };
  RebaseStats WriteRebaseDelta(const std::string& snapshot_dir, const std::string& path) const;

  struct Impl;

 private:
  explicit EmbeddingStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace prefixrec

#endif  // PREFIXREC_EMBEDDING_STORE_H_
