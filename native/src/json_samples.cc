// JsonSampleDecoder (see prefixrec/json_samples.h): checks the column specs and splits a batch
// over threads; the parsing itself is internal/json_parser.h.
#include "prefixrec/json_samples.h"

#include <exception>
#include <string>
#include <thread>
#include <unordered_set>

#include "internal/json_parser.h"
#include "prefixrec/store_error.h"

namespace prefixrec {
namespace json {
namespace {

constexpr size_t kAutoThreadsBytes = size_t{1} << 18;

[[noreturn]] void Invalid(const std::string& message) {
  throw StoreError(ErrorCode::kInvalidArgument, message);
}

}  // namespace

JsonSampleDecoder::JsonSampleDecoder(std::vector<ColumnSpec> columns, size_t max_message_bytes)
    : columns_(std::move(columns)), max_message_bytes_(max_message_bytes) {
  if (columns_.empty()) Invalid("a JSON sample decoder needs at least one column");
  if (max_message_bytes_ == 0 || max_message_bytes_ > kMaxMessageBytesLimit) {
    Invalid("max_message_bytes must be in [1, 2**30], got " + std::to_string(max_message_bytes_));
  }
  std::unordered_set<std::string> names;
  for (const ColumnSpec& c : columns_) {
    if (c.name.empty()) Invalid("a column has an empty name");
    for (const char ch : c.name) {
      // Names are matched byte for byte against raw keys, so they hold no escapable byte.
      if (ch < 0x20 || ch > 0x7E || ch == '"' || ch == '\\') {
        Invalid("column name '" + c.name + "': only printable ASCII without quotes or backslashes");
      }
    }
    if (!names.insert(c.name).second) Invalid("column name '" + c.name + "' is used twice");
    const auto kind = static_cast<uint8_t>(c.kind);
    const auto type = static_cast<uint8_t>(c.type);
    if (kind > 4 || type > 4) Invalid("column '" + c.name + "': unknown kind or type");
    if (c.kind == ColumnKind::kCarried) {
      if (c.type == ValueType::kFloat32 || c.dim != 0) {
        Invalid("column '" + c.name + "': carried columns are int64, float64, string or "
                "timestamp, without a dim");
      }
      continue;
    }
    if (c.type == ValueType::kFloat64 || c.type == ValueType::kTimestamp) {
      Invalid("column '" + c.name + "': only carried columns are float64 or timestamp");
    }
    const bool floats = c.kind == ColumnKind::kDense || c.kind == ColumnKind::kLabel;
    if (floats != (c.type == ValueType::kFloat32)) {
      Invalid("column '" + c.name + "': dense and label columns are float32, ids int64 or string");
    }
    if (c.kind == ColumnKind::kDense ? c.dim < 1 : c.dim != 0) {
      Invalid("column '" + c.name + "': dim must be positive for dense columns and 0 otherwise");
    }
  }
}

DecodeOutput JsonSampleDecoder::Decode(const MessageRef* messages, size_t count,
                                       int num_threads) const {
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) total += messages[i].size + 1;
  size_t threads = static_cast<size_t>(num_threads);
  if (num_threads <= 0) {  // auto: a second thread pays off from a few hundred KiB on
    threads = (total >= kAutoThreadsBytes && std::thread::hardware_concurrency() > 1) ? 2 : 1;
  }
  if (threads > count) threads = count < 1 ? 1 : count;
  if (threads == 1) {
    DecodeOutput out;
    internal::DecodeRange(columns_, max_message_bytes_, messages, 0, count, &out);
    return out;
  }
  // Contiguous ranges of about the same number of bytes.
  std::vector<size_t> bounds{0};
  size_t acc = 0;
  for (size_t i = 0; i < count && bounds.size() < threads; ++i) {
    acc += messages[i].size + 1;
    if (acc * threads >= total * bounds.size()) bounds.push_back(i + 1);
  }
  while (bounds.size() <= threads) bounds.push_back(count);
  bounds.back() = count;
  std::vector<DecodeOutput> parts(threads);
  std::vector<std::exception_ptr> errors(threads);
  auto work = [&](size_t t) {
    try {
      internal::DecodeRange(columns_, max_message_bytes_, messages, bounds[t], bounds[t + 1],
                            &parts[t]);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  DecodeOutput out = std::move(parts[0]);
  for (size_t t = 1; t < threads; ++t) {
    for (auto& chunk : parts[t].chunks) out.chunks.push_back(std::move(chunk));
    for (auto& r : parts[t].rejected) out.rejected.push_back(std::move(r));
  }
  return out;
}

}  // namespace json
}  // namespace prefixrec
