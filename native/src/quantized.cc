// Quantized exports: row formats, their snapshot and delta files, and the read-only serving
// table (see prefixrec/quantized.h for the formats and their error bounds).
#include "prefixrec/quantized.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <utility>

#include "internal/file_io.h"
#include "internal/float_files.h"
#include "internal/hash.h"
#include "prefixrec/store_error.h"

namespace prefixrec {

using internal::Corrupt;
using internal::FileReader;
using internal::FileWriter;
using internal::HashId;
using internal::kMaxExportDim;
using internal::LittleEndian;

namespace {

constexpr char kQuantSnapshotMagic[8] = {'P', 'R', 'X', 'Q', 'S', 'N', 'P', '1'};
constexpr char kQuantDeltaMagic[8] = {'P', 'R', 'X', 'Q', 'D', 'L', 'T', '1'};
constexpr uint32_t kQuantVersion = 1;
constexpr uint64_t kMaxRows = 0xfffffffeULL;  // row indexes are 32-bit, kNone excluded
constexpr uint64_t kSignBit = uint64_t{1} << 63;

[[noreturn]] void Invalid(const std::string& message) {
  throw StoreError(ErrorCode::kInvalidArgument, message);
}

// -- float16 ------------------------------------------------------------------------------

// A finite float with |f| <= 65504 as IEEE half, rounded to nearest even.
uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t mantissa = x & 0x7fffffu;
  const int32_t exponent = static_cast<int32_t>((x >> 23) & 0xffu);
  if (exponent == 0) return sign;  // zero, or a float subnormal: far below half's smallest
  if (exponent <= 112) {           // a half subnormal: value = m * 2^-24
    const uint32_t full = mantissa | 0x800000u;
    const int shift = 126 - exponent;  // >= 14
    if (shift > 24) return sign;       // below 2^-25: rounds to zero
    uint32_t q = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);  // q == 1024 is the smallest normal, as encoded
  }
  uint32_t h = (static_cast<uint32_t>(exponent - 112) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves the exponent up
  return static_cast<uint16_t>(sign | h);
}

// A finite half as float, without branches (so a row's loop vectorizes): the half's exponent
// and mantissa bits placed as a float's are the value times 2^-112, subnormals included.
inline float HalfToFloat(uint16_t h) {
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float out;
  std::memcpy(&out, &magnitude, 4);
  out *= 0x1.0p112f;
  uint32_t bits;
  std::memcpy(&bits, &out, 4);
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  std::memcpy(&out, &bits, 4);
  return out;
}

int LevelsOf(QuantFormat format) { return format == QuantFormat::kInt8 ? 255 : 15; }

std::string IdText(const int64_t* ids, size_t i) {
  return ids == nullptr ? "row " + std::to_string(i) : "id " + std::to_string(ids[i]);
}

// -- int8 / int4 --------------------------------------------------------------------------

void QuantizeIntRow(QuantFormat format, const float* x, size_t dim, uint8_t* out) {
  const int levels = LevelsOf(format);
  float lo = x[0], hi = x[0];
  for (size_t j = 1; j < dim; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  const double range = static_cast<double>(hi) - static_cast<double>(lo);
  float scale = 0.0f;
  if (range > 0) {
    scale = static_cast<float>(range / levels);
    // every value within levels steps of the bias (the float rounding may fall short), and
    // the top of the range within float's (so a dequantized value is always finite)
    while (static_cast<double>(scale) * levels < range) scale = std::nextafter(scale, FLT_MAX);
    while (static_cast<double>(lo) + static_cast<double>(scale) * levels > FLT_MAX) {
      scale = std::nextafter(scale, 0.0f);
    }
  }
  std::memcpy(out, &scale, 4);
  std::memcpy(out + 4, &lo, 4);
  uint8_t* q = out + 8;
  if (format == QuantFormat::kInt4) std::memset(q, 0, (dim + 1) / 2);
  for (size_t j = 0; j < dim; ++j) {
    double level = 0;
    if (scale > 0) {
      level = std::nearbyint((static_cast<double>(x[j]) - static_cast<double>(lo)) /
                             static_cast<double>(scale));
      level = std::min<double>(std::max(level, 0.0), levels);
    }
    const uint8_t v = static_cast<uint8_t>(level);
    if (format == QuantFormat::kInt8) {
      q[j] = v;
    } else {
      q[j / 2] |= static_cast<uint8_t>((j & 1) ? (v << 4) : v);
    }
  }
}

// Why a stored row cannot be served (empty: it can).
std::string RowProblem(QuantFormat format, const uint8_t* row, size_t dim) {
  if (format == QuantFormat::kFloat16) {
    for (size_t j = 0; j < dim; ++j) {
      uint16_t h;
      std::memcpy(&h, row + 2 * j, 2);
      if (((h >> 10) & 0x1fu) == 0x1fu) return "value " + std::to_string(j) + " is not finite";
    }
    return "";
  }
  float scale, bias;
  std::memcpy(&scale, row, 4);
  std::memcpy(&bias, row + 4, 4);
  if (!std::isfinite(scale) || scale < 0) return "scale " + std::to_string(scale) + " is not a finite number >= 0";
  if (!std::isfinite(bias)) return "bias is not finite";
  if (std::fabs(static_cast<double>(bias) + static_cast<double>(scale) * LevelsOf(format)) > FLT_MAX) {
    return "scale and bias reach beyond float32's range";
  }
  if (format == QuantFormat::kInt4 && (dim & 1) && (row[8 + dim / 2] >> 4) != 0) {
    return "the padding nibble is not zero";
  }
  return "";
}

// -- ids ----------------------------------------------------------------------------------

void PutVarint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

std::vector<uint8_t> EncodeIds(const std::vector<int64_t>& ids, const char* what) {
  std::vector<uint8_t> out;
  out.reserve(ids.size() * 3);
  uint64_t previous = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint64_t u = static_cast<uint64_t>(ids[i]) ^ kSignBit;
    if (i > 0 && u <= previous) {
      Invalid(std::string(what) + " must be strictly ascending: " + std::to_string(ids[i]) +
              " follows " + std::to_string(ids[i - 1]));
    }
    PutVarint(out, i == 0 ? u : u - previous);
    previous = u;
  }
  return out;
}

// `count` ids from `id_bytes` bytes of `r` (exactly), checked ascending.
std::vector<int64_t> ReadIds(FileReader& r, uint64_t count, const char* what) {
  const uint64_t id_bytes = r.Get<uint64_t>();
  const uint64_t start = r.offset();
  if (id_bytes > r.remaining()) {
    Corrupt(r.path(), std::string(what) + " ids of " + std::to_string(id_bytes) + " bytes at offset " +
                          std::to_string(start - 8) + " do not fit in the " + std::to_string(r.remaining()) +
                          " bytes left");
  }
  if (count > id_bytes) {
    Corrupt(r.path(), std::to_string(count) + " " + what + " ids cannot fit in " +
                          std::to_string(id_bytes) + " bytes at offset " + std::to_string(start));
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(id_bytes));
  r.Read(bytes.data(), bytes.size());
  std::vector<int64_t> ids(static_cast<size_t>(count));
  size_t at = 0;
  uint64_t previous = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const size_t begin = at;
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (at == bytes.size()) {
        Corrupt(r.path(), std::string(what) + " id " + std::to_string(i) + " runs past its " +
                              std::to_string(id_bytes) + " bytes (offset " + std::to_string(start + begin) + ")");
      }
      const uint8_t b = bytes[at++];
      if (shift == 63 && (b & 0x7e)) {
        Corrupt(r.path(), std::string(what) + " id " + std::to_string(i) + " overflows 64 bits at offset " +
                              std::to_string(start + begin));
      }
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) break;
      if (shift == 63) {
        Corrupt(r.path(), std::string(what) + " id " + std::to_string(i) + " is longer than 10 bytes at offset " +
                              std::to_string(start + begin));
      }
    }
    uint64_t u = v;
    if (i > 0) {
      if (v == 0 || v > ~previous) {
        Corrupt(r.path(), std::string(what) + " ids are not strictly ascending at id " + std::to_string(i) +
                              " (offset " + std::to_string(start + begin) + ")");
      }
      u = previous + v;
    }
    ids[static_cast<size_t>(i)] = static_cast<int64_t>(u ^ kSignBit);
    previous = u;
  }
  if (at != bytes.size()) {
    Corrupt(r.path(), std::to_string(bytes.size() - at) + " bytes left over after the " + what +
                          " ids (offset " + std::to_string(start + at) + ")");
  }
  return ids;
}

// -- files --------------------------------------------------------------------------------

void CheckContents(const QuantizedContents& c) {
  if (c.dim < 1 || c.dim > kMaxExportDim) Invalid("dim must be in 1.." + std::to_string(kMaxExportDim));
  if (c.rows.size() != c.ids.size() * QuantRowBytes(c.format, c.dim)) {
    Invalid("rows must hold " + std::to_string(QuantRowBytes(c.format, c.dim)) + " bytes per id");
  }
  if (c.ids.size() > kMaxRows) Invalid("too many rows for one file");
}

void PutIds(FileWriter& w, const std::vector<int64_t>& ids, const char* what) {
  std::vector<uint8_t> bytes = EncodeIds(ids, what);
  w.Put<uint64_t>(ids.size());
  w.Put<uint64_t>(bytes.size());
  w.Write(bytes.data(), bytes.size());
}

struct Head {
  QuantFormat format;
  uint32_t dim;
  size_t row_bytes;
};

Head ReadHead(FileReader& r, const char (&magic)[8], const char* kind) {
  char found[8];
  r.Read(found, 8);
  if (std::memcmp(found, magic, 8) != 0) Corrupt(r.path(), std::string("not a quantized ") + kind + " (bad magic)");
  const uint32_t version = r.Get<uint32_t>();
  if (version != kQuantVersion) {
    Corrupt(r.path(), std::string("quantized ") + kind + " version " + std::to_string(version) +
                          "; this build reads version " + std::to_string(kQuantVersion));
  }
  const uint64_t at = r.offset();
  const uint32_t code = r.Get<uint32_t>();
  if (code < 1 || code > 3) Corrupt(r.path(), "unknown row format " + std::to_string(code) + " at offset " + std::to_string(at));
  Head head{static_cast<QuantFormat>(code), r.Get<uint32_t>(), 0};
  if (head.dim < 1 || head.dim > kMaxExportDim) {
    Corrupt(r.path(), "dim " + std::to_string(head.dim) + " out of range at offset " + std::to_string(at + 4));
  }
  head.row_bytes = QuantRowBytes(head.format, head.dim);
  const uint32_t row_bytes = r.Get<uint32_t>();
  if (row_bytes != head.row_bytes) {
    Corrupt(r.path(), "row size " + std::to_string(row_bytes) + " does not match " +
                          QuantFormatName(head.format) + " at dim " + std::to_string(head.dim));
  }
  return head;
}

void ReadRows(FileReader& r, const Head& head, QuantizedContents& c) {
  const uint64_t start = r.offset();
  if (c.ids.size() > r.remaining() / head.row_bytes) {
    Corrupt(r.path(), std::to_string(c.ids.size()) + " rows of " + std::to_string(head.row_bytes) +
                          " bytes at offset " + std::to_string(start) + " do not fit in the " +
                          std::to_string(r.remaining()) + " bytes left (truncated?)");
  }
  c.rows.resize(c.ids.size() * head.row_bytes);
  r.Read(c.rows.data(), c.rows.size());
  for (size_t i = 0; i < c.ids.size(); ++i) {
    std::string problem = RowProblem(head.format, c.rows.data() + i * head.row_bytes, head.dim);
    if (!problem.empty()) {
      Corrupt(r.path(), "row " + std::to_string(i) + " (id " + std::to_string(c.ids[i]) + ") at offset " +
                            std::to_string(start + i * head.row_bytes) + ": " + problem);
    }
  }
}

uint64_t ReadCount(FileReader& r, const char* what) {
  const uint64_t at = r.offset();
  const uint64_t count = r.Get<uint64_t>();
  if (count > kMaxRows) Corrupt(r.path(), std::string(what) + " count " + std::to_string(count) + " too large at offset " + std::to_string(at));
  return count;
}

}  // namespace

// -- formats ------------------------------------------------------------------------------

QuantFormat QuantFormatOf(uint32_t code) {
  if (code < 1 || code > 3) Invalid("unknown quantized format " + std::to_string(code) + " (1 float16, 2 int8, 3 int4)");
  return static_cast<QuantFormat>(code);
}

const char* QuantFormatName(QuantFormat format) {
  switch (format) {
    case QuantFormat::kFloat16: return "float16";
    case QuantFormat::kInt8: return "int8";
    case QuantFormat::kInt4: return "int4";
  }
  return "?";
}

size_t QuantRowBytes(QuantFormat format, size_t dim) {
  switch (format) {
    case QuantFormat::kFloat16: return 2 * dim;
    case QuantFormat::kInt8: return 8 + dim;
    case QuantFormat::kInt4: return 8 + (dim + 1) / 2;
  }
  return 0;
}

void QuantizeRows(QuantFormat format, const float* rows, size_t n, size_t dim, const int64_t* ids,
                  uint8_t* out) {
  const size_t row_bytes = QuantRowBytes(format, dim);
  for (size_t i = 0; i < n; ++i) {
    const float* x = rows + i * dim;
    for (size_t j = 0; j < dim; ++j) {
      if (!std::isfinite(x[j])) {
        Invalid(IdText(ids, i) + " has a non-finite value (" + std::to_string(x[j]) + ") at column " +
                std::to_string(j) + ": a quantized export refuses NaN and infinities");
      }
      if (format == QuantFormat::kFloat16 && std::fabs(x[j]) > 65504.0f) {
        Invalid(IdText(ids, i) + " has " + std::to_string(x[j]) + " at column " + std::to_string(j) +
                ", beyond float16's range (+-65504); export the table as int8 or float32");
      }
    }
    uint8_t* dst = out + i * row_bytes;
    if (format == QuantFormat::kFloat16) {
      for (size_t j = 0; j < dim; ++j) {
        const uint16_t h = FloatToHalf(x[j]);
        std::memcpy(dst + 2 * j, &h, 2);
      }
    } else {
      QuantizeIntRow(format, x, dim, dst);
    }
  }
}

void DequantizeRow(QuantFormat format, const uint8_t* row, size_t dim, float* out) {
  if (format == QuantFormat::kFloat16) {
    for (size_t j = 0; j < dim; ++j) {
      uint16_t h;
      std::memcpy(&h, row + 2 * j, 2);
      out[j] = HalfToFloat(h);
    }
    return;
  }
  float scale_f, bias_f;
  std::memcpy(&scale_f, row, 4);
  std::memcpy(&bias_f, row + 4, 4);
  const uint8_t* q = row + 8;
  // float arithmetic (vectorizes) where bias + scale * q cannot come near float's range, so
  // its rounding stays within the bound; double otherwise (rounded once, no overflow)
  const bool small = std::fabs(bias_f) + scale_f * 255.0f < 1e37f;
  const double scale = scale_f, bias = bias_f;
  if (format == QuantFormat::kInt8) {
    if (small) {
      for (size_t j = 0; j < dim; ++j) out[j] = bias_f + scale_f * static_cast<float>(q[j]);
    } else {
      for (size_t j = 0; j < dim; ++j) out[j] = static_cast<float>(bias + scale * q[j]);
    }
    return;
  }
  uint8_t levels[256];
  for (size_t done = 0; done < dim; done += 256) {  // nibbles unpacked, then one plain loop
    const size_t n = std::min<size_t>(256, dim - done);
    const uint8_t* bytes = q + done / 2;  // done is even: a byte boundary
    for (size_t k = 0; k < n / 2; ++k) {
      levels[2 * k] = bytes[k] & 0x0f;
      levels[2 * k + 1] = static_cast<uint8_t>(bytes[k] >> 4);
    }
    if (n & 1) levels[n - 1] = bytes[n / 2] & 0x0f;
    if (small) {
      for (size_t j = 0; j < n; ++j) out[done + j] = bias_f + scale_f * static_cast<float>(levels[j]);
    } else {
      for (size_t j = 0; j < n; ++j) out[done + j] = static_cast<float>(bias + scale * levels[j]);
    }
  }
}

// -- files --------------------------------------------------------------------------------

uint64_t WriteQuantizedSnapshot(const std::string& path, const QuantizedContents& c) {
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "exports need a little-endian machine");
  CheckContents(c);
  FileWriter w(path, "quantized.snapshot");
  w.Write(kQuantSnapshotMagic, 8);
  w.Put<uint32_t>(kQuantVersion);
  w.Put<uint32_t>(static_cast<uint32_t>(c.format));
  w.Put<uint32_t>(c.dim);
  w.Put<uint32_t>(static_cast<uint32_t>(QuantRowBytes(c.format, c.dim)));
  w.Put<int64_t>(c.global_step);
  w.Put<uint64_t>(c.sequence);
  PutIds(w, c.ids, "ids");
  w.Write(c.rows.data(), c.rows.size());
  return w.Commit();
}

uint64_t WriteQuantizedDelta(const std::string& path, const QuantizedContents& c) {
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "exports need a little-endian machine");
  CheckContents(c);
  {  // disjoint: an id is either written or removed
    size_t i = 0, j = 0;
    while (i < c.ids.size() && j < c.tombstones.size()) {
      if (c.ids[i] == c.tombstones[j]) Invalid("id " + std::to_string(c.ids[i]) + " is both written and removed");
      if (c.ids[i] < c.tombstones[j]) ++i; else ++j;
    }
  }
  FileWriter w(path, "quantized.delta");
  w.Write(kQuantDeltaMagic, 8);
  w.Put<uint32_t>(kQuantVersion);
  w.Put<uint32_t>(static_cast<uint32_t>(c.format));
  w.Put<uint32_t>(c.dim);
  w.Put<uint32_t>(static_cast<uint32_t>(QuantRowBytes(c.format, c.dim)));
  w.Put<uint64_t>(c.sequence);
  w.Put<int64_t>(c.global_step);
  w.Put<uint8_t>(c.rebase ? 1 : 0);
  w.Put<uint64_t>(c.rebase_sequence);
  PutIds(w, c.tombstones, "tombstones");
  PutIds(w, c.ids, "ids");
  w.Write(c.rows.data(), c.rows.size());
  return w.Commit();
}

QuantizedContents ReadQuantizedSnapshot(const std::string& path) {
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "exports need a little-endian machine");
  FileReader r(path);
  Head head = ReadHead(r, kQuantSnapshotMagic, "snapshot");
  QuantizedContents c;
  c.format = head.format;
  c.dim = head.dim;
  c.global_step = r.Get<int64_t>();
  c.sequence = r.Get<uint64_t>();
  const uint64_t rows = ReadCount(r, "row");
  c.ids = ReadIds(r, rows, "row");
  ReadRows(r, head, c);
  r.VerifyTrailer();
  return c;
}

QuantizedContents ReadQuantizedDelta(const std::string& path) {
  if (!LittleEndian()) throw StoreError(ErrorCode::kIo, "exports need a little-endian machine");
  FileReader r(path);
  Head head = ReadHead(r, kQuantDeltaMagic, "delta");
  QuantizedContents c;
  c.format = head.format;
  c.dim = head.dim;
  c.sequence = r.Get<uint64_t>();
  c.global_step = r.Get<int64_t>();
  const uint64_t at = r.offset();
  const uint8_t rebase = r.Get<uint8_t>();
  if (rebase > 1) Corrupt(path, "rebase flag " + std::to_string(rebase) + " at offset " + std::to_string(at));
  c.rebase = rebase == 1;
  c.rebase_sequence = r.Get<uint64_t>();
  const uint64_t tombstones = ReadCount(r, "tombstone");
  c.tombstones = ReadIds(r, tombstones, "tombstone");
  const uint64_t rows = ReadCount(r, "row");
  c.ids = ReadIds(r, rows, "row");
  ReadRows(r, head, c);
  r.VerifyTrailer();
  size_t i = 0, j = 0;
  while (i < c.ids.size() && j < c.tombstones.size()) {
    if (c.ids[i] == c.tombstones[j]) Corrupt(path, "id " + std::to_string(c.ids[i]) + " both written and removed");
    if (c.ids[i] < c.tombstones[j]) ++i; else ++j;
  }
  return c;
}

uint64_t QuantizeSnapshotFile(const std::string& snapshot_dir, const std::string& path, QuantFormat format) {
  QuantizedContents c;
  c.format = format;
  std::vector<int64_t> ids;
  std::vector<uint8_t> rows;
  size_t row_bytes = 0;
  internal::ReadSnapshotEmbeddings(
      snapshot_dir,
      [&](const internal::FloatSnapshotInfo& info) {
        c.dim = info.dim;
        c.global_step = info.global_step;
        c.sequence = info.delta_sequence;
        row_bytes = QuantRowBytes(format, info.dim);
      },
      [&](const int64_t* block_ids, const float* values, size_t n) {
        ids.insert(ids.end(), block_ids, block_ids + n);
        rows.resize(rows.size() + n * row_bytes);
        QuantizeRows(format, values, n, c.dim, block_ids, rows.data() + rows.size() - n * row_bytes);
      });
  // the store keeps rows in hash order: the file has them in id order
  std::vector<size_t> order(ids.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ids[a] < ids[b]; });
  c.ids.resize(ids.size());
  c.rows.resize(rows.size());
  for (size_t i = 0; i < order.size(); ++i) {
    c.ids[i] = ids[order[i]];
    if (i > 0 && c.ids[i] == c.ids[i - 1]) {
      Corrupt(snapshot_dir + "/store.snapshot", "id " + std::to_string(c.ids[i]) + " stored twice");
    }
    std::memcpy(c.rows.data() + i * row_bytes, rows.data() + order[i] * row_bytes, row_bytes);
  }
  return WriteQuantizedSnapshot(path, c);
}

uint64_t QuantizeDeltaFile(const std::string& delta_path, const std::string& path, QuantFormat format) {
  uint32_t dim = 0;
  EmbeddingStore::DeltaContents d = internal::ReadDeltaFile(delta_path, &dim);
  QuantizedContents c;
  c.format = format;
  c.dim = dim;
  c.sequence = d.sequence;
  c.global_step = d.global_step;
  c.rebase = d.rebase;
  c.rebase_sequence = d.rebase_sequence;
  c.ids = std::move(d.ids);
  c.tombstones = std::move(d.tombstones);
  c.rows.resize(c.ids.size() * QuantRowBytes(format, dim));
  QuantizeRows(format, d.embeddings.data(), c.ids.size(), dim, c.ids.data(), c.rows.data());
  return WriteQuantizedDelta(path, c);
}

// -- the serving table --------------------------------------------------------------------

std::unique_ptr<QuantizedTable> QuantizedTable::Load(const std::string& path) {
  QuantizedContents c = ReadQuantizedSnapshot(path);
  std::unique_ptr<QuantizedTable> table(new QuantizedTable(c.format, c.dim));
  const size_t row_bytes = QuantRowBytes(c.format, c.dim);
  table->row_bytes_ = row_bytes;
  table->record_bytes_ = 8 + row_bytes;
  table->sequence_ = c.sequence;
  table->global_step_ = c.global_step;
  table->records_.resize(c.ids.size() * table->record_bytes_);
  for (size_t r = 0; r < c.ids.size(); ++r) {
    uint8_t* record = table->records_.data() + r * table->record_bytes_;
    std::memcpy(record, &c.ids[r], 8);
    std::memcpy(record + 8, c.rows.data() + r * row_bytes, row_bytes);
  }
  table->Rehash(c.ids.size());
  return table;
}

size_t QuantizedTable::size() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return Count();
}

uint64_t QuantizedTable::delta_sequence() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return sequence_;
}

int64_t QuantizedTable::global_step() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return global_step_;
}

uint64_t QuantizedTable::bytes() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return records_.capacity() + slots_.capacity() * sizeof(uint32_t);
}

int64_t QuantizedTable::IdAt(uint32_t r) const {
  int64_t id;
  std::memcpy(&id, records_.data() + static_cast<size_t>(r) * record_bytes_, 8);
  return id;
}

// Slots for `rows` rows at a load of at most 3/4 (at least 16), every row placed anew.
void QuantizedTable::Rehash(size_t rows) {
  size_t capacity = 16;
  while (capacity * 3 < rows * 4 + 4) capacity *= 2;
  slots_.assign(capacity, kNone);
  const size_t mask = capacity - 1;
  const size_t count = Count();
  for (size_t r = 0; r < count; ++r) {
    size_t pos = HashId(IdAt(static_cast<uint32_t>(r))) & mask;
    while (slots_[pos] != kNone) pos = (pos + 1) & mask;
    slots_[pos] = static_cast<uint32_t>(r);
  }
}

uint32_t QuantizedTable::FindLocked(int64_t id) const {
  const size_t mask = slots_.size() - 1;
  for (size_t pos = HashId(id) & mask;; pos = (pos + 1) & mask) {
    const uint32_t r = slots_[pos];
    if (r == kNone) return kNone;
    if (IdAt(r) == id) return r;
  }
}

void QuantizedTable::UpsertLocked(int64_t id, const uint8_t* row) {
  uint32_t r = FindLocked(id);
  if (r == kNone) {
    r = static_cast<uint32_t>(Count());
    records_.resize(records_.size() + record_bytes_);
    std::memcpy(records_.data() + static_cast<size_t>(r) * record_bytes_, &id, 8);
    if ((static_cast<size_t>(r) + 1) * 4 > slots_.size() * 3) {
      Rehash(static_cast<size_t>(r) + 1);
    } else {
      const size_t mask = slots_.size() - 1;
      size_t pos = HashId(id) & mask;
      while (slots_[pos] != kNone) pos = (pos + 1) & mask;
      slots_[pos] = r;
    }
  }
  std::memcpy(records_.data() + static_cast<size_t>(r) * record_bytes_ + 8, row, row_bytes_);
}

void QuantizedTable::RemoveLocked(int64_t id) {
  const size_t mask = slots_.size() - 1;
  size_t pos = HashId(id) & mask;
  while (slots_[pos] != kNone && IdAt(slots_[pos]) != id) pos = (pos + 1) & mask;
  if (slots_[pos] == kNone) return;  // no row: a removal of an id the table lacks
  const uint32_t removed = slots_[pos];
  // backward-shift deletion: later entries of the probe run move up to the hole
  size_t hole = pos;
  for (size_t j = (pos + 1) & mask; slots_[j] != kNone; j = (j + 1) & mask) {
    const size_t home = HashId(IdAt(slots_[j])) & mask;
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!stays) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = kNone;
  // the last row moves into the removed one's place
  const uint32_t last = static_cast<uint32_t>(Count() - 1);
  if (removed != last) {
    size_t at = HashId(IdAt(last)) & mask;
    while (slots_[at] != last) at = (at + 1) & mask;
    slots_[at] = removed;
    std::memcpy(records_.data() + static_cast<size_t>(removed) * record_bytes_,
                records_.data() + static_cast<size_t>(last) * record_bytes_, record_bytes_);
  }
  records_.resize(records_.size() - record_bytes_);
}

void QuantizedTable::Lookup(const int64_t* ids, size_t n, float* out) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  // In groups: every id's slot is fetched before the first is read, then every candidate
  // record (its id, then its row) before the first is checked, so a group's cache misses
  // overlap instead of queueing.
  constexpr size_t kGroup = 16;
  const size_t mask = slots_.size() - 1;
  size_t pos[kGroup];
  uint32_t found[kGroup];
  for (size_t base = 0; base < n; base += kGroup) {
    const size_t m = std::min(kGroup, n - base);
    for (size_t k = 0; k < m; ++k) {
      pos[k] = HashId(ids[base + k]) & mask;
      __builtin_prefetch(&slots_[pos[k]]);
    }
    for (size_t k = 0; k < m; ++k) {
      found[k] = slots_[pos[k]];
      if (found[k] != kNone) __builtin_prefetch(records_.data() + static_cast<size_t>(found[k]) * record_bytes_);
    }
    for (size_t k = 0; k < m; ++k) {
      if (found[k] != kNone && IdAt(found[k]) != ids[base + k]) found[k] = FindLocked(ids[base + k]);
      float* dst = out + (base + k) * dim_;
      if (found[k] == kNone) {
        std::fill(dst, dst + dim_, 0.0f);
      } else {
        DequantizeRow(format_, records_.data() + static_cast<size_t>(found[k]) * record_bytes_ + 8, dim_, dst);
      }
    }
  }
  lookups_.fetch_add(n);
}

void QuantizedTable::Contains(const int64_t* ids, size_t n, uint8_t* out) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) out[i] = FindLocked(ids[i]) != kNone ? 1 : 0;
}

QuantizedContents QuantizedTable::CheckDelta(QuantizedContents delta, const std::string& path,
                                             uint64_t expected) const {
  if (delta.format != format_ || delta.dim != dim_) {
    throw StoreError(ErrorCode::kIncompatible,
                     "quantized delta " + path + " holds " + QuantFormatName(delta.format) + " rows of dim " +
                         std::to_string(delta.dim) + "; this table holds " + QuantFormatName(format_) +
                         " rows of dim " + std::to_string(dim_));
  }
  if (delta.sequence != expected) {
    throw StoreError(ErrorCode::kOutOfOrder,
                     "quantized delta " + path + " has sequence " + std::to_string(delta.sequence) +
                         " but this table expects " + std::to_string(expected) +
                         " (apply deltas in order, starting after the snapshot's sequence)");
  }
  return delta;
}

QuantizedContents QuantizedTable::ReadDelta(const std::string& path, uint64_t ahead) const {
  QuantizedContents delta = ReadQuantizedDelta(path);
  return CheckDelta(std::move(delta), path, delta_sequence() + 1 + ahead);
}

uint64_t QuantizedTable::ApplyDelta(const std::string& path) {
  QuantizedContents delta = ReadQuantizedDelta(path);  // checked whole before any change
  std::unique_lock<std::shared_mutex> lock(mu_);
  delta = CheckDelta(std::move(delta), path, sequence_ + 1);
  for (int64_t id : delta.tombstones) RemoveLocked(id);
  for (size_t i = 0; i < delta.ids.size(); ++i) UpsertLocked(delta.ids[i], delta.rows.data() + i * row_bytes_);
  if (delta.rebase) {
    sequence_ = delta.rebase_sequence;
    global_step_ = delta.global_step;
  } else {
    sequence_ = delta.sequence;
    global_step_ = std::max(global_step_, delta.global_step);
  }
  return sequence_;
}

QuantizedTable::RebaseStats QuantizedTable::WriteRebaseDelta(const std::string& snapshot_path,
                                                             const std::string& path) const {
  QuantizedContents snap = ReadQuantizedSnapshot(snapshot_path);
  if (snap.format != format_ || snap.dim != dim_) {
    throw StoreError(ErrorCode::kIncompatible,
                     "quantized snapshot " + snapshot_path + " holds " + QuantFormatName(snap.format) +
                         " rows of dim " + std::to_string(snap.dim) + "; this table holds " +
                         QuantFormatName(format_) + " rows of dim " + std::to_string(dim_));
  }
  RebaseStats stats;
  QuantizedContents out;
  out.format = format_;
  out.dim = dim_;
  out.rebase = true;
  out.rebase_sequence = snap.sequence;
  out.global_step = snap.global_step;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    out.sequence = sequence_ + 1;
    for (size_t i = 0; i < snap.ids.size(); ++i) {
      const uint8_t* row = snap.rows.data() + i * row_bytes_;
      const uint32_t r = FindLocked(snap.ids[i]);
      if (r != kNone && std::memcmp(records_.data() + static_cast<size_t>(r) * record_bytes_ + 8, row, row_bytes_) == 0) {
        ++stats.unchanged;
        continue;
      }
      out.ids.push_back(snap.ids[i]);
      out.rows.insert(out.rows.end(), row, row + row_bytes_);
    }
    for (uint32_t r = 0; r < Count(); ++r) {
      const int64_t id = IdAt(r);
      if (!std::binary_search(snap.ids.begin(), snap.ids.end(), id)) out.tombstones.push_back(id);
    }
  }
  std::sort(out.tombstones.begin(), out.tombstones.end());
  stats.rows = out.ids.size();
  stats.tombstones = out.tombstones.size();
  stats.bytes = WriteQuantizedDelta(path, out);
  return stats;
}

}  // namespace prefixrec
