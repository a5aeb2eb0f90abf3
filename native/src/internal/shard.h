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

#include "internal/hash.h"
#include "internal/memory.h"

namespace prefixrec::internal {

// The first 32 bytes of every row; `dim` values then the optimizer state follow. The same bytes
// are what snapshots and deltas store, so a row is copied to and from disk in one piece.
struct RowHeader {
  int64_t id;
  uint32_t update_count;
  uint32_t flags;  // kRowDirty: changed since the last delta
  int64_t last_step;
  double last_time;
};
static_assert(sizeof(RowHeader) == 32, "row header is serialised as is");

constexpr uint32_t kRowDirty = 1u;
constexpr uint32_t kKnownRowFlags = kRowDirty;

class Shard {
 public:
  static constexpr uint32_t kEmpty = 0xffffffffu;
  static constexpr size_t kMaxRows = 0xfffffff0u;

  // Rows live in chunks of one huge page (2 MiB, or one row if rows are bigger); only the first
  // chunk moves, while it grows to full size.
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

  void Prefetch(uint32_t hash) const {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&slots_[hash & mask_]);
#else
    (void)hash;
#endif
  }

  // The row of the first slot whose hash matches (kEmpty if none), with the first `bytes`
  // (<= 512) of it prefetched. Usually the row of the id; Find confirms.
  uint32_t PrefetchCandidate(uint32_t hash, size_t bytes) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.row == kEmpty) return kEmpty;
      if (slot.hash == hash) {
#if defined(__GNUC__) || defined(__clang__)
        const uint8_t* row = Row(slot.row);
        for (size_t b = 0; b < std::min<size_t>(bytes, 512); b += 64) __builtin_prefetch(row + b);
        __builtin_prefetch(row + std::min<size_t>(bytes, 512) - 1);
#else
        (void)bytes;
#endif
        return slot.row;
      }
    }
  }

  // Row of `id` or kEmpty. `hash` is the low 32 bits of HashId(id).
  uint32_t Find(int64_t id, uint32_t hash) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (slot.row == kEmpty) return kEmpty;
      if (slot.hash == hash && Header(slot.row)->id == id) return slot.row;
    }
  }

  // Appends a zeroed row for `id` (which must be absent) and returns its index.
  uint32_t Insert(int64_t id, uint32_t hash) {
    if ((size_ + 1) * 4 > capacity_ * 3) Rehash(capacity_ * 2);
    if (size_ >= kMaxRows) throw std::length_error("shard is full");
    uint32_t row = static_cast<uint32_t>(size_);
    if (row < chunk_rows_) {
      if (row >= first_chunk_rows_) GrowFirstChunk();
    } else if (row / chunk_rows_ >= chunks_.size()) {
      chunks_.emplace_back(std::max<size_t>(LargeBlock::kHugePage, chunk_rows_ * row_bytes_));
    }
    std::memset(Row(row), 0, row_bytes_);
    Header(row)->id = id;
    size_t i = hash & mask_;
    while (slots_[i].row != kEmpty) i = (i + 1) & mask_;
    slots_[i] = Slot{hash, row};
    ++size_;
    return row;
  }

  // Removes `row`; the last row moves into its place (so indices of other rows may change).
  void Remove(uint32_t row, uint32_t hash) {
    EraseSlot(SlotOf(Header(row)->id, hash));
    uint32_t last = static_cast<uint32_t>(size_ - 1);
    if (row != last) {
      int64_t moved_id = Header(last)->id;
      uint32_t moved_hash = static_cast<uint32_t>(HashOf(moved_id));
      slots_[SlotOf(moved_id, moved_hash)].row = row;
      std::memcpy(Row(row), Row(last), row_bytes_);
    }
    --size_;
    if (chunks_.size() > size_ / chunk_rows_ + 2) chunks_.pop_back();  // keep one spare chunk
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

  mutable std::shared_mutex mu;
  uint64_t draw_counter = 0;                     // probability filter: draws made so far
  std::vector<uint8_t> bloom;                    // counting Bloom filter counters (saturating)
  std::unordered_map<int64_t, uint32_t> counts;  // counter filter: sightings of unadmitted ids
  std::vector<int64_t> tombstones;               // ids removed since the last delta

  static uint64_t HashOf(int64_t id) { return HashId(id); }

 private:
  struct Slot {
    uint32_t hash;
    uint32_t row;
  };

  size_t SlotOf(int64_t id, uint32_t hash) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].row != kEmpty && slots_[i].hash == hash && Header(slots_[i].row)->id == id) {
        return i;
      }
    }
  }

  // The first chunk starts small and doubles (moving its rows) up to a full chunk, so a store
  // with few rows per shard does not pin a huge page per shard.
  void GrowFirstChunk() {
    size_t rows = std::min<size_t>(chunk_rows_, std::max<size_t>(64, first_chunk_rows_ * 2));
    size_t bytes = rows == chunk_rows_ ? std::max(LargeBlock::kHugePage, rows * row_bytes_)
                                       : rows * row_bytes_;
    LargeBlock block(bytes);
    if (!chunks_.empty()) std::memcpy(block.data(), chunks_[0].data(), size_ * row_bytes_);
    if (chunks_.empty()) {
      chunks_.push_back(std::move(block));
    } else {
      chunks_[0] = std::move(block);
    }
    first_chunk_rows_ = rows;
  }

  // Backward-shift deletion: later entries of the probe run move up so no tombstone is needed.
  void EraseSlot(size_t hole) {
    for (size_t j = (hole + 1) & mask_; slots_[j].row != kEmpty; j = (j + 1) & mask_) {
      size_t home = slots_[j].hash & mask_;
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].row = kEmpty;
  }

  void Rehash(size_t capacity) {
    LargeBlock block(capacity * sizeof(Slot));
    Slot* slots = reinterpret_cast<Slot*>(block.data());
    for (size_t i = 0; i < capacity; ++i) slots[i] = Slot{0, kEmpty};
    size_t new_mask = capacity - 1;
    for (size_t j = 0; j <= mask_ && slots_ != nullptr; ++j) {
      const Slot& slot = slots_[j];
      if (slot.row == kEmpty) continue;
      size_t i = slot.hash & new_mask;
      while (slots[i].row != kEmpty) i = (i + 1) & new_mask;
      slots[i] = slot;
    }
    slots_block_ = std::move(block);
    slots_ = slots;
    mask_ = new_mask;
    capacity_ = capacity;
  }

  size_t row_bytes_;
  uint32_t chunk_rows_;
  uint64_t chunk_magic_;  // ceil(2**64 / chunk_rows_)
  size_t first_chunk_rows_ = 0;  // capacity of chunks_[0] while it is smaller than chunk_rows_
  size_t size_ = 0;
  size_t mask_ = 0;
  size_t capacity_ = 0;
  Slot* slots_ = nullptr;  // capacity_ slots inside slots_block_
  LargeBlock slots_block_;
  std::vector<LargeBlock> chunks_;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_SHARD_H_
