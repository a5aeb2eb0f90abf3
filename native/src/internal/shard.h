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
  // Rows per shard are limited by the 32-bit slots: at most 3/4 of 2**32 slots are used.
  static constexpr size_t kMaxRows = (size_t{3} << 30) - 1;

  // Rows live in chunks of one huge page (2 MiB, or one row if rows are bigger). Only the last
  // chunk is ever partly used: it starts small and grows (moving its rows) to full size, so a
  // shard wastes at most an eighth of a chunk on rows not yet inserted.
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

  // The row of the first slot whose hash tag matches (kEmpty if none), with the first `bytes`
  // (<= 1024) of it prefetched. Usually the row of the id; Find confirms.
  uint32_t PrefetchCandidate(uint32_t hash, size_t bytes) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const uint32_t slot = slots_[i];
      if (slot == kFree) return kEmpty;
      if (TagMatches(slot, hash)) {
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
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const uint32_t slot = slots_[i];
      if (slot == kFree) return kEmpty;
      if (TagMatches(slot, hash) && Header(RowOf(slot))->id == id) return RowOf(slot);
    }
  }

  // Appends a zeroed row for `id` (which must be absent) and returns its index.
  uint32_t Insert(int64_t id, uint32_t hash) {
    if (size_ >= kMaxRows) throw std::length_error("shard is full");
    if ((size_ + 1) * 4 > capacity_ * 3) Rehash(capacity_ * 2);
    uint32_t row = static_cast<uint32_t>(size_);
    if (size_ >= row_capacity_) GrowRows();
    std::memset(Row(row), 0, row_bytes_);
    Header(row)->id = id;
    size_t i = hash & mask_;
    while (slots_[i] != kFree) i = (i + 1) & mask_;
    slots_[i] = Encode(hash, row);
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

  mutable std::shared_mutex mu;
  uint64_t draw_counter = 0;                     // probability filter: draws made so far
  std::vector<uint8_t> bloom;                    // counting Bloom filter counters (saturating)
  std::unordered_map<int64_t, uint32_t> counts;  // counter filter: sightings of unadmitted ids
  std::vector<int64_t> tombstones;               // ids removed since the last delta

  static uint64_t HashOf(int64_t id) { return HashId(id); }

 private:
  // A slot is 4 bytes: 0 when free, else row + 1 in the bits of the slot index (the low
  // log2(capacity) bits) and the rest of the id's 32-bit hash above them as a tag, so most slots
  // of other ids are passed over without reading their row. Rows never exceed 3/4 of the
  // capacity, so row + 1 fits below the tag.
  static constexpr uint32_t kFree = 0;
  uint32_t Encode(uint32_t hash, uint32_t row) const {
    return (hash & ~static_cast<uint32_t>(mask_)) | (row + 1);
  }
  bool TagMatches(uint32_t slot, uint32_t hash) const {
    return ((slot ^ hash) & ~static_cast<uint32_t>(mask_)) == 0;
  }
  uint32_t RowOf(uint32_t slot) const { return (slot & static_cast<uint32_t>(mask_)) - 1; }

  size_t SlotOf(int64_t id, uint32_t hash) const {
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const uint32_t slot = slots_[i];
      if (slot != kFree && TagMatches(slot, hash) && Header(RowOf(slot))->id == id) return i;
    }
  }

  size_t ChunkBytes(size_t rows) const {
    return rows == chunk_rows_ ? std::max(LargeBlock::kHugePage, rows * row_bytes_) : rows * row_bytes_;
  }

  // Makes room for one more row: a new chunk if the last one is full, else the last chunk
  // grows (doubling from 64 rows up to an eighth of a chunk, then by eighths), moving its rows.
  void GrowRows() {
    const size_t step = std::max<size_t>(1, chunk_rows_ / 8);
    size_t last_rows = chunks_.empty() ? chunk_rows_ : row_capacity_ - (chunks_.size() - 1) * chunk_rows_;
    if (last_rows == chunk_rows_) {
      size_t rows = std::min<size_t>(chunk_rows_, chunks_.empty() ? 64 : step);
      chunks_.emplace_back(ChunkBytes(rows));
      row_capacity_ += rows;
      return;
    }
    size_t rows = std::min<size_t>(chunk_rows_, last_rows < step ? std::max<size_t>(64, last_rows * 2)
                                                                  : last_rows + step);
    LargeBlock block(ChunkBytes(rows));
    const size_t used = size_ - (chunks_.size() - 1) * chunk_rows_;
    std::memcpy(block.data(), chunks_.back().data(), used * row_bytes_);
    chunks_.back() = std::move(block);
    row_capacity_ += rows - last_rows;
  }

  // Backward-shift deletion: later entries of the probe run move up so no tombstone is needed.
  void EraseSlot(size_t hole) {
    for (size_t j = (hole + 1) & mask_; slots_[j] != kFree; j = (j + 1) & mask_) {
      size_t home = HashOf(Header(RowOf(slots_[j]))->id) & mask_;
      if (((j - home) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = kFree;
  }

  // Rebuilds the slots for `capacity` (a power of two) from the rows, in row order.
  void Rehash(size_t capacity) {
    if (capacity > (size_t{1} << 32)) throw std::length_error("shard is full");
    LargeBlock block(capacity * sizeof(uint32_t));
    uint32_t* slots = reinterpret_cast<uint32_t*>(block.data());
    std::memset(slots, 0, capacity * sizeof(uint32_t));
    slots_block_ = std::move(block);
    slots_ = slots;
    mask_ = capacity - 1;
    capacity_ = capacity;
    for (size_t r = 0; r < size_; ++r) {
      uint32_t hash = static_cast<uint32_t>(HashOf(Header(static_cast<uint32_t>(r))->id));
      size_t i = hash & mask_;
      while (slots_[i] != kFree) i = (i + 1) & mask_;
      slots_[i] = Encode(hash, static_cast<uint32_t>(r));
    }
  }

  size_t row_bytes_;
  uint32_t chunk_rows_;
  uint64_t chunk_magic_;  // ceil(2**64 / chunk_rows_)
  size_t row_capacity_ = 0;  // rows the chunks can hold
  size_t size_ = 0;
  size_t mask_ = 0;
  size_t capacity_ = 0;
  uint32_t* slots_ = nullptr;  // capacity_ slots inside slots_block_
  LargeBlock slots_block_;
  std::vector<LargeBlock> chunks_;
};

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_SHARD_H_
