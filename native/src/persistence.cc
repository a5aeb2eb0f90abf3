// Snapshots (Save/Load) and deltas (ExportDelta/ApplyDelta) of the embedding store.
//
// Both file kinds are: a magic + version header, a body of little-endian fields and raw rows
// (the in-memory row bytes: RowHeader then floats), and a 16-byte trailer holding a 64-bit
// checksum of everything before it and an end magic. Version 2 (this build writes it) has the
// 20-byte row header of internal/shard.h; version-1 files (32-byte row header: int64 id, u32
// update count, u32 flags, int64 last step, double last time; rows padded to 8 bytes) are still
// read, converting every row as it is loaded. Files are written to a temporary name in
// the target directory, fsynced, renamed into place and the directory fsynced, so a reader sees
// either the old file or the complete new one; a temporary file a crash left behind is removed
// by the next write of the same file. Each of those steps is a crash point (see
// native/crash_points.py, which lists every point of the project).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "internal/crash_point.h"
#include "internal/file_io.h"
#include "internal/float_files.h"
#include "internal/hash.h"
#include "internal/parallel.h"
#include "internal/store_impl.h"
#include "prefixrec/embedding_store.h"

namespace prefixrec {

using internal::Checksum;
using internal::Corrupt;
using internal::FileReader;
using internal::FileWriter;
using internal::IoError;
using internal::LittleEndian;
using internal::MakeDirectory;
using internal::HashId;
using internal::ParallelFor;
using internal::RowHeader;
using internal::Shard;

namespace {

constexpr char kSnapshotMagic[8] = {'P', 'R', 'X', 'S', 'N', 'A', 'P', '1'};
constexpr char kDeltaMagic[8] = {'P', 'R', 'X', 'D', 'E', 'L', 'T', '1'};
constexpr uint32_t kSnapshotVersion = 2;
constexpr uint32_t kDeltaVersion = 2;
constexpr uint32_t kOldestVersion = 1;  // oldest snapshot/delta version this build converts
// A rebase section (WriteRebaseDelta) has no payload: its count is the delta sequence the
// store takes once the delta is applied (readers of older builds refuse it as unknown).
constexpr uint8_t kSectionEnd = 0, kSectionTombstones = 1, kSectionRows = 2, kSectionRebase = 3;
constexpr size_t kBlockRows = 65536;

static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE float sizes expected");

std::string SnapshotPath(const std::string& dir) { return dir + "/store.snapshot"; }

void PutOptions(FileWriter& w, const StoreOptions& o) {
  w.Put<uint32_t>(static_cast<uint32_t>(o.dim));
  w.Put<uint32_t>(static_cast<uint32_t>(o.optimizer.kind));
  const OptimizerOptions& p = o.optimizer;
  for (float x : {p.learning_rate, p.initial_accumulator, p.beta1, p.beta2, p.epsilon, p.alpha,
                  p.beta, p.l1, p.l2}) {
    w.Put<float>(x);
  }
  w.Put<uint32_t>(static_cast<uint32_t>(o.initializer.kind));
  w.Put<float>(o.initializer.scale);
  w.Put<uint64_t>(o.seed);
  w.Put<uint32_t>(static_cast<uint32_t>(o.num_shards));
  w.Put<uint32_t>(static_cast<uint32_t>(o.filter.kind));
  w.Put<double>(o.filter.probability);
  w.Put<uint32_t>(o.filter.min_count);
  w.Put<uint64_t>(o.filter.capacity);
  w.Put<double>(o.filter.false_positive_rate);
  w.Put<uint64_t>(o.max_rows);
  w.Put<uint32_t>(static_cast<uint32_t>(o.num_threads));
}

StoreOptions GetOptions(FileReader& r) {
  StoreOptions o;
  o.dim = static_cast<int>(r.Get<uint32_t>());
  o.optimizer.kind = static_cast<OptimizerKind>(r.Get<uint32_t>());
  OptimizerOptions& p = o.optimizer;
  for (float* x : {&p.learning_rate, &p.initial_accumulator, &p.beta1, &p.beta2, &p.epsilon,
                   &p.alpha, &p.beta, &p.l1, &p.l2}) {
    *x = r.Get<float>();
  }
  o.initializer.kind = static_cast<InitializerKind>(r.Get<uint32_t>());
  o.initializer.scale = r.Get<float>();
  o.seed = r.Get<uint64_t>();
  o.num_shards = static_cast<int>(r.Get<uint32_t>());
  o.filter.kind = static_cast<FilterKind>(r.Get<uint32_t>());
  o.filter.probability = r.Get<double>();
  o.filter.min_count = r.Get<uint32_t>();
  o.filter.capacity = r.Get<uint64_t>();
  o.filter.false_positive_rate = r.Get<double>();
  o.max_rows = r.Get<uint64_t>();
  o.num_threads = static_cast<int>(r.Get<uint32_t>());
  return o;
}

std::string OptimizerName(uint32_t kind) {
  switch (static_cast<OptimizerKind>(kind)) {
    case OptimizerKind::kSgd: return "SGD";
    case OptimizerKind::kAdagrad: return "Adagrad";
    case OptimizerKind::kAdam: return "Adam";
    case OptimizerKind::kFtrl: return "FTRL";
  }
  return "of unknown kind " + std::to_string(kind);
}

void CheckMagic(FileReader& r, const char (&magic)[8], const char* kind) {
  char found[8];
  r.Read(found, 8);
  if (std::memcmp(found, magic, 8) != 0) {
    Corrupt(r.path(), std::string("not a ") + kind + " file (bad magic)");
  }
}

// Version 1 rows: a 32-byte header, then the floats, padded to a multiple of 8 bytes.
struct RowHeaderV1 {
  int64_t id;
  uint32_t update_count;
  uint32_t flags;  // bit 0: dirty
  int64_t last_step;
  double last_time;
};
static_assert(sizeof(RowHeaderV1) == 32, "version-1 row header");
constexpr uint32_t kV1Dirty = 1u;

size_t RowBytesOf(uint32_t version, size_t floats) {
  if (version == 1) return (sizeof(RowHeaderV1) + 4 * floats + 7) & ~size_t{7};
  return sizeof(RowHeader) + 4 * floats;
}

// Refuses a row that no writer of `version` could have written (checked before any change).
void CheckRow(const std::string& path, uint32_t version, const uint8_t* row) {
  if (version != 1) return;  // every version-2 bit pattern is a valid row
  RowHeaderV1 header;
  std::memcpy(&header, row, sizeof header);
  if ((header.flags & ~kV1Dirty) != 0) {
    Corrupt(path, "row of id " + std::to_string(header.id) + " has unknown flags");
  }
}

// Writes the current-version bytes (row_bytes) of a row read from a file of `version`.
// Version 1: the update count saturates at 2**31 - 1, the last time is rounded to the second and
// a last step more than 2**31 - 1 steps from `global_step` is clamped to that distance (so the
// row stays that idle; version 2 keeps the low 32 bits of the step).
void ConvertRow(uint32_t version, const uint8_t* src, size_t floats, int64_t global_step, uint8_t* dst) {
  if (version != 1) {
    std::memcpy(dst, src, sizeof(RowHeader) + 4 * floats);
    return;
  }
  RowHeaderV1 old;
  std::memcpy(&old, src, sizeof old);
  RowHeader header;
  header.set_id(old.id);
  header.count = std::min<uint32_t>(old.update_count, RowHeader::kCountMask);
  if (old.flags & kV1Dirty) header.set_dirty();
  constexpr int64_t kReach = (int64_t{1} << 31) - 1;
  int64_t step = old.last_step;
  if (step < global_step && static_cast<uint64_t>(global_step) - static_cast<uint64_t>(step) >
                                static_cast<uint64_t>(kReach)) {
    step = global_step - kReach;
  } else if (step > global_step && static_cast<uint64_t>(step) - static_cast<uint64_t>(global_step) >
                                       static_cast<uint64_t>(kReach)) {
    step = global_step + kReach;
  }
  header.step = static_cast<uint32_t>(step);
  header.time = internal::EncodeTime(old.last_time);
  std::memcpy(dst, &header, sizeof header);
  std::memcpy(dst + sizeof header, src + sizeof old, 4 * floats);
}

std::string VersionError(const char* kind, uint32_t version, uint32_t newest) {
  return std::string(kind) + " version " + std::to_string(version) + ", this build reads versions " +
         std::to_string(kOldestVersion) + " to " + std::to_string(newest);
}

// A snapshot's fields before its shards.
struct SnapshotHeader {
  uint32_t version = 0;
  uint32_t row_bytes = 0;
  StoreOptions options;
  int64_t global_step = 0;
  uint64_t delta_sequence = 0;
  uint64_t counters[6] = {};  // admitted, rejected, expired, evicted, lookups, updates
};

SnapshotHeader ReadSnapshotHeader(FileReader& r) {
  CheckMagic(r, kSnapshotMagic, "store snapshot");
  SnapshotHeader head;
  head.version = r.Get<uint32_t>();
  if (head.version < kOldestVersion || head.version > kSnapshotVersion) {
    Corrupt(r.path(), VersionError("snapshot", head.version, kSnapshotVersion));
  }
  head.row_bytes = r.Get<uint32_t>();
  head.options = GetOptions(r);
  try {
    ValidateOptions(head.options);
  } catch (const StoreError& e) {
    Corrupt(r.path(), std::string("invalid options: ") + e.what());
  }
  head.global_step = r.Get<int64_t>();
  head.delta_sequence = r.Get<uint64_t>();
  for (uint64_t& counter : head.counters) counter = r.Get<uint64_t>();
  return head;
}

// Reads and discards `n` bytes (they still count for the checksum).
void Skip(FileReader& r, uint64_t n) {
  std::vector<uint8_t> scratch(static_cast<size_t>(std::min<uint64_t>(n, 1 << 20)));
  while (n > 0) {
    size_t take = static_cast<size_t>(std::min<uint64_t>(n, scratch.size()));
    r.Read(scratch.data(), take);
    n -= take;
  }
}

// A snapshot shard's counts, the fields before its rows: the row count checked against the
// bytes left (rows of `row_bytes`), the Bloom counters against the `bloom` the options give.
struct ShardCounts {
  uint64_t rows = 0, draw_counter = 0, bloom_bytes = 0, counter_entries = 0, tombstones = 0;
};

ShardCounts ReadShardCounts(FileReader& r, size_t row_bytes, uint64_t bloom, size_t shard_index) {
  ShardCounts c;
  c.rows = r.Get<uint64_t>();
  c.draw_counter = r.Get<uint64_t>();
  c.bloom_bytes = r.Get<uint64_t>();
  c.counter_entries = r.Get<uint64_t>();
  c.tombstones = r.Get<uint64_t>();
  r.CheckCount(c.rows, row_bytes, "row");
  if (c.bloom_bytes != bloom) {
    Corrupt(r.path(), "shard " + std::to_string(shard_index) + " has " + std::to_string(c.bloom_bytes) +
                          " Bloom counters, expected " + std::to_string(bloom));
  }
  return c;
}

// Skips what follows a shard's rows (Bloom counters, filter counters, tombstones), checked.
void SkipShardTail(FileReader& r, const ShardCounts& c) {
  Skip(r, c.bloom_bytes);
  r.CheckCount(c.counter_entries, 16, "filter counter");
  Skip(r, c.counter_entries * 16);
  r.CheckCount(c.tombstones, 8, "tombstone");
  Skip(r, c.tombstones * 8);
}

// A delta's header: written by this build (the current row layout) for store `s`.
void PutDeltaHeader(FileWriter& w, const EmbeddingStore::Impl& s, uint64_t sequence, int64_t global_step) {
  w.Write(kDeltaMagic, 8);
  w.Put<uint32_t>(kDeltaVersion);
  w.Put<uint32_t>(static_cast<uint32_t>(s.row_bytes));
  w.Put<uint32_t>(static_cast<uint32_t>(s.dim));
  w.Put<uint32_t>(static_cast<uint32_t>(s.options.optimizer.kind));
  w.Put<uint64_t>(sequence);
  w.Put<int64_t>(global_step);
}

// Rows equal but for the dirty mark (which says only whether a delta still has to carry it).
bool SameRow(const uint8_t* a, const uint8_t* b, size_t row_bytes) {
  RowHeader ha, hb;
  std::memcpy(&ha, a, sizeof ha);
  std::memcpy(&hb, b, sizeof hb);
  ha.clear_dirty();
  hb.clear_dirty();
  return std::memcmp(&ha, &hb, sizeof ha) == 0 &&
         std::memcmp(a + sizeof(RowHeader), b + sizeof(RowHeader), row_bytes - sizeof(RowHeader)) == 0;
}

}  // namespace

uint64_t EmbeddingStore::Save(const std::string& dir) const {
  const Impl& s = *impl_;
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "snapshots need a little-endian machine");
  MakeDirectory(dir);
  FileWriter w(SnapshotPath(dir), "store.snapshot");
  w.Write(kSnapshotMagic, 8);
  w.Put<uint32_t>(kSnapshotVersion);
  w.Put<uint32_t>(static_cast<uint32_t>(s.row_bytes));
  PutOptions(w, s.options);
  w.Put<int64_t>(s.global_step.load());
  w.Put<uint64_t>(s.delta_sequence.load());
  for (const std::atomic<uint64_t>* counter :
       {&s.admitted, &s.rejected, &s.expired, &s.evicted, &s.lookups, &s.updates}) {
    w.Put<uint64_t>(counter->load());
  }
  for (const auto& shard_ptr : s.shards) {
    const Shard& shard = *shard_ptr;
    // Exclusive with a tier (one call at a time uses it), shared otherwise.
    std::unique_lock<std::shared_mutex> tier_lock(shard.mu, std::defer_lock);
    std::shared_lock<std::shared_mutex> lock(shard.mu, std::defer_lock);
    if (shard.tier) tier_lock.lock(); else lock.lock();
    const uint64_t disk_rows = shard.tier ? shard.tier->Count() : 0;
    w.Put<uint64_t>(shard.size() + disk_rows);
    w.Put<uint64_t>(shard.draw_counter);
    w.Put<uint64_t>(shard.bloom.size());
    w.Put<uint64_t>(shard.counts.size());
    w.Put<uint64_t>(shard.tombstones.size());
    for (size_t r = 0; r < shard.size(); r += shard.chunk_rows()) {
      size_t rows_in_chunk = std::min(shard.chunk_rows(), shard.size() - r);
      w.Write(shard.Row(static_cast<uint32_t>(r)), rows_in_chunk * s.row_bytes);
    }
    if (disk_rows > 0) {  // then the rows on disk, streamed: one block in memory, never all
      uint64_t streamed = 0;
      shard.tier->ForEach(kBlockRows, [&](const uint8_t* block, size_t n) {
        w.Write(block, n * s.row_bytes);
        streamed += n;
      });
      if (streamed != disk_rows) {
        throw StoreError(ErrorCode::kIo, "disk tier gave " + std::to_string(streamed) +
                                             " rows, expected " + std::to_string(disk_rows));
      }
    }
    w.Write(shard.bloom.data(), shard.bloom.size());
    // Sorted so equal stores write equal bytes.
    std::vector<std::pair<int64_t, uint32_t>> counts(shard.counts.begin(), shard.counts.end());
    std::sort(counts.begin(), counts.end());
    for (const auto& entry : counts) {
      w.Put<int64_t>(entry.first);
      w.Put<uint64_t>(entry.second);
    }
    w.Write(shard.tombstones.data(), shard.tombstones.size() * sizeof(int64_t));
  }
  return w.Commit();
}

std::unique_ptr<EmbeddingStore> EmbeddingStore::Load(const std::string& dir) {
  return Load(dir, 0, "", EvictionKind::kLru);
}

std::unique_ptr<EmbeddingStore> EmbeddingStore::Load(const std::string& dir,
                                                     uint64_t memory_budget_bytes,
                                                     const std::string& disk_dir,
                                                     EvictionKind eviction) {
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "snapshots need a little-endian machine");
  FileReader r(SnapshotPath(dir));
  SnapshotHeader head = ReadSnapshotHeader(r);
  const uint32_t version = head.version, row_bytes = head.row_bytes;
  StoreOptions& options = head.options;
  options.memory_budget_bytes = memory_budget_bytes;
  options.disk_dir = disk_dir;
  options.eviction = eviction;
  // The Bloom counters are stored in the file: a size that cannot fit is corruption, and
  // checking first avoids allocating what a flipped capacity bit asks for.
  uint64_t bloom = Impl::BloomCountersPerShard(options);
  if (bloom > 0 && bloom > r.remaining() / static_cast<uint64_t>(options.num_shards)) {
    Corrupt(r.path(), "filter size does not fit in the file");
  }
  std::unique_ptr<Impl> impl(new Impl(options));
  const size_t floats = static_cast<size_t>(impl->dim + impl->state_floats);
  if (RowBytesOf(version, floats) != row_bytes) {
    Corrupt(r.path(), "row size " + std::to_string(row_bytes) + " does not match the options' " +
                          std::to_string(RowBytesOf(version, floats)));
  }
  impl->global_step = head.global_step;
  impl->delta_sequence = head.delta_sequence;
  {
    size_t i = 0;
    for (std::atomic<uint64_t>* counter : {&impl->admitted, &impl->rejected, &impl->expired,
                                           &impl->evicted, &impl->lookups, &impl->updates}) {
      *counter = head.counters[i++];
    }
  }
  std::vector<uint8_t> block;
  std::vector<uint8_t> converted(impl->row_bytes);
  const int64_t global_step = impl->global_step.load();
  for (size_t shard_index = 0; shard_index < impl->shards.size(); ++shard_index) {
    Shard& shard = *impl->shards[shard_index];
    const ShardCounts counts = ReadShardCounts(r, row_bytes, shard.bloom.size(), shard_index);
    const uint64_t rows = counts.rows, counter_entries = counts.counter_entries,
                   tombstones = counts.tombstones;
    shard.draw_counter = counts.draw_counter;
    if (rows > Shard::kMaxRows) Corrupt(r.path(), "shard " + std::to_string(shard_index) + " has too many rows");
    shard.Reserve(shard.tier ? std::min<size_t>(static_cast<size_t>(rows), shard.memory_rows_cap)
                             : static_cast<size_t>(rows));
    for (uint64_t done = 0; done < rows;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kBlockRows, rows - done));
      block.resize(n * row_bytes);
      r.Read(block.data(), block.size());
      for (size_t i = 0; i < n; ++i) {
        const uint8_t* bytes = block.data() + i * row_bytes;
        CheckRow(r.path(), version, bytes);
        int64_t id;
        std::memcpy(&id, bytes, sizeof id);
        uint64_t hash = HashId(id);
        if (impl->ShardOf(hash) != shard_index) {
          Corrupt(r.path(), "id " + std::to_string(id) + " stored in the wrong shard");
        }
        if (shard.Find(id, static_cast<uint32_t>(hash)) != Shard::kEmpty ||
            (shard.tier && shard.tier->Contains(id))) {
          Corrupt(r.path(), "id " + std::to_string(id) + " stored twice");
        }
        uint32_t row = shard.Insert(id, static_cast<uint32_t>(hash));
        if (version == kSnapshotVersion) {
          std::memcpy(shard.Row(row), bytes, row_bytes);
        } else {
          ConvertRow(version, bytes, floats, global_step, converted.data());
          std::memcpy(shard.Row(row), converted.data(), impl->row_bytes);
        }
      }
      if (shard.tier) impl->EvictToDisk(shard, nullptr);  // memory: the cap plus a block
      done += n;
    }
    impl->rows += rows;
    r.Read(shard.bloom.data(), shard.bloom.size());
    r.CheckCount(counter_entries, 16, "filter counter");
    for (uint64_t i = 0; i < counter_entries; ++i) {
      int64_t id = r.Get<int64_t>();
      uint64_t count = r.Get<uint64_t>();
      shard.counts[id] = static_cast<uint32_t>(count);
    }
    r.CheckCount(tombstones, 8, "tombstone");
    shard.tombstones.resize(tombstones);
    r.Read(shard.tombstones.data(), tombstones * sizeof(int64_t));
  }
  r.VerifyTrailer();
  return std::unique_ptr<EmbeddingStore>(new EmbeddingStore(std::move(impl)));
}

std::string EmbeddingStore::ExportDelta(const std::string& dir, uint64_t* bytes_written) {
  Impl& s = *impl_;
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "deltas need a little-endian machine");
  std::lock_guard<std::mutex> delta_lock(s.delta_mu);
  MakeDirectory(dir);
  uint64_t sequence = s.delta_sequence.load() + 1;
  char name[32];
  std::snprintf(name, sizeof name, "/delta-%06" PRIu64 ".bin", sequence);
  std::string path = dir + name;
  // What this delta took from each shard, to put back if writing fails.
  std::vector<std::vector<int64_t>> taken_rows(s.shards.size()), taken_tombstones(s.shards.size());
  try {
    FileWriter w(path, "store.delta");
    PutDeltaHeader(w, s, sequence, s.global_step.load());
    std::vector<uint8_t> rows;
    for (size_t shard_index = 0; shard_index < s.shards.size(); ++shard_index) {
      Shard& shard = *s.shards[shard_index];
      std::vector<int64_t>& ids = taken_rows[shard_index];
      {
        std::unique_lock<std::shared_mutex> lock(shard.mu);
        taken_tombstones[shard_index].swap(shard.tombstones);
        rows.clear();
        for (uint32_t r = 0; r < shard.size(); ++r) {
          RowHeader* header = shard.Header(r);
          if (!header->dirty()) continue;
          header->clear_dirty();
          ids.push_back(header->id());
          const uint8_t* bytes = shard.Row(r);
          rows.insert(rows.end(), bytes, bytes + s.row_bytes);
        }
        if (shard.tier && shard.tier->Count() > 0) {
          // A row updated then moved to disk carries its dirty bit there: the tier is streamed,
          // its dirty rows join the delta and go back to disk clean (as memory rows are cleared
          // above; a failed export marks them dirty again below).
          const size_t memory_dirty = ids.size();
          shard.tier->ForEach(kBlockRows, [&](const uint8_t* block, size_t n) {
            for (size_t i = 0; i < n; ++i) {
              const uint8_t* bytes = block + i * s.row_bytes;
              RowHeader header;
              std::memcpy(&header, bytes, sizeof header);
              if (!header.dirty()) continue;
              ids.push_back(header.id());
              rows.insert(rows.end(), bytes, bytes + s.row_bytes);
              header.clear_dirty();
              std::memcpy(rows.data() + rows.size() - s.row_bytes, &header, sizeof header);
            }
          });
          if (ids.size() > memory_dirty) {
            shard.tier->Put(ids.data() + memory_dirty, rows.data() + memory_dirty * s.row_bytes,
                            ids.size() - memory_dirty);
          }
        }
      }
      const std::vector<int64_t>& tombstones = taken_tombstones[shard_index];
      if (!tombstones.empty()) {
        w.Put<uint8_t>(kSectionTombstones);
        w.Put<uint64_t>(tombstones.size());
        w.Write(tombstones.data(), tombstones.size() * sizeof(int64_t));
      }
      if (!ids.empty()) {
        w.Put<uint8_t>(kSectionRows);
        w.Put<uint64_t>(ids.size());
        w.Write(rows.data(), rows.size());
      }
    }
    w.Put<uint8_t>(kSectionEnd);
    uint64_t size = w.Commit();
    if (bytes_written) *bytes_written = size;
  } catch (...) {
    for (size_t shard_index = 0; shard_index < s.shards.size(); ++shard_index) {
      Shard& shard = *s.shards[shard_index];
      std::unique_lock<std::shared_mutex> lock(shard.mu);
      std::vector<uint8_t> on_disk(s.row_bytes);
      for (int64_t id : taken_rows[shard_index]) {
        uint32_t row = shard.Find(id, static_cast<uint32_t>(HashId(id)));
        if (row != Shard::kEmpty) {
          shard.Header(row)->set_dirty();
        } else if (shard.tier) {  // on disk now: marked dirty there
          uint8_t found = 0;
          try {
            shard.tier->Get(&id, 1, on_disk.data(), &found, /*take=*/false);
            if (found) {
              reinterpret_cast<RowHeader*>(on_disk.data())->set_dirty();
              shard.tier->Put(&id, on_disk.data(), 1);
            }
          } catch (const StoreError&) {
            // The disk refuses too: the export's own error is the one reported.
          }
        }
      }
      shard.tombstones.insert(shard.tombstones.begin(), taken_tombstones[shard_index].begin(),
                              taken_tombstones[shard_index].end());
    }
    throw;
  }
  s.delta_sequence = sequence;
  return path;
}

namespace {

struct DeltaHeader {
  uint32_t version;
  uint32_t row_bytes;
  uint32_t dim;
  uint32_t optimizer;
  uint64_t sequence;
  int64_t global_step;
};

// Reads the header; leaves `r` at the first section.
DeltaHeader ReadDeltaHeader(FileReader& r) {
  CheckMagic(r, kDeltaMagic, "store delta");
  uint32_t version = r.Get<uint32_t>();
  if (version < kOldestVersion || version > kDeltaVersion) {
    Corrupt(r.path(), VersionError("delta", version, kDeltaVersion));
  }
  DeltaHeader header;
  header.version = version;
  header.row_bytes = r.Get<uint32_t>();
  header.dim = r.Get<uint32_t>();
  header.optimizer = r.Get<uint32_t>();
  header.sequence = r.Get<uint64_t>();
  header.global_step = r.Get<int64_t>();
  if (header.row_bytes < RowBytesOf(version, 0)) Corrupt(r.path(), "row size smaller than a row header");
  return header;
}

// Refuses a (checksum-verified) delta of another store shape or out of sequence.
void CheckDeltaFits(const std::string& path, const DeltaHeader& header,
                    const EmbeddingStore::Impl& s, uint64_t expected) {
  if (header.dim != static_cast<uint32_t>(s.dim) ||
      header.optimizer != static_cast<uint32_t>(s.options.optimizer.kind)) {
    throw StoreError(ErrorCode::kIncompatible,
                     "delta " + path + " was written by a store with dim " + std::to_string(header.dim) +
                         " and optimizer " + OptimizerName(header.optimizer) + "; this store has dim " +
                         std::to_string(s.dim) + " and optimizer " +
                         OptimizerName(static_cast<uint32_t>(s.options.optimizer.kind)));
  }
  if (header.row_bytes != RowBytesOf(header.version, static_cast<size_t>(s.dim + s.state_floats))) {
    Corrupt(path, "row size does not match dim and optimizer");
  }
  if (header.sequence != expected) {
    throw StoreError(ErrorCode::kOutOfOrder,
                     "delta " + path + " has sequence " + std::to_string(header.sequence) +
                         " but this store expects " + std::to_string(expected) +
                         " (apply deltas in order, starting after the snapshot's sequence)");
  }
}

// Walks a delta's sections (``r`` just past the header): every tombstone section and every
// block of rows (each row checked) goes to the callbacks, then the checksum is verified.
// Returns the rebase section's sequence, if the delta has one.
template <typename OnTombstones, typename OnRows>
std::optional<uint64_t> WalkDelta(FileReader& r, const std::string& path, const DeltaHeader& header,
                   OnTombstones on_tombstones, OnRows on_rows) {
  std::vector<uint8_t> block;
  std::optional<uint64_t> rebase;
  for (;;) {
    uint8_t kind = r.Get<uint8_t>();
    if (kind == kSectionEnd) break;
    uint64_t count = r.Get<uint64_t>();
    if (kind == kSectionRebase) {
      if (rebase) Corrupt(path, "two rebase sections");
      rebase = count;
    } else if (kind == kSectionTombstones) {
      r.CheckCount(count, 8, "tombstone");
      block.resize(count * 8);
      r.Read(block.data(), block.size());
      on_tombstones(block.data(), count);
    } else if (kind == kSectionRows) {
      r.CheckCount(count, header.row_bytes, "row");
      for (uint64_t done = 0; done < count;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(kBlockRows, count - done));
        block.resize(n * header.row_bytes);
        r.Read(block.data(), block.size());
        for (size_t i = 0; i < n; ++i) CheckRow(path, header.version, block.data() + i * header.row_bytes);
        on_rows(block.data(), n);
        done += n;
      }
    } else {
      Corrupt(path, "unknown section kind " + std::to_string(kind));
    }
  }
  r.VerifyTrailer();
  return rebase;
}

}  // namespace

namespace {

// The net effect of the delta at `path`; `check(header)` refuses what the reader cannot take
// (after the whole file is verified) and returns the dim of the rows.
template <typename Check>
EmbeddingStore::DeltaContents ReadDeltaWith(const std::string& path, Check check) {
  using DeltaContents = EmbeddingStore::DeltaContents;
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "deltas need a little-endian machine");
  // Pass 1 checks the file and lists its entries (id, number in file order; tombstones marked);
  // pass 2 copies the embedding of each id's last entry straight to its place in the output.
  // Memory: the output and 16 bytes an entry (a full rebase delta is a table's worth of rows).
  constexpr uint64_t kTombstone = uint64_t{1} << 63;
  struct Entry {
    int64_t id;
    uint64_t at;  // number in file order, | kTombstone for a removal
  };
  std::vector<Entry> entries;
  DeltaHeader header;
  std::optional<uint64_t> rebase;
  {
    FileReader r(path);
    header = ReadDeltaHeader(r);
    uint64_t n = 0;
    rebase = WalkDelta(
        r, path, header,
        [&](const uint8_t* ids, uint64_t count) {
          for (uint64_t i = 0; i < count; ++i) {
            int64_t id;
            std::memcpy(&id, ids + i * 8, 8);
            entries.push_back({id, (n++) | kTombstone});
          }
        },
        [&](const uint8_t* block, size_t count) {
          for (size_t i = 0; i < count; ++i) {
            int64_t id;
            std::memcpy(&id, block + i * header.row_bytes, 8);
            entries.push_back({id, n++});
          }
        });
  }
  const size_t dim = check(header);
  const size_t offset = header.version == 1 ? sizeof(RowHeaderV1) : sizeof(RowHeader);
  if (header.row_bytes < offset + 4 * dim) Corrupt(path, "row size smaller than its embedding");
  // An id's last entry decides (stable: equal ids keep file order).
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.id < b.id; });
  DeltaContents out;
  out.sequence = header.sequence;
  out.global_step = header.global_step;
  out.rebase = rebase.has_value();
  out.rebase_sequence = rebase.value_or(0);
  std::vector<std::pair<uint64_t, uint64_t>> wanted;  // (row's number in the file, output row)
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i + 1 < entries.size() && entries[i + 1].id == entries[i].id) continue;
    if (entries[i].at & kTombstone) {
      out.tombstones.push_back(entries[i].id);
    } else {
      wanted.emplace_back(entries[i].at, out.ids.size());
      out.ids.push_back(entries[i].id);
    }
  }
  std::vector<Entry>().swap(entries);
  std::sort(wanted.begin(), wanted.end());
  out.embeddings.resize(out.ids.size() * dim);
  if (!wanted.empty() && dim > 0) {
    FileReader r(path);
    ReadDeltaHeader(r);
    uint64_t n = 0;
    size_t next = 0;
    WalkDelta(
        r, path, header, [&](const uint8_t*, uint64_t count) { n += count; },
        [&](const uint8_t* block, size_t count) {
          for (size_t i = 0; i < count; ++i, ++n) {
            if (next < wanted.size() && wanted[next].first == n) {
              std::memcpy(out.embeddings.data() + wanted[next].second * dim,
                          block + i * header.row_bytes + offset, 4 * dim);
              ++next;
            }
          }
        });
  }
  return out;
}

}  // namespace

EmbeddingStore::DeltaContents EmbeddingStore::ReadDelta(const std::string& path, uint64_t ahead) const {
  const Impl& s = *impl_;
  return ReadDeltaWith(path, [&](const DeltaHeader& header) {
    CheckDeltaFits(path, header, s, s.delta_sequence.load() + 1 + ahead);
    return static_cast<size_t>(s.dim);  // == header.dim once it fits
  });
}

namespace internal {

EmbeddingStore::DeltaContents ReadDeltaFile(const std::string& path, uint32_t* dim) {
  return ReadDeltaWith(path, [&](const DeltaHeader& header) {
    if (header.dim < 1 || header.dim > kMaxExportDim) Corrupt(path, "dim " + std::to_string(header.dim) + " out of range");
    *dim = header.dim;
    return static_cast<size_t>(header.dim);
  });
}

}  // namespace internal

uint64_t EmbeddingStore::ApplyDelta(const std::string& path) {
  Impl& s = *impl_;
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "deltas need a little-endian machine");
  std::lock_guard<std::mutex> delta_lock(s.delta_mu);
  uint64_t expected = s.delta_sequence.load() + 1;
  // Pass 1: check everything (structure, checksum, shape, order) before touching the store.
  std::optional<uint64_t> rebase;
  {
    FileReader r(path);
    DeltaHeader header = ReadDeltaHeader(r);
    rebase =
        WalkDelta(r, path, header, [](const uint8_t*, uint64_t) {}, [](const uint8_t*, size_t) {});
    CheckDeltaFits(path, header, s, expected);
  }
  // Pass 2: apply, tombstones and rows in file order, each block spread over the shards.
  FileReader r(path);
  DeltaHeader header = ReadDeltaHeader(r);
  std::vector<uint8_t> block, converted;
  std::vector<int64_t> ids;
  const size_t floats = static_cast<size_t>(s.dim + s.state_floats);
  for (;;) {
    uint8_t kind = r.Get<uint8_t>();
    if (kind == kSectionEnd) break;
    uint64_t count = r.Get<uint64_t>();
    if (kind == kSectionRebase) continue;  // no payload; read in pass 1
    for (uint64_t done = 0; done < count;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kBlockRows, count - done));
      size_t item_bytes = kind == kSectionRows ? header.row_bytes : sizeof(int64_t);
      block.resize(n * item_bytes);
      r.Read(block.data(), block.size());
      if (kind == kSectionRows && header.version != kDeltaVersion) {
        converted.resize(n * s.row_bytes);
        for (size_t i = 0; i < n; ++i) {
          ConvertRow(header.version, block.data() + i * item_bytes, floats, header.global_step,
                     converted.data() + i * s.row_bytes);
        }
        block.swap(converted);
        item_bytes = s.row_bytes;
      }
      ids.resize(n);
      for (size_t i = 0; i < n; ++i) std::memcpy(&ids[i], block.data() + i * item_bytes, sizeof(int64_t));
      Impl::Partition p = s.Bucketize(ids.data(), n);
      std::atomic<int64_t> row_change{0};
      ParallelFor(s.ThreadsFor(n), s.shards.size(), [&](size_t shard_index) {
        size_t begin = p.offsets[shard_index], end = p.offsets[shard_index + 1];
        if (begin == end) return;
        Shard& shard = *s.shards[shard_index];
        std::unique_lock<std::shared_mutex> lock(shard.mu);
        int64_t change = 0;
        for (size_t k = begin; k < end; ++k) {
          uint32_t pos = p.order[k];
          uint32_t row = shard.Find(ids[pos], p.hash[pos]);
          // A row on disk is removed there, or replaced by the delta's (which lands in memory).
          const bool on_disk = row == Shard::kEmpty && shard.tier && shard.tier->Contains(ids[pos]);
          if (on_disk) shard.tier->Erase(&ids[pos], 1);
          if (kind == kSectionTombstones) {
            if (row == Shard::kEmpty) {
              change -= on_disk ? 1 : 0;
              continue;
            }
            shard.Remove(row, p.hash[pos]);  // a follower keeps no tombstones of its own
            --change;
          } else {
            if (row == Shard::kEmpty) {
              row = shard.Insert(ids[pos], p.hash[pos]);
              change += on_disk ? 0 : 1;
            }
            std::memcpy(shard.Row(row), block.data() + pos * item_bytes, item_bytes);
            shard.Header(row)->clear_dirty();
          }
        }
        if (shard.tier) s.EvictToDisk(shard, nullptr);
        internal::ReclaimIfNeeded(shard.tier.get());  // tombstones may have emptied slots
        row_change.fetch_add(change);
      });
      s.rows.fetch_add(static_cast<uint64_t>(row_change.load()));
      done += n;
    }
  }
  if (rebase) {  // the store now holds the snapshot's rows, at its step and sequence
    s.global_step = header.global_step;
    s.delta_sequence = *rebase;
    return *rebase;
  }
  int64_t seen = s.global_step.load();
  while (header.global_step > seen && !s.global_step.compare_exchange_weak(seen, header.global_step)) {
  }
  s.delta_sequence = header.sequence;
  return header.sequence;
}

EmbeddingStore::RebaseStats EmbeddingStore::WriteRebaseDelta(const std::string& snapshot_dir,
                                                             const std::string& path) const {
  const Impl& s = *impl_;
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "deltas need a little-endian machine");
  FileReader r(SnapshotPath(snapshot_dir));
  SnapshotHeader snap = ReadSnapshotHeader(r);
  if (snap.options.dim != s.dim || snap.options.optimizer.kind != s.options.optimizer.kind) {
    Skip(r, r.remaining());  // a damaged header is damage, not another store
    r.VerifyTrailer();
    throw StoreError(ErrorCode::kIncompatible,
                     "snapshot " + r.path() + " holds a store with dim " + std::to_string(snap.options.dim) +
                         " and optimizer " + OptimizerName(static_cast<uint32_t>(snap.options.optimizer.kind)) +
                         "; this store has dim " + std::to_string(s.dim) + " and optimizer " +
                         OptimizerName(static_cast<uint32_t>(s.options.optimizer.kind)));
  }
  const size_t floats = static_cast<size_t>(s.dim + s.state_floats);
  if (RowBytesOf(snap.version, floats) != snap.row_bytes) {
    Corrupt(r.path(), "row size " + std::to_string(snap.row_bytes) + " does not match the options' " +
                          std::to_string(RowBytesOf(snap.version, floats)));
  }
  const uint64_t bloom = Impl::BloomCountersPerShard(snap.options);
  const size_t snap_shards = static_cast<size_t>(snap.options.num_shards);
  RebaseStats stats;
  FileWriter w(path, "store.delta");
  PutDeltaHeader(w, s, s.delta_sequence.load() + 1, snap.global_step);
  // The sequence to take: the snapshot's (its first delta is delta_sequence + 1).
  w.Put<uint8_t>(kSectionRebase);
  w.Put<uint64_t>(snap.delta_sequence);
  {
    // Shared locks for the walk: lookups go on, a writer would wait (there is none in a server).
    // With a memory budget the locks are exclusive: the disk tiers are read too.
    std::vector<std::shared_lock<std::shared_mutex>> locks;
    std::vector<std::unique_lock<std::shared_mutex>> tier_locks;
    locks.reserve(s.shards.size());
    for (const auto& shard : s.shards) {
      if (s.tiered()) tier_locks.emplace_back(shard->mu); else locks.emplace_back(shard->mu);
    }
    std::unordered_set<int64_t> seen_on_disk;  // this store's disk rows the snapshot has
    std::vector<uint8_t> disk_row(s.row_bytes);
    std::vector<std::vector<uint8_t>> seen(s.shards.size());  // this store's rows the snapshot has
    for (size_t k = 0; k < s.shards.size(); ++k) seen[k].assign(s.shards[k]->size(), 0);
    std::unordered_set<int64_t> added;  // ids this store lacks (a second one is corruption)
    std::vector<uint8_t> block, out, converted(s.row_bytes);
    for (size_t shard_index = 0; shard_index < snap_shards; ++shard_index) {
      const ShardCounts counts = ReadShardCounts(r, snap.row_bytes, bloom, shard_index);
      const uint64_t rows = counts.rows;
      for (uint64_t done = 0; done < rows;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(kBlockRows, rows - done));
        block.resize(n * snap.row_bytes);
        r.Read(block.data(), block.size());
        out.clear();
        uint64_t changed = 0;
        for (size_t i = 0; i < n; ++i) {
          const uint8_t* row = block.data() + i * snap.row_bytes;
          CheckRow(r.path(), snap.version, row);
          if (snap.version != kSnapshotVersion) {
            ConvertRow(snap.version, row, floats, snap.global_step, converted.data());
            row = converted.data();
          }
          int64_t id;
          std::memcpy(&id, row, sizeof id);
          uint64_t hash = HashId(id);
          if (static_cast<size_t>(((hash >> 32) * snap_shards) >> 32) != shard_index) {
            Corrupt(r.path(), "id " + std::to_string(id) + " stored in the wrong shard");
          }
          size_t k = s.ShardOf(hash);
          const Shard& mine = *s.shards[k];
          uint32_t at = mine.Find(id, static_cast<uint32_t>(hash));
          bool same = false;
          if (at != Shard::kEmpty) {
            if (seen[k][at]) Corrupt(r.path(), "id " + std::to_string(id) + " stored twice");
            seen[k][at] = 1;
            same = SameRow(mine.Row(at), row, s.row_bytes);
          } else if (mine.tier && mine.tier->Contains(id)) {
            if (!seen_on_disk.insert(id).second) {
              Corrupt(r.path(), "id " + std::to_string(id) + " stored twice");
            }
            uint8_t found = 0;
            mine.tier->Get(&id, 1, disk_row.data(), &found, /*take=*/false);
            same = found && SameRow(disk_row.data(), row, s.row_bytes);
          } else if (!added.insert(id).second) {
            Corrupt(r.path(), "id " + std::to_string(id) + " stored twice");
          }
          if (same) {
            ++stats.unchanged;
          } else {
            out.insert(out.end(), row, row + s.row_bytes);
            ++changed;
          }
        }
        if (changed) {
          w.Put<uint8_t>(kSectionRows);
          w.Put<uint64_t>(changed);
          w.Write(out.data(), out.size());
          stats.rows += changed;
        }
        done += n;
      }
      SkipShardTail(r, counts);
    }
    r.VerifyTrailer();
    std::vector<int64_t> removed;
    for (size_t k = 0; k < s.shards.size(); ++k) {
      const Shard& mine = *s.shards[k];
      for (uint32_t row = 0; row < mine.size(); ++row) {
        if (!seen[k][row]) removed.push_back(mine.Header(row)->id());
      }
      if (mine.tier) {
        mine.tier->ForEach(kBlockRows, [&](const uint8_t* block_rows, size_t n) {
          for (size_t i = 0; i < n; ++i) {
            int64_t id;
            std::memcpy(&id, block_rows + i * s.row_bytes, sizeof id);
            if (seen_on_disk.count(id) == 0) removed.push_back(id);
          }
        });
      }
    }
    if (!removed.empty()) {
      w.Put<uint8_t>(kSectionTombstones);
      w.Put<uint64_t>(removed.size());
      w.Write(removed.data(), removed.size() * sizeof(int64_t));
      stats.tombstones = removed.size();
    }
  }
  w.Put<uint8_t>(kSectionEnd);
  stats.bytes = w.Commit();
  return stats;
}

namespace internal {

void ReadSnapshotEmbeddings(const std::string& dir,
                            const std::function<void(const FloatSnapshotInfo&)>& on_header,
                            const std::function<void(const int64_t*, const float*, size_t)>& on_rows) {
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "snapshots need a little-endian machine");
  FileReader r(SnapshotPath(dir));
  SnapshotHeader snap = ReadSnapshotHeader(r);
  const uint32_t dim = static_cast<uint32_t>(snap.options.dim);
  if (dim < 1 || dim > kMaxExportDim) Corrupt(r.path(), "dim " + std::to_string(dim) + " out of range");
  const size_t floats =
      static_cast<size_t>(dim) * static_cast<size_t>(1 + OptimizerStateWidth(snap.options.optimizer.kind));
  if (RowBytesOf(snap.version, floats) != snap.row_bytes) {
    Corrupt(r.path(), "row size " + std::to_string(snap.row_bytes) + " does not match the options' " +
                          std::to_string(RowBytesOf(snap.version, floats)));
  }
  on_header({dim, snap.global_step, snap.delta_sequence});
  const size_t offset = snap.version == 1 ? sizeof(RowHeaderV1) : sizeof(RowHeader);
  const uint64_t bloom = EmbeddingStore::Impl::BloomCountersPerShard(snap.options);
  std::vector<uint8_t> block;
  std::vector<int64_t> ids;
  std::vector<float> values;
  for (int shard_index = 0; shard_index < snap.options.num_shards; ++shard_index) {
    const ShardCounts counts =
        ReadShardCounts(r, snap.row_bytes, bloom, static_cast<size_t>(shard_index));
    const uint64_t rows = counts.rows;
    for (uint64_t done = 0; done < rows;) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kBlockRows, rows - done));
      block.resize(n * snap.row_bytes);
      r.Read(block.data(), block.size());
      ids.resize(n);
      values.resize(n * dim);
      for (size_t i = 0; i < n; ++i) {
        const uint8_t* row = block.data() + i * snap.row_bytes;
        CheckRow(r.path(), snap.version, row);
        std::memcpy(&ids[i], row, sizeof(int64_t));
        std::memcpy(values.data() + i * dim, row + offset, sizeof(float) * dim);
      }
      on_rows(ids.data(), values.data(), n);
      done += n;
    }
    SkipShardTail(r, counts);
  }
  r.VerifyTrailer();
}

}  // namespace internal

}  // namespace prefixrec
