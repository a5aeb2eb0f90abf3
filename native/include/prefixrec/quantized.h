// Quantized exports of embedding tables: row formats, their files, and the read-only table a
// serving process keeps them in.
//
// A table exported as float16, int8 or int4 keeps every row in that format on disk and in the
// serving process; a lookup dequantizes only the rows it reads. Training state stays float32:
// these files are made from the store's own snapshots and deltas (QuantizeSnapshotFile,
// QuantizeDeltaFile).
//
// Row formats, for a row x of `dim` finite floats (bounds hold for every element):
//   float16  2 * dim bytes: IEEE half, round to nearest even. |x - x'| <= 2^-11 * |x| + 2^-25;
//            a value beyond +-65504 (half's largest) is refused.
//   int8     8 + dim bytes: float32 scale, float32 bias, then q[j] in 0..255 with
//            x'[j] = bias + scale * q[j]; bias = min(x), scale = (max(x) - min(x)) / 255.
//   int4     8 + ceil(dim / 2) bytes: the same with q[j] in 0..15 (scale over 15), two values a
//            byte, element 2k in the low nibble of byte k.
//   int8 and int4: |x - x'| <= scale / 2 + 2^-20 * max|x| (float32 rounding of the
//   arithmetic); a row of equal values (zeros included) is exact. NaN and infinities are
//   refused (StoreError kInvalidArgument naming the id and column).
//
// Files (little endian; the trailer and the write-then-rename of the store's files,
// internal/file_io.h):
//   snapshot  "PRXQSNP1", u32 version (1), u32 format, u32 dim, u32 row bytes, i64 global step,
//             u64 delta sequence, u64 rows, u64 id bytes, the ids (below), the rows in id order.
//   delta     "PRXQDLT1", u32 version (1), u32 format, u32 dim, u32 row bytes, u64 sequence,
//             i64 global step, u8 rebase (0/1), u64 rebase sequence, u64 tombstones,
//             u64 id bytes, their ids, u64 rows, u64 id bytes, their ids, the rows in id order.
//   A delta holds its net effect: the rows it writes and the ids it removes, disjoint.
//   Ids are strictly ascending and stored compactly: each id as u = id ^ 2^63 (order kept in
//   unsigned), the first u as a LEB128 varint, every later one as the varint of its difference
//   from the previous (>= 1). A reader refuses anything else as corrupt, naming the file and the
//   byte offset.
#ifndef PREFIXREC_QUANTIZED_H_
#define PREFIXREC_QUANTIZED_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

namespace prefixrec {

enum class QuantFormat : uint32_t { kFloat16 = 1, kInt8 = 2, kInt4 = 3 };

// The format of `code` (1..3); StoreError kInvalidArgument for any other.
QuantFormat QuantFormatOf(uint32_t code);
const char* QuantFormatName(QuantFormat format);
size_t QuantRowBytes(QuantFormat format, size_t dim);

// `n` rows of `dim` floats into n * QuantRowBytes bytes; `ids` (may be null) name a refused row.
void QuantizeRows(QuantFormat format, const float* rows, size_t n, size_t dim, const int64_t* ids,
                  uint8_t* out);
void DequantizeRow(QuantFormat format, const uint8_t* row, size_t dim, float* out);

// The contents of a quantized file (ids ascending, rows in their order).
struct QuantizedContents {
  QuantFormat format = QuantFormat::kInt8;
  uint32_t dim = 0;
  uint64_t sequence = 0;       // a delta's; a snapshot's delta sequence
  int64_t global_step = 0;
  bool rebase = false;         // a delta that rebases (applying it sets the sequence to
  uint64_t rebase_sequence = 0;  // rebase_sequence)
  std::vector<int64_t> ids;
  std::vector<uint8_t> rows;   // ids.size() x QuantRowBytes(format, dim)
  std::vector<int64_t> tombstones;
};

// Writers (atomic: temporary file, fsync, rename; crash points `quantized.snapshot.*` and
// `quantized.delta.*`). Return the bytes written. `ids` (and `tombstones`) must be strictly
// ascending and disjoint.
uint64_t WriteQuantizedSnapshot(const std::string& path, const QuantizedContents& contents);
uint64_t WriteQuantizedDelta(const std::string& path, const QuantizedContents& contents);
// Readers: every field checked, the checksum verified.
QuantizedContents ReadQuantizedSnapshot(const std::string& path);
QuantizedContents ReadQuantizedDelta(const std::string& path);

// The store snapshot in `snapshot_dir` (store.snapshot) written as a quantized snapshot at
// `path`; the store delta at `delta_path` as a quantized delta (its net effect) at `path`.
uint64_t QuantizeSnapshotFile(const std::string& snapshot_dir, const std::string& path,
                              QuantFormat format);
uint64_t QuantizeDeltaFile(const std::string& delta_path, const std::string& path,
                           QuantFormat format);

// A read-only id -> quantized row table, loaded from a quantized snapshot and following its
// quantized deltas. Lookups (shared lock) dequantize the rows they read; an id without a row
// reads zeros. Thread-safe: a delta is read and checked before the table is locked to apply it.
class QuantizedTable {
 public:
  static std::unique_ptr<QuantizedTable> Load(const std::string& path);

  QuantFormat format() const { return format_; }
  uint32_t dim() const { return dim_; }
  size_t size() const;
  uint64_t delta_sequence() const;
  int64_t global_step() const;
  uint64_t lookups() const { return lookups_.load(); }
  // Heap bytes held: rows with their ids, and the hash slots.
  uint64_t bytes() const;

  // Rows of `ids` (n x dim floats) into `out`.
  void Lookup(const int64_t* ids, size_t n, float* out) const;
  // Whether each of `ids` has a row (1) or reads zeros (0), into `out[n]` (a cold table's
  // routing at serving, as EmbeddingStore::Contains). Counts no lookup.
  void Contains(const int64_t* ids, size_t n, uint8_t* out) const;

  // A quantized delta of this table's format and dim, of sequence delta_sequence + 1 + ahead
  // (kOutOfOrder otherwise; kIncompatible for another format or dim), as read.
  QuantizedContents ReadDelta(const std::string& path, uint64_t ahead) const;
  // Applies it (sequence delta_sequence + 1); returns the sequence the table takes.
  uint64_t ApplyDelta(const std::string& path);

  struct RebaseStats {
    uint64_t rows = 0, tombstones = 0, unchanged = 0, bytes = 0;
  };
  // A rebase delta at `path` turning this table into the quantized snapshot at
  // `snapshot_path` (same format and dim): its rows whose bytes differ or that this table
  // lacks, tombstones for the ids it lacks; applying it sets the sequence and global step to
  // the snapshot's. Reads the snapshot whole (a quantized table's worth of memory).
  RebaseStats WriteRebaseDelta(const std::string& snapshot_path, const std::string& path) const;

 private:
  QuantizedTable(QuantFormat format, uint32_t dim) : format_(format), dim_(dim) {}
  size_t Count() const { return record_bytes_ ? records_.size() / record_bytes_ : 0; }
  int64_t IdAt(uint32_t r) const;
  void Rehash(size_t capacity);
  uint32_t FindLocked(int64_t id) const;  // row index, or kNone
  void UpsertLocked(int64_t id, const uint8_t* row);
  void RemoveLocked(int64_t id);
  QuantizedContents CheckDelta(QuantizedContents delta, const std::string& path,
                               uint64_t expected) const;

  static constexpr uint32_t kNone = 0xffffffffu;
  const QuantFormat format_;
  const uint32_t dim_;
  size_t row_bytes_ = 0;
  size_t record_bytes_ = 0;      // 8 + row_bytes_
  mutable std::shared_mutex mu_;
  // row index -> record: the id (8 bytes) then the quantized row, so that a lookup's probe
  // and its row share a cache line or two
  std::vector<uint8_t> records_;
  std::vector<uint32_t> slots_;  // open addressing (linear probing): row index or kNone
  uint64_t sequence_ = 0;
  int64_t global_step_ = 0;
  mutable std::atomic<uint64_t> lookups_{0};
};

}  // namespace prefixrec

#endif  // PREFIXREC_QUANTIZED_H_
