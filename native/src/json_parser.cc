// Hand-written parser of flat JSON sample messages: one thread's share of a batch (see
// prefixrec/json_samples.h and internal/json_parser.h).
//
// Every scanning loop stops at a NUL sentinel after the last byte of a message (NUL is never
// valid outside a string, and raw inside a string it is a control character); every read is
// either sequential and conditional on the bytes before it being non-NUL, or bounded by the
// message length (field names, 8-digit integer loads). So one NUL after the message is all the
// parser needs: Python bytes have it; other messages are copied into a zero-padded buffer.
// Values are appended straight into the column buffers as fields arrive; a rejected message is
// rolled back by truncating each column to the end of the last accepted row (derived from the
// offsets, so nothing is recorded per field).
//
// Verdicts follow compression.decode_json_samples: a message is "not JSON" (syntax), "not an
// object", has unknown fields, or a value of the wrong type (these come first, in that order,
// as with pyarrow + its json.loads diagnosis); otherwise its row is checked in schema order as
// compression.split_bad_rows does (null / missing value, null inside a list, dense length,
// non-finite dense value, null label, label out of [0, 1]) and the first problem is its reason.
//
// Carried columns (int64, float64, string, timestamp) take a value of their type or null, and
// have no row checks: a null or missing one is a null row (a validity bit, written when the row
// is accepted, so a rejected row never touches the bitmap). Their values are read as pyarrow's
// JSON reader reads them for the schema's Arrow type: float64 correctly rounded from the text
// (overflow to +-infinity, NaN and Infinity accepted), timestamps from a JSON string with the
// exact grammar of Arrow's ParseTimestampISO8601 for microseconds (internal/iso8601.h).
#include "internal/json_parser.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_set>
#include <vector>

#include "internal/iso8601.h"
#include "internal/json_bytes.h"
#include "internal/json_lexer.h"
#include "internal/json_number.h"
#include "internal/py_repr.h"

namespace prefixrec::json::internal {
namespace {

constexpr size_t kPadding = 64;                    // zero bytes after each message copy
constexpr size_t kChunkBytes = size_t{1} << 30;    // input bytes per chunk: int32 offsets fit
constexpr size_t kMaxTokenInReason = 40;

std::string Quoted(const std::string& name) { return "'" + name + "'"; }  // schema names

std::string Describe(const ColumnSpec& c) {
  switch (c.kind) {
    case ColumnKind::kDense:
      return "a list of " + std::to_string(c.dim) + " floats (kind dense, dim " +
             std::to_string(c.dim) + ")";
    case ColumnKind::kLabel:
      return "a number in [0, 1] (label)";
    case ColumnKind::kId:
      return c.type == ValueType::kInt64 ? "an integer (kind id, dtype int64)"
                                         : "a string (kind id, dtype string)";
    case ColumnKind::kIds:
      return c.type == ValueType::kInt64 ? "a list of integers (kind ids, dtype int64)"
                                         : "a list of strings (kind ids, dtype string)";
    case ColumnKind::kCarried:
      switch (c.type) {
        case ValueType::kInt64: return "an integer or null (carried, dtype int64)";
        case ValueType::kFloat64: return "a number or null (carried, dtype float64)";
        case ValueType::kString: return "a string or null (carried, dtype string)";
        case ValueType::kTimestamp:
          return "an ISO-8601 timestamp string or null (carried, dtype timestamp)";
        case ValueType::kFloat32: break;
      }
      break;
  }
  return "?";
}

class Parser : private Lexer {
 public:
  Parser(const std::vector<ColumnSpec>& columns, size_t max_message_bytes)
      : columns_(columns), max_message_bytes_(max_message_bytes), state_(columns.size()) {
    for (size_t c = 0; c < columns.size(); ++c) {
      if (columns[c].kind == ColumnKind::kCarried) carried_.push_back(c);
    }
  }

  void Run(const MessageRef* messages, size_t begin, size_t end, DecodeOutput* out) {
    size_t chunk_bytes = 0;
    NewChunk(out);
    for (size_t i = begin; i < end; ++i) {
      const MessageRef& m = messages[i];
      if (!m.present) {
        Reject(out, i, "empty message; expected one JSON object");
        continue;
      }
      if (m.size > max_message_bytes_) {
        Reject(out, i, "oversized: " + std::to_string(m.size) + " bytes, the limit is " +
                           std::to_string(max_message_bytes_) + " (max_message_bytes)");
        continue;
      }
      if (IsBlank(m)) {
        Reject(out, i, "empty message; expected one JSON object");
        continue;
      }
      if (chunk_bytes + m.size > kChunkBytes) {
        NewChunk(out);
        chunk_bytes = 0;
      }
      chunk_bytes += m.size;
      const uint8_t* p = reinterpret_cast<const uint8_t*>(m.data);
      if (!m.terminated || p[m.size] != 0) {
        pad_.reserve(m.size + kPadding);
        std::memcpy(pad_.data(), m.data, m.size);
        std::memset(pad_.data() + m.size, 0, kPadding);
        p = pad_.data();
      }
      if (ParseMessage(p, p + m.size)) {
        if (!carried_.empty()) FinishCarried();
        ++rows_;
        chunk_->messages.push_back(static_cast<int64_t>(i));
        if (rows_ == kSampleRows) ReserveLike(end - i - 1, RemainingBytes(messages, i + 1, end));
      } else {
        Rollback();
        Reject(out, i, std::move(reason_));
      }
    }
  }

 private:
  enum Flag : uint8_t { kSeen = 1, kNull = 2, kNullItem = 4, kNonFinite = 8 };
  struct State {
    uint8_t flags = 0;
    uint32_t count = 0;  // dense: items in the list, nulls included
  };
  enum class FailKind : uint8_t { kType, kNotInteger, kOutOfRange, kNotTimestamp };

  // After the first kSampleRows rows of a chunk, every buffer is reserved for `more` rows
  // like them (+1/8), so that growing a buffer rarely copies it.
  static constexpr size_t kSampleRows = 64;
  // No buffer holds more elements than the input has bytes, so that bounds every reservation.
  template <typename T>
  static void ReserveFor(PodBuffer<T>* b, size_t more, size_t bytes) {
    const size_t per_row = (b->size() + kSampleRows - 1) / kSampleRows;
    size_t extra = per_row * more + per_row * more / 8;
    if (extra > bytes) extra = bytes;
    b->reserve(b->size() + extra);
  }
  void ReserveLike(size_t more, size_t bytes) {
    if (bytes > kChunkBytes) bytes = kChunkBytes;
    for (ColumnData& d : chunk_->columns) {
      ReserveFor(&d.ints, more, bytes);
      ReserveFor(&d.floats, more, bytes);
      ReserveFor(&d.doubles, more, bytes);
      ReserveFor(&d.validity, more, bytes);
      ReserveFor(&d.offsets, more, bytes);
      ReserveFor(&d.str_offsets, more, bytes);
      ReserveFor(&d.str_data, more, bytes);
    }
    ReserveFor(&chunk_->messages, more, bytes);
  }
  static size_t RemainingBytes(const MessageRef* messages, size_t begin, size_t end) {
    size_t bytes = 0;
    for (size_t i = begin; i < end; ++i) bytes += messages[i].size;
    return bytes;
  }

  static bool IsBlank(const MessageRef& m) {
    // bytes.strip() of the Python path: ASCII whitespace, \v and \f included.
    for (size_t i = 0; i < m.size; ++i) {
      const char c = m.data[i];
      if (!(c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f')) return false;
    }
    return true;
  }

  void NewChunk(DecodeOutput* out) {
    out->chunks.emplace_back();
    chunk_ = &out->chunks.back();
    chunk_->columns.resize(columns_.size());
    rows_ = 0;
    for (size_t c = 0; c < columns_.size(); ++c) {
      ColumnData& d = chunk_->columns[c];
      const ColumnSpec& s = columns_[c];
      if (s.kind == ColumnKind::kIds || s.kind == ColumnKind::kDense) d.offsets.push_back(0);
      if (s.type == ValueType::kString) d.str_offsets.push_back(0);
    }
  }

  static void Reject(DecodeOutput* out, size_t index, std::string reason) {
    out->rejected.push_back(Rejection{static_cast<int64_t>(index), std::move(reason)});
  }

  // Keeps the first `count` strings of a string column (offsets and bytes).
  static void TruncateStrings(ColumnData& d, size_t count) {
    d.str_offsets.truncate(count + 1);
    d.str_data.truncate(static_cast<size_t>(d.str_offsets[count]));
  }

  // Truncates every column back to the end of the last accepted row.
  void Rollback() {
    const size_t n = rows_;
    for (size_t c = 0; c < columns_.size(); ++c) {
      ColumnData& d = chunk_->columns[c];
      const ColumnSpec& s = columns_[c];
      switch (s.kind) {
        case ColumnKind::kId:
          if (s.type == ValueType::kInt64) {
            d.ints.truncate(n);
          } else {
            TruncateStrings(d, n);
          }
          break;
        case ColumnKind::kIds: {
          d.offsets.truncate(n + 1);
          const auto items = static_cast<size_t>(d.offsets[n]);
          if (s.type == ValueType::kInt64) {
            d.ints.truncate(items);
          } else {
            TruncateStrings(d, items);
          }
          break;
        }
        case ColumnKind::kDense:
          d.offsets.truncate(n + 1);
          d.floats.truncate(static_cast<size_t>(d.offsets[n]));
          break;
        case ColumnKind::kLabel:
          d.floats.truncate(n);
          break;
        case ColumnKind::kCarried:  // the validity bits are only written for accepted rows
          if (s.type == ValueType::kString) {
            TruncateStrings(d, n);
          } else if (s.type == ValueType::kFloat64) {
            d.doubles.truncate(n);
          } else {
            d.ints.truncate(n);
          }
          break;
      }
    }
  }

  // An accepted row: the validity bit of each carried column, and a placeholder value (0, an
  // empty string) for a null or missing one. A given value was appended as it was parsed.
  void FinishCarried() {
    const size_t row = rows_;
    for (const size_t c : carried_) {
      ColumnData& d = chunk_->columns[c];
      const uint8_t flags = state_[c].flags;
      if (row % 8 == 0) d.validity.push_back(0);
      if ((flags & kSeen) && !(flags & kNull)) {
        d.validity[row / 8] = static_cast<uint8_t>(d.validity[row / 8] | (1u << (row % 8)));
        continue;
      }
      ++d.nulls;
      switch (columns_[c].type) {
        case ValueType::kString:
          d.str_offsets.push_back(d.str_offsets.back());
          break;
        case ValueType::kFloat64:
          d.doubles.push_back(0.0);
          break;
        default:
          d.ints.push_back(0);
      }
    }
  }

  // --- errors -------------------------------------------------------------------------------

  // The reason of a syntax error; a field is named when the error lies inside its value.
  bool SyntaxReason() {
    reason_ = NotJsonReason(syntax_what_, static_cast<size_t>(syntax_at_ - begin_),
                            SyntaxAtEnd(), syntax_field_);
    return false;
  }

  // Skips one JSON value of any type starting at p (whitespace already skipped) and returns
  // the position after it, or nullptr on a syntax error. Iterative: nesting costs one byte of
  // stack_ per level, never native stack.
  const uint8_t* SkipValue(const uint8_t* p) {
    stack_.clear();
    for (;;) {
      // A value at p.
      p = SkipWs(p);
      switch (*p) {
        case '{':
          p = SkipWs(p + 1);
          if (*p == '}') {
            ++p;
            break;
          }
          stack_.push_back('}');
          p = SkipKey(p);
          if (p == nullptr) return nullptr;
          continue;
        case '[':
          p = SkipWs(p + 1);
          if (*p == ']') {
            ++p;
            break;
          }
          stack_.push_back(']');
          continue;
        default:
          p = ScanScalar(p, &scratch_);
          if (p == nullptr) return nullptr;
      }
      // After a value: close finished containers, or move to the next element.
      for (;;) {
        if (stack_.size() == 0) return p;
        p = SkipWs(p);
        const uint8_t close = stack_.back();
        if (*p == close) {
          ++p;
          stack_.truncate(stack_.size() - 1);
          continue;
        }
        if (*p != ',') {
          return Syntax(p, close == '}' ? "expected ',' or '}' in an object"
                                        : "expected ',' or ']' in a list");
        }
        p = SkipWs(p + 1);
        if (close == '}') {
          p = SkipKey(p);
          if (p == nullptr) return nullptr;
        }
        break;
      }
    }
  }

  // A key and its colon; returns the position of the value.
  const uint8_t* SkipKey(const uint8_t* p) {
    if (*p != '"') return Syntax(p, "expected a field name in double quotes");
    scratch_.clear();
    p = ScanString(p + 1, &scratch_);
    if (p == nullptr) return nullptr;
    p = SkipWs(p);
    if (*p != ':') return Syntax(p, "expected ':' after a field name");
    return SkipWs(p + 1);
  }

  // --- typed values -------------------------------------------------------------------------
  // Each returns the position after the value, or nullptr with fail_/fail_at_ set when the
  // value is not of the column's type; the caller then re-scans it with SkipValue to tell a
  // syntax error from a type error. They accept only valid JSON.

  const uint8_t* Fail(const uint8_t* at, FailKind kind) {
    fail_ = kind;
    fail_at_ = at;
    return nullptr;
  }

  static bool IsNull(const uint8_t* p) {
    return p[0] == 'n' && p[1] == 'u' && p[2] == 'l' && p[3] == 'l';
  }

  const uint8_t* ParseInt(const uint8_t* p, int64_t* out) {
    const uint8_t* start = p;
    const bool neg = *p == '-';
    p += neg;
    uint64_t v;
    if (*p == '0') {
      v = 0;
      ++p;
    } else if (*p >= '1' && *p <= '9') {
      int digits = 0;
      v = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      if (end_ - p >= 8) {
        digits = EightDigits(p, &v);
        p += digits;
        if (digits == 8 && end_ - p >= 8) {
          uint64_t more;
          const int n = EightDigits(p, &more);
          v = v * kPow10[n] + more;
          p += n;
          digits += n;
        }
      }
#endif
      while (IsDigit(*p)) {
        if (digits == 19) return Fail(start, FailKind::kOutOfRange);
        v = v * 10 + static_cast<uint64_t>(*p++ - '0');
        ++digits;
      }
    } else {
      return Fail(start, FailKind::kType);
    }
    if (*p == '.' || *p == 'e' || *p == 'E') return Fail(start, FailKind::kNotInteger);
    if (neg) {
      if (v > (uint64_t{1} << 63)) return Fail(start, FailKind::kOutOfRange);
      *out = static_cast<int64_t>(0 - v);
    } else {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Fail(start, FailKind::kOutOfRange);
      }
      *out = static_cast<int64_t>(v);
    }
    return p;
  }

  const uint8_t* ParseFloat(const uint8_t* p, float* out) {
    const uint8_t c = *p;
    if (!(IsDigit(c) || c == '-' || c == 'N' || c == 'I')) return Fail(p, FailKind::kType);
    Number n;
    const uint8_t* q = ScanNumber(p, &n);
    if (q == nullptr) return Fail(p, FailKind::kType);  // a syntax error: SkipValue reports it
    *out = ToFloat(p, q, n);
    return q;
  }

  const uint8_t* ParseDouble(const uint8_t* p, double* out) {
    const uint8_t c = *p;
    if (!(IsDigit(c) || c == '-' || c == 'N' || c == 'I')) return Fail(p, FailKind::kType);
    Number n;
    const uint8_t* q = ScanNumber(p, &n);
    if (q == nullptr) return Fail(p, FailKind::kType);  // a syntax error: SkipValue reports it
    *out = ToDouble(p, q, n);
    return q;
  }

  // A JSON string holding an ISO-8601 timestamp: microseconds since the epoch, UTC.
  const uint8_t* ParseTimestamp(const uint8_t* p, int64_t* out) {
    if (*p != '"') return Fail(p, FailKind::kType);
    scratch_.clear();
    const uint8_t* q = ScanString(p + 1, &scratch_);
    if (q == nullptr) return nullptr;  // syntax error, recorded
    if (!ParseIso8601Micros(scratch_.data(), scratch_.size(), out)) {
      return Fail(p, FailKind::kNotTimestamp);
    }
    return q;
  }

  const uint8_t* ParseCarried(const ColumnSpec& s, ColumnData& d, const uint8_t* p) {
    switch (s.type) {
      case ValueType::kString:
        return ParseStringValue(p, &d);
      case ValueType::kFloat64: {
        double v;
        p = ParseDouble(p, &v);
        if (p != nullptr) d.doubles.push_back(v);
        return p;
      }
      case ValueType::kTimestamp: {
        int64_t v;
        p = ParseTimestamp(p, &v);
        if (p != nullptr) d.ints.push_back(v);
        return p;
      }
      default: {
        int64_t v;
        p = ParseInt(p, &v);
        if (p != nullptr) d.ints.push_back(v);
        return p;
      }
    }
  }

  const uint8_t* ParseStringValue(const uint8_t* p, ColumnData* d) {
    if (*p != '"') return Fail(p, FailKind::kType);
    p = ScanString(p + 1, &d->str_data);
    if (p == nullptr) return nullptr;  // syntax error, recorded
    d->str_offsets.push_back(static_cast<int32_t>(d->str_data.size()));
    return p;
  }

  const uint8_t* ParseColumn(size_t c, const uint8_t* p) {
    const ColumnSpec& s = columns_[c];
    ColumnData& d = chunk_->columns[c];
    State& st = state_[c];
    if (*p == 'n') {
      if (!IsNull(p)) return Fail(p, FailKind::kType);
      st.flags |= kNull;
      return p + 4;
    }
    switch (s.kind) {
      case ColumnKind::kId:
        if (s.type == ValueType::kInt64) {
          int64_t v;
          p = ParseInt(p, &v);
          if (p != nullptr) d.ints.push_back(v);
          return p;
        }
        return ParseStringValue(p, &d);
      case ColumnKind::kLabel: {
        float v;
        p = ParseFloat(p, &v);
        if (p != nullptr) d.floats.push_back(v);
        return p;
      }
      case ColumnKind::kCarried:
        return ParseCarried(s, d, p);
      case ColumnKind::kIds:
      case ColumnKind::kDense:
        break;
    }
    if (*p != '[') return Fail(p, FailKind::kType);
    p = SkipWs(p + 1);
    uint32_t count = 0;
    if (*p != ']') {
      for (;;) {
        ++count;
        if (*p == 'n') {
          if (!IsNull(p)) return Fail(p, FailKind::kType);
          st.flags |= kNullItem;
          p += 4;
        } else if (s.kind == ColumnKind::kDense) {
          float v;
          p = ParseFloat(p, &v);
          if (p == nullptr) return nullptr;
          if (!std::isfinite(v)) st.flags |= kNonFinite;
          d.floats.push_back(v);
        } else if (s.type == ValueType::kInt64) {
          int64_t v;
          p = ParseInt(p, &v);
          if (p == nullptr) return nullptr;
          d.ints.push_back(v);
        } else {
          p = ParseStringValue(p, &d);
          if (p == nullptr) return nullptr;
        }
        p = SkipWs(p);
        if (*p == ',') {
          p = SkipWs(p + 1);
          continue;
        }
        if (*p == ']') break;
        return Fail(p, FailKind::kType);  // SkipValue finds the syntax error
      }
    }
    st.count = count;
    if (s.kind == ColumnKind::kDense) {
      d.offsets.push_back(static_cast<int32_t>(d.floats.size()));
    } else if (s.type == ValueType::kInt64) {
      d.offsets.push_back(static_cast<int32_t>(d.ints.size()));
    } else {
      d.offsets.push_back(static_cast<int32_t>(d.str_offsets.size() - 1));
    }
    return p + 1;
  }

  std::string Found(const uint8_t* value) const {
    const uint8_t* at = fail_at_ != nullptr ? fail_at_ : value;
    std::string what;
    switch (*at) {
      case '"':
        what = fail_ == FailKind::kNotTimestamp ? QuotedToken(at) + ", not a timestamp"
                                                : "a string";
        break;
      case '[': what = "a list"; break;
      case '{': what = "an object"; break;
      case 't': case 'f': what = "a boolean"; break;
      case 'n': what = "null"; break;
      default: {
        const uint8_t* q = at;
        while (q < end_ && (IsDigit(*q) || *q == '-' || *q == '+' || *q == '.' || *q == 'e' ||
                            ((*q | 0x20) >= 'a' && (*q | 0x20) <= 'z'))) {
          ++q;
        }
        const size_t len = static_cast<size_t>(q - at);
        what.assign(reinterpret_cast<const char*>(at), len < kMaxTokenInReason ? len : kMaxTokenInReason);
        if (len > kMaxTokenInReason) what += "...";
        if (fail_ == FailKind::kOutOfRange) what += ", out of the int64 range";
        if (fail_ == FailKind::kNotInteger) what += ", not an integer";
      }
    }
    if (at != value) what = "a list holding " + what;
    return what;
  }

  // The raw text of the JSON string at `at` (its quotes included; valid, as it was scanned),
  // cut at kMaxTokenInReason bytes on a UTF-8 character boundary.
  std::string QuotedToken(const uint8_t* at) const {
    const uint8_t* q = at + 1;
    while (q < end_ && *q != '"') q += (*q == '\\' && q + 1 < end_) ? 2 : 1;
    size_t len = static_cast<size_t>(q - at - 1);
    bool cut = false;
    if (len > kMaxTokenInReason) {
      len = kMaxTokenInReason;
      while (len > 0 && (at[1 + len] & 0xC0) == 0x80) --len;
      cut = true;
    }
    return "\"" + std::string(reinterpret_cast<const char*>(at + 1), len) + (cut ? "...\"" : "\"");
  }

  // --- a message ----------------------------------------------------------------------------

  bool ParseMessage(const uint8_t* begin, const uint8_t* end) {
    StartInput(begin, end);
    syntax_field_.clear();
    type_error_.clear();
    if (!unknown_.empty()) {
      unknown_.clear();
      unknown_set_.clear();
    }
    for (State& st : state_) st = State();
    const size_t ncols = columns_.size();

    const uint8_t* p = begin;
    if (end - p >= 3 && p[0] == 0xEF && p[1] == 0xBB && p[2] == 0xBF) p += 3;  // a UTF-8 BOM
    p = SkipWs(p);
    if (*p != '{') return NotAnObject(p);
    p = SkipWs(p + 1);
    size_t next = 0;  // the column expected next: fields usually come in schema order
    if (*p == '}') {
      ++p;
    } else {
      for (;;) {
        if (*p != '"') {
          Syntax(p, "expected a field name in double quotes");
          return SyntaxReason();
        }
        ++p;
        size_t col = ncols;
        if (next < ncols) {
          const std::string& name = columns_[next].name;
          const size_t len = name.size();
          if (static_cast<size_t>(end - p) > len && SameBytes(p, name.data(), len) &&
              p[len] == '"') {
            col = next;
            p += len + 1;
          }
        }
        if (col == ncols) {
          key_.clear();
          p = ScanString(p, &key_);
          if (p == nullptr) return SyntaxReason();
          col = Lookup(key_);
        }
        p = SkipWs(p);
        if (*p != ':') {
          Syntax(p, "expected ':' after a field name");
          return SyntaxReason();
        }
        p = SkipWs(p + 1);
        const uint8_t* value = p;
        if (col == ncols) {
          std::string name(reinterpret_cast<const char*>(key_.data()), key_.size());
          if (unknown_set_.insert(name).second) unknown_.push_back(std::move(name));
          p = SkipValue(p);
        } else if (state_[col].flags & kSeen) {
          if (type_error_.empty()) type_error_ = "field " + Quoted(columns_[col].name) + " is given twice";
          p = SkipValue(p);
          next = col + 1;
        } else {
          state_[col].flags |= kSeen;
          fail_at_ = nullptr;
          const uint8_t* q = ParseColumn(col, p);
          if (q == nullptr && syntax_what_ == nullptr) {
            q = SkipValue(value);
            if (q != nullptr && type_error_.empty()) {
              type_error_ = "field " + Quoted(columns_[col].name) + ": expected " +
                            Describe(columns_[col]) + ", got " + Found(value);
            }
          }
          p = q;
          next = col + 1;
        }
        if (p == nullptr) {
          // the error lies inside this field's value: name the field, as the envelope
          // scanner of trainer.serve names it for the same bytes (json_envelope.cc)
          syntax_field_ = PyRepr(col == ncols ? std::string(reinterpret_cast<const char*>(
                                                                key_.data()), key_.size())
                                              : columns_[col].name);
          return SyntaxReason();
        }
        p = SkipWs(p);
        if (*p == ',') {
          p = SkipWs(p + 1);
          continue;
        }
        if (*p == '}') {
          ++p;
          break;
        }
        Syntax(p, "expected ',' or '}' after a field value");
        return SyntaxReason();
      }
    }
    p = SkipWs(p);
    if (p != end) {
      Syntax(p, "unexpected data after the JSON object");
      return SyntaxReason();
    }
    if (!unknown_.empty()) {
      reason_ = "not a valid sample: unexpected field(s) ";
      for (size_t k = 0; k < unknown_.size(); ++k) {
        if (k) reason_ += ", ";
        reason_ += PyRepr(unknown_[k]);
      }
      reason_ += "; the schema has no such column";
      return false;
    }
    if (!type_error_.empty()) {
      reason_ = "not a valid sample: " + type_error_;
      return false;
    }
    return CheckRow();
  }

  size_t Lookup(const PodBuffer<uint8_t>& key) const {
    for (size_t c = 0; c < columns_.size(); ++c) {
      const std::string& name = columns_[c].name;
      if (name.size() == key.size() && std::memcmp(name.data(), key.data(), key.size()) == 0) {
        return c;
      }
    }
    return columns_.size();
  }

  // The top-level value is not an object: a syntax error, or "expected a JSON object, got T"
  // with T the Python type json.loads gives (list, str, int, float, bool; null for null).
  bool NotAnObject(const uint8_t* p) {
    const uint8_t first = *p;
    Number n;
    bool integer = false;
    if (first == '-' || IsDigit(first) || first == 'N' || first == 'I') {
      const uint8_t* q = ScanNumber(p, &n);
      integer = q != nullptr && n.special == 0 && n.frac_len == 0 && !n.has_exp;
    }
    const uint8_t* q = p < end_ ? SkipValue(p) : Syntax(p, "expected a value");
    if (q == nullptr) return SyntaxReason();
    q = SkipWs(q);
    if (q != end_) {
      Syntax(q, "unexpected data after the JSON value");
      return SyntaxReason();
    }
    const char* type = "float";
    switch (first) {
      case '[': type = "list"; break;
      case '"': type = "str"; break;
      case 't': case 'f': type = "bool"; break;
      case 'n': type = "null"; break;
      default: type = integer ? "int" : "float";
    }
    reason_ = std::string("not a valid sample: expected a JSON object, got ") + type;
    return false;
  }

  // The checks of compression.split_bad_rows, in its order; the first problem is the reason.
  bool CheckRow() {
    for (size_t c = 0; c < columns_.size(); ++c) {
      const ColumnSpec& s = columns_[c];
      const State& st = state_[c];
      if (s.kind == ColumnKind::kCarried) continue;  // nulls allowed, no row checks
      const bool null = !(st.flags & kSeen) || (st.flags & kNull);
      if (s.kind == ColumnKind::kLabel) {
        if (null) {
          reason_ = "label " + Quoted(s.name) + ": null label; every sample needs its labels";
          return false;
        }
        const double v = chunk_->columns[c].floats.back();
        if (!(v >= 0.0 && v <= 1.0)) {
          reason_ = "label " + Quoted(s.name) + ": value out of range, labels must be in [0, 1]";
          return false;
        }
        continue;
      }
      if (null) {
        reason_ = s.is_key ? "key column " + Quoted(s.name) + ": null value; every row needs a key"
                           : "column " + Quoted(s.name) +
                                 ": null value; fill missing values (e.g. id 0, an empty list) "
                                 "before compressing";
        return false;
      }
      if (st.flags & kNullItem) {
        reason_ = "column " + Quoted(s.name) +
                  ": null inside the list; lists may be empty but cannot hold nulls";
        return false;
      }
      if (s.kind == ColumnKind::kDense) {
        if (st.count != static_cast<uint32_t>(s.dim)) {
          reason_ = "column " + Quoted(s.name) +
                    ": dense value has the wrong number of floats, expected dim " +
                    std::to_string(s.dim);
          return false;
        }
        if (st.flags & kNonFinite) {
          reason_ = "column " + Quoted(s.name) + ": NaN or infinite value in a dense feature";
          return false;
        }
      }
    }
    return true;
  }

  const std::vector<ColumnSpec>& columns_;
  const size_t max_message_bytes_;
  std::vector<State> state_;
  std::vector<size_t> carried_;  // the carried columns' indices (their rows are finished apart)
  DecodedChunk* chunk_ = nullptr;
  size_t rows_ = 0;

  PodBuffer<uint8_t> pad_;
  PodBuffer<uint8_t> scratch_;
  PodBuffer<uint8_t> key_;
  PodBuffer<uint8_t> stack_;
  std::string syntax_field_;  // the field whose value holds the syntax error (a repr), or empty
  FailKind fail_ = FailKind::kType;
  const uint8_t* fail_at_ = nullptr;
  std::string type_error_;
  std::vector<std::string> unknown_;
  std::unordered_set<std::string> unknown_set_;
  std::string reason_;
};

}  // namespace

void DecodeRange(const std::vector<ColumnSpec>& columns, size_t max_message_bytes,
                 const MessageRef* messages, size_t begin, size_t end, DecodeOutput* out) {
  Parser(columns, max_message_bytes).Run(messages, begin, end, out);
}

}  // namespace prefixrec::json::internal
