// One shard of the store: an open-addressing id -> row table over a chunked, dense row arena,
// plus the shard's share of the entry filter and its pending delta state.
//
// Not thread-safe by itself: callers hold `mu` (shared to read, exclusive to change).
#ifndef PREFIXREC_INTERNAL_SHARD_H_
#define PREFIXREC_INTERNAL_SHARD_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "internal/disk_tier.h"
#include "internal/hash.h"
#include "internal/memory.h"

namespace prefixrec::internal {

// The first 20 bytes of every row; `dim` values then the optimizer state follow. The same bytes
// are what snapshots and deltas store (format version 2), so a row is copied to and from disk in
// one piece. Rows are 4-byte aligned only (20 + 4 * floats bytes, e.g. 84 at dim 8 with
// Adagrad): every field is a 32-bit word, and the id is read and written with memcpy.
//
//   id            int64, as two little-endian words
//   count         bits 0-30: update count (saturates at 2**31 - 1); bit 31: dirty (changed
//                 since the last delta)
//   step          low 32 bits of the last step. The full step is rebuilt against the store's
//                 global step: exact while |global step - last step| < 2**31 (StepOf).
//   time          last wall time in whole seconds since 1970, rounded to the nearest second
//                 and clamped to 0 .. 2**32 - 1 (the years 1970-2106): EncodeTime/DecodeTime.
struct RowHeader {
  uint32_t id_words[2];
  uint32_t count;
  uint32_t step;
  uint32_t time;

  int64_t id() const {
    int64_t value;
    std::memcpy(&value, id_words, sizeof value);
    return value;
  }
  void set_id(int64_t value) { std::memcpy(id_words, &value, sizeof value); }
  uint32_t update_count() const { return count & kCountMask; }
  bool dirty() const { return (count & kDirtyBit) != 0; }
  void set_dirty() { count |= kDirtyBit; }
  void clear_dirty() { count &= kCountMask; }
  void add_update() {
    if ((count & kCountMask) != kCountMask) ++count;
  }

  static constexpr uint32_t kDirtyBit = 0x80000000u;
  static constexpr uint32_t kCountMask = 0x7fffffffu;
};
static_assert(sizeof(RowHeader) == 20 && alignof(RowHeader) == 4, "row header is serialised as is");

// Row time stamps: whole seconds since the Unix epoch, rounded to nearest, clamped to 32 bits.
inline uint32_t EncodeTime(double seconds) {
  if (!(seconds > 0.0)) return 0;  // also NaN
  if (seconds >= 4294967295.0) return 0xffffffffu;
  return static_cast<uint32_t>(static_cast<uint64_t>(seconds + 0.5));
}
inline double DecodeTime(uint32_t time) { return static_cast<double>(time); }

// The full last step of a row whose low 32 bits are `step`, relative to `global_step` (the
// nearest value with those low bits, so exact while the two are less than 2**31 apart).
inline int64_t StepOf(uint32_t step, int64_t global_step) {
  const int32_t behind = static_cast<int32_t>(static_cast<uint32_t>(global_step) - step);
  return static_cast<int64_t>(static_cast<uint64_t>(global_step) - static_cast<uint64_t>(int64_t{behind}));
}
// Steps a row is idle: global_step - StepOf(step, global_step).
inline int64_t IdleSteps(uint32_t step, int64_t global_step) {
  return static_cast<int32_t>(static_cast<uint32_t>(global_step) - step);
}

class Shard {
 public:
  static constexpr uint32_t kEmpty = 0xffffffffu;
  // Rows per shard are limited by the 32-bit slots: the row index needs the low bits of a slot
  // (at most 31 of them) and the table is at most kMaxLoad full.
  static constexpr size_t kMaxRows = (size_t{1} << 30) + (size_t{1} << 29);

  // Rows live in chunks of one huge page (2 MiB, or one row if rows are bigger). Only the last
  // chunk is ever partly used: it starts small and grows (in place where the allocator can) to
  // full size, so a shard wastes at most a 32nd of a chunk on rows not yet inserted.
  explicit Shard(size_t row_bytes)
      : row_bytes_(row_bytes),
        chunk_rows_(static_cast<uint32_t>(std::max<size_t>(2, LargeBlock::kHugePage / row_bytes))),
        chunk_magic_(~uint64_t{0} / chunk_rows_ + 1) {
    Rehash(16);
  }

  size_t size() const { return size_; }
  size_t row_bytes() const { return row_bytes_; }
  size_t chunk_rows() const { return chunk_rows_; }

  uint8_t* Row(uint32_t row) const {
    // row / chunk_rows_ without a division instruction (Lemire et al. 2019, exact for 32 bits):
    // it is on every lookup's path, and a hardware divide costs as much as the rest of a probe.
#if defined(__SIZEOF_INT128__)
    uint32_t chunk = static_cast<uint32_t>((static_cast<unsigned __int128>(chunk_magic_) * row) >> 64);
#else
    uint32_t chunk = row / chunk_rows_;
#endif
    return chunks_[chunk].data() + static_cast<size_t>(row - chunk * chunk_rows_) * row_bytes_;
  }
  RowHeader* Header(uint32_t row) const { return reinterpret_cast<RowHeader*>(Row(row)); }
  float* Floats(uint32_t row) const { return reinterpret_cast<float*>(Row(row) + sizeof(RowHeader)); }
  int64_t IdOf(uint32_t row) const { return Header(row)->id(); }

  void Prefetch(uint32_t hash) const {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&slots_[Home(hash)]);
#else
    (void)hash;
#endif
  }

  // The row of the first slot whose hash tag matches (kEmpty if none), with the first `bytes`
  // (<= 1024) of it prefetched. Usually the row of the id; Find confirms.
  uint32_t PrefetchCandidate(uint32_t hash, size_t bytes) const {
    const uint32_t tag = Tag(hash);
    for (size_t i = Home(hash);; i = Next(i)) {
      const uint32_t slot = slots_[i];
      if (slot == kFree) return kEmpty;
      if ((slot & tag_mask_) == tag) {
        const uint32_t row = RowOf(slot);
#if defined(__GNUC__) || defined(__clang__)
        const uint8_t* bytes_at = Row(row);
        const size_t n = std::min<size_t>(bytes, 1024);
        for (size_t b = 0; b < n; b += 64) __builtin_prefetch(bytes_at + b);
        __builtin_prefetch(bytes_at + n - 1);
#else
        (void)bytes;
#endif
        return row;
      }
    }
  }

  // Row of `id` or kEmpty. `hash` is the low 32 bits of HashId(id).
  uint32_t Find(int64_t id, uint32_t hash) const {
    const uint32_t tag = Tag(hash);
    for (size_t i = Home(hash);; i = Next(i)) {
      const uint32_t slot = slots_[i];
      if (slot == kFree) return kEmpty;
      if ((slot & tag_mask_) == tag && IdOf(RowOf(slot)) == id) return RowOf(slot);
    }
  }

  // Appends a zeroed row for `id` (which must be absent) and returns its index.
  uint32_t Insert(int64_t id, uint32_t hash) {
    if (size_ >= kMaxRows) throw std::length_error("shard is full");
    if (static_cast<double>(size_ + 1) > kMaxLoad * static_cast<double>(capacity_)) {
      Rehash(GrownCapacity());
    }
    uint32_t row = static_cast<uint32_t>(size_);
    if (size_ >= row_capacity_) GrowRows();
    std::memset(Row(row), 0, row_bytes_);
    Header(row)->set_id(id);
    size_t i = Home(hash);
    while (slots_[i] != kFree) i = Next(i);
    slots_[i] = Encode(hash, row);
    ++size_;
    return row;
  }

  // Sizes the table for `rows` rows in all (as if they had been inserted one by one, so the
  // table ends up as full as after single inserts), saving the rehashes on the way there.
  void Reserve(size_t rows) {
    size_t capacity = capacity_;
    while (static_cast<double>(rows) > kMaxLoad * static_cast<double>(capacity)) {
      capacity = GrownCapacity(capacity);
    }
    if (capacity != capacity_) Rehash(capacity);
  }

  // Removes `row`; the last row moves into its place (so indices of other rows may change).
  void Remove(uint32_t row, uint32_t hash) {
    EraseSlot(SlotOf(IdOf(row), hash));
    uint32_t last = static_cast<uint32_t>(size_ - 1);
    if (row != last) {
      int64_t moved_id = IdOf(last);
      uint32_t moved_hash = static_cast<uint32_t>(HashOf(moved_id));
      slots_[SlotOf(moved_id, moved_hash)] = Encode(moved_hash, row);
      std::memcpy(Row(row), Row(last), row_bytes_);
    }
    --size_;
    if (chunks_.size() > size_ / chunk_rows_ + 2) {  // keep one spare chunk
      chunks_.pop_back();
      row_capacity_ = chunks_.size() * chunk_rows_;  // only the last chunk was partial
    }
  }

  uint64_t Bytes() const {
    uint64_t bytes = slots_block_.size() + chunks_.capacity() * sizeof(LargeBlock) +
                     tombstones.capacity() * sizeof(int64_t);
    for (const LargeBlock& chunk : chunks_) bytes += chunk.size();
    return bytes + FilterBytes();
  }
  uint64_t FilterBytes() const {
    // unordered_map node: key + count + next pointer + cached hash, plus a bucket pointer.
    if (counts.empty()) return bloom.size();
    return bloom.size() + counts.size() * 40 + counts.bucket_count() * sizeof(void*);
  }
  size_t capacity() const { return capacity_; }

  mutable std::shared_mutex mu;
  uint64_t draw_counter = 0;                     // probability filter: draws made so far
  std::vector<uint8_t> bloom;                    // counting Bloom filter counters (saturating)
  std::unordered_map<int64_t, uint32_t> counts;  // counter filter: sightings of unadmitted ids
  std::vector<int64_t> tombstones;               // ids removed since the last delta
  // Two tiers (docs/tiered-store.md): rows beyond memory_rows_cap live in `tier`, used only
  // under `mu` held exclusively. Null (and cap 0) without a memory budget.
  std::unique_ptr<DiskTier> tier;
  size_t memory_rows_cap = 0;

  static uint64_t HashOf(int64_t id) { return HashId(id); }

 private:
  // The table holds between kMaxLoad / kGrowth and kMaxLoad slots per row: 4 bytes / load,
  // 4.7-5.4 bytes a row (a power-of-two table would swing between 0.375 and 0.75 full, 5.3-10.7
  // bytes a row). Linear probing at 85% is still cheap here: 16 slots share a cache line and
  // the tags skip the rows of other ids.
  static constexpr double kMaxLoad = 0.85;
  static constexpr double kGrowth = 1.15;

  // A slot is 4 bytes: 0 when free, else row + 1 in its low `row_bits_` bits and, above them, a
  // tag of low hash bits (the home slot comes from the high bits: (hash * capacity) >> 32), so
  // most slots of other ids are passed over without reading their row.
  static constexpr uint32_t kFree = 0;
  size_t Home(uint32_t hash) const {
    return static_cast<size_t>((static_cast<uint64_t>(hash) * capacity_) >> 32);
  }
  size_t Next(size_t i) const { return i + 1 == capacity_ ? 0 : i + 1; }
  uint32_t Tag(uint32_t hash) const { return (hash << row_bits_) & tag_mask_; }
  uint32_t Encode(uint32_t hash, uint32_t row) const { return Tag(hash) | (row + 1); }
  uint32_t RowOf(uint32_t slot) const { return (slot & ~tag_mask_) - 1; }
  size_t GrownCapacity() const { return GrownCapacity(capacity_); }
  static size_t GrownCapacity(size_t capacity) {
    return std::max(capacity + 16, static_cast<size_t>(static_cast<double>(capacity) * kGrowth));
  }

  size_t SlotOf(int64_t id, uint32_t hash) const {
    const uint32_t tag = Tag(hash);
    for (size_t i = Home(hash);; i = Next(i)) {
      const uint32_t slot = slots_[i];
      if (slot != kFree && (slot & tag_mask_) == tag && IdOf(RowOf(slot)) == id) return i;
    }
  }

  size_t ChunkBytes(size_t rows) const {
    return rows == chunk_rows_ ? std::max(LargeBlock::kHugePage, rows * row_bytes_) : rows * row_bytes_;
  }

  // Makes room for one more row: a new chunk if the last one is full, else the last chunk
  // grows (doubling from 64 rows up to a 32nd of a chunk, then by 32nds; in place where realloc
  // can, e.g. by remapping), and a chunk that reaches full size moves once into a huge page.
  void GrowRows() {
    const size_t step = std::max<size_t>(1, chunk_rows_ / 32);
    size_t last_rows = chunks_.empty() ? chunk_rows_ : row_capacity_ - (chunks_.size() - 1) * chunk_rows_;
    if (last_rows == chunk_rows_) {
      size_t rows = std::min<size_t>(chunk_rows_, chunks_.empty() ? 64 : step);
      chunks_.emplace_back(ChunkBytes(rows));
      row_capacity_ += rows;
      return;
    }
    size_t rows = std::min<size_t>(chunk_rows_, last_rows < step ? std::max<size_t>(64, last_rows * 2)
                                                                  : last_rows + step);
    const size_t used = size_ - (chunks_.size() - 1) * chunk_rows_;
    if (rows == chunk_rows_ || !chunks_.back().Resize(ChunkBytes(rows))) {
      LargeBlock block(ChunkBytes(rows));
      std::memcpy(block.data(), chunks_.back().data(), used * row_bytes_);
      chunks_.back() = std::move(block);
    }
    row_capacity_ += rows - last_rows;
  }

  // Backward-shift deletion: later entries of the probe run move up so no tombstone is needed.
  void EraseSlot(size_t hole) {
    for (size_t j = Next(hole); slots_[j] != kFree; j = Next(j)) {
      size_t home = Home(static_cast<uint32_t>(HashOf(IdOf(RowOf(slots_[j])))));
      // The entry at j may fill the hole if its home is not in (hole, j] (cyclically).
      size_t from_home = j >= home ? j - home : j + capacity_ - home;
      size_t from_hole = j >= hole ? j - hole : j + capacity_ - hole;
      if (from_home >= from_hole) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = kFree;
  }

  // Rebuilds the slots for `capacity` from the rows, in row order.
  void Rehash(size_t capacity) {
    if (capacity >= (size_t{1} << 31)) throw std::length_error("shard is full");
    int bits = 1;
    while ((size_t{1} << bits) < capacity + 1) ++bits;  // row + 1 <= capacity fits in `bits`
    LargeBlock block(capacity * sizeof(uint32_t));
    uint32_t* slots = reinterpret_cast<uint32_t*>(block.data());
    std::memset(slots, 0, capacity * sizeof(uint32_t));
    slots_block_ = std::move(block);
    slots_ = slots;
    capacity_ = capacity;
    row_bits_ = bits;
    tag_mask_ = ~((uint32_t{1} << bits) - 1);  // bits <= 31
    for (size_t r = 0; r < size_; ++r) {
      uint32_t hash = static_cast<uint32_t>(HashOf(IdOf(static_cast<uint32_t>(r))));
      size_t i = Home(hash);
      while (slots_[i] != kFree) i = Next(i);
      slots_[i] = Encode(hash, static_cast<uint32_t>(r));
    }
  }

  size_t row_bytes_;
  uint32_t chunk_rows_;
  uint64_t chunk_magic_;  // ceil(2**64 / chunk_rows_)
  size_t row_capacity_ = 0;  // rows the chunks can hold
  size_t size_ = 0;
  size_t capacity_ = 0;
  int row_bits_ = 0;
  uint32_t tag_mask_ = 0;
  uint32_t* slots_ = nullptr;  // capacity_ slots inside slots_block_
  LargeBlock slots_block_;
  std::vector<LargeBlock> chunks_;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_SHARD_H_
