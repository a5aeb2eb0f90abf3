// Decoder of raw training samples sent as JSON, one flat sample object per message.
//
// A batch of messages is decoded into Arrow-layout column buffers (int64 values; int32 offsets +
// UTF-8 bytes for strings; int32 list offsets + child values for lists; float32 for dense
// features and labels) holding the accepted samples only, in message order, plus a reason for
// every rejected message. The semantics are those of compression.decode_json_samples (pyarrow's
// JSON reader with an explicit schema + compression.split_bad_rows); the differences are listed
// in trainer/json_decode.py. Carried columns (never trained: row ids, timestamps) may be null
// or missing and then come back as nulls, with an Arrow validity bitmap. Decoding never reads
// outside a message and allocates at most a constant times the input size; it holds no Python
// state, so callers release the GIL around it.
#ifndef PREFIXREC_JSON_SAMPLES_H_
#define PREFIXREC_JSON_SAMPLES_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace prefixrec {
namespace json {

enum class ColumnKind : uint8_t { kId = 0, kIds = 1, kDense = 2, kLabel = 3, kCarried = 4 };
// kTimestamp: an ISO-8601 string in the message (as pyarrow's JSON reader parses it for a
// timestamp[us, tz=UTC] field), microseconds since the epoch (UTC) in the output.
enum class ValueType : uint8_t {
  kInt64 = 0, kString = 1, kFloat32 = 2, kFloat64 = 3, kTimestamp = 4
};

// One column of the raw sample schema, in the order of the output columns.
struct ColumnSpec {
  std::string name;
  ColumnKind kind = ColumnKind::kId;
  ValueType type = ValueType::kInt64;  // id/ids: int64 or string; dense/label: float32;
                                       // carried: int64, string, float64 or timestamp
  int32_t dim = 0;                     // dense only: the exact number of floats
  bool is_key = false;                 // a layer's key column (only changes the null reason)
};

// A growable buffer of trivially copyable values, allocated with malloc so that its memory can
// be handed over (release()) to whoever frees it with std::free (numpy, through a capsule).
template <typename T>
class PodBuffer {
 public:
  PodBuffer() = default;
  PodBuffer(const PodBuffer&) = delete;
  PodBuffer& operator=(const PodBuffer&) = delete;
  PodBuffer(PodBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  PodBuffer& operator=(PodBuffer&& other) noexcept {
    if (this != &other) {
      std::free(data_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, 0);
    }
    return *this;
  }
  ~PodBuffer() { std::free(data_); }

  size_t size() const { return size_; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T& back() { return data_[size_ - 1]; }

  void reserve(size_t n) {
    if (n > capacity_) Grow(n);
  }
  void push_back(T value) {
    if (size_ == capacity_) Grow(size_ + 1);
    data_[size_++] = value;
  }
  void truncate(size_t n) {
    if (n < size_) size_ = n;
  }
  // Sets the size after writing directly into reserved memory; n must be <= the capacity.
  void set_size(size_t n) { size_ = n; }
  void clear() { size_ = 0; }

  // Hands the memory (at least one element, so never null) to the caller, who frees it with
  // std::free; the buffer is empty afterwards. The unused capacity is given back first
  // (shrinking realloc does not copy in glibc: heap chunks are split, mmapped ones remapped).
  T* release() {
    if (data_ == nullptr) Grow(1);
    const size_t keep = size_ > 0 ? size_ : 1;
    if (keep < capacity_) {
      if (void* p = std::realloc(data_, keep * sizeof(T))) {
        data_ = static_cast<T*>(p);
        capacity_ = keep;
      }
    }
    T* out = data_;
    data_ = nullptr;
    size_ = capacity_ = 0;
    return out;
  }

 private:
  void Grow(size_t need) {
    size_t capacity = capacity_ < 8 ? 8 : capacity_ * 2;
    if (capacity < need) capacity = need;
    void* p = std::realloc(data_, capacity * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    data_ = static_cast<T*>(p);
    capacity_ = capacity;
  }

  T* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// The buffers of one column; which ones are used depends on kind and type:
//   id int64:     ints (rows)
//   id string:    str_offsets (rows + 1), str_data
//   ids int64:    offsets (rows + 1), ints (items)
//   ids string:   offsets (rows + 1), str_offsets (items + 1), str_data
//   dense:        offsets (rows + 1), floats (rows * dim)
//   label:        floats (rows)
//   carried:      validity (Arrow bitmap, LSB first, (rows + 7) / 8 bytes) and
//                 int64 / timestamp: ints (rows); float64: doubles (rows);
//                 string: str_offsets (rows + 1), str_data. A null row holds 0 / an empty string.
struct ColumnData {
  PodBuffer<int64_t> ints;
  PodBuffer<float> floats;
  PodBuffer<double> doubles;
  PodBuffer<int32_t> offsets;
  PodBuffer<int32_t> str_offsets;
  PodBuffer<uint8_t> str_data;
  PodBuffer<uint8_t> validity;
  size_t nulls = 0;  // carried: null rows in this chunk
};

// Accepted rows of a contiguous range of messages; offsets are relative to the chunk.
struct DecodedChunk {
  std::vector<ColumnData> columns;
  PodBuffer<int64_t> messages;  // index of each row's message in the batch
};

struct Rejection {
  int64_t message;
  std::string reason;
};

struct DecodeOutput {
  std::vector<DecodedChunk> chunks;  // in message order
  std::vector<Rejection> rejected;   // sorted by message index
};

// One message: `present` is false for a missing (None) value. `terminated` promises that
// data[size] is readable and is a NUL byte (true of Python bytes objects): the decoder then
// reads the message in place instead of copying it into a zero-padded buffer.
struct MessageRef {
  const char* data = nullptr;
  size_t size = 0;
  bool present = false;
  bool terminated = false;
};

class JsonSampleDecoder {
 public:
  // Throws StoreError(kInvalidArgument) for an invalid spec (duplicate or empty names, bad dim).
  JsonSampleDecoder(std::vector<ColumnSpec> columns, size_t max_message_bytes);

  // Decodes messages[0..count) on up to num_threads threads (each takes a contiguous range of
  // about the same number of bytes and gives its own chunks; num_threads <= 0: 2 threads for
  // 256 KiB of input or more on a multi-core machine, else 1). Thread-safe (const).
  DecodeOutput Decode(const MessageRef* messages, size_t count, int num_threads) const;

  const std::vector<ColumnSpec>& columns() const { return columns_; }
  size_t max_message_bytes() const { return max_message_bytes_; }

  // The largest max_message_bytes accepted (so int32 offsets never overflow within a chunk).
  static constexpr size_t kMaxMessageBytesLimit = size_t{1} << 30;

 private:
  std::vector<ColumnSpec> columns_;
  size_t max_message_bytes_;
};

}  // namespace json
}  // namespace prefixrec

#endif  // PREFIXREC_JSON_SAMPLES_H_
