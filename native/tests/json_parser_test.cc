// A few end-to-end cases of the JSON sample parser (through JsonSampleDecoder); the full
// comparison with pyarrow is tests/native/test_json_samples.py.
#include "prefixrec/json_samples.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace prefixrec::json {
namespace {

std::vector<ColumnSpec> Columns() {
  return {
      {"user", ColumnKind::kId, ValueType::kInt64, 0, true},
      {"items", ColumnKind::kIds, ValueType::kInt64, 0, false},
      {"emb", ColumnKind::kDense, ValueType::kFloat32, 2, false},
      {"click", ColumnKind::kLabel, ValueType::kFloat32, 0, false},
      {"price", ColumnKind::kCarried, ValueType::kFloat64, 0, false},
      {"ts", ColumnKind::kCarried, ValueType::kTimestamp, 0, false},
  };
}

// Decodes `texts` on one thread, each message copied (not NUL-terminated in place).
DecodeOutput Decode(const std::vector<std::string>& texts, int threads = 1) {
  std::vector<MessageRef> refs;
  for (const std::string& t : texts) refs.push_back({t.data(), t.size(), true, false});
  return JsonSampleDecoder(Columns(), 1 << 20).Decode(refs.data(), refs.size(), threads);
}

std::string ReasonOf(const std::string& text) {
  const DecodeOutput out = Decode({text});
  REQUIRE(out.rejected.size() == 1);
  return out.rejected[0].reason;
}

const std::string kGood =
    R"({"user": 7, "items": [1, 2], "emb": [0.5, -1], "click": 1, "price": 2.5, )"
    R"("ts": "2024-03-05T12:34:56Z"})";

TEST_CASE("an accepted sample lands in every column") {
  const DecodeOutput out =
      Decode({kGood, R"({"user": -3, "items": [], "emb": [0, 1e39], "click": 0, "price": -1e-400})"});
  CHECK(out.rejected.size() == 1);  // the second: an infinite dense value
  REQUIRE(out.chunks.size() == 1);
  const DecodedChunk& chunk = out.chunks[0];
  REQUIRE(chunk.messages.size() == 1);
  CHECK(chunk.messages[0] == 0);
  CHECK(chunk.columns[0].ints[0] == 7);
  CHECK(chunk.columns[1].offsets[1] == 2);
  CHECK(chunk.columns[1].ints[1] == 2);
  CHECK(chunk.columns[2].floats[1] == -1.0f);
  CHECK(chunk.columns[3].floats[0] == 1.0f);
  CHECK(chunk.columns[4].doubles[0] == 2.5);
  CHECK(chunk.columns[5].ints[0] == int64_t{1709642096000000});
  CHECK(chunk.columns[5].validity[0] == 1);
  CHECK(out.rejected[0].reason == "column 'emb': NaN or infinite value in a dense feature");
}

TEST_CASE("carried values: missing is null, out-of-range floats as pyarrow reads them") {
  const DecodeOutput out = Decode({
      R"({"user": 1, "items": [], "emb": [0, 0], "click": 0, "price": -1e-400})",
      R"({"user": 1, "items": [], "emb": [0, 0], "click": 0, "price": 1.5e309, "ts": null})",
  });
  REQUIRE(out.rejected.empty());
  const ColumnData& price = out.chunks[0].columns[4];
  CHECK(price.doubles[0] == 0.0);
  CHECK(std::signbit(price.doubles[0]));
  CHECK(price.doubles[1] == std::numeric_limits<double>::infinity());
  const ColumnData& ts = out.chunks[0].columns[5];
  CHECK(ts.nulls == 2);
  CHECK(ts.validity[0] == 0);
}

TEST_CASE("each kind of rejection gives the Python path's reason") {
  // The reasons compression.decode_json_samples gives for the same messages.
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": 0, "caf\u00e9\u0085": 1, "x'y": 2})") ==
        "not a valid sample: unexpected field(s) 'caf\xc3\xa9\\x85', \"x'y\"; the schema has no "
        "such column");
  CHECK(ReasonOf(R"({"user": "7", "items": [], "emb": [0.5, 1], "click": 0})") ==
        "not a valid sample: field 'user': expected an integer (kind id, dtype int64), got a string");
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": 0)") ==
        "not a valid sample: not JSON (the message ends too early)");
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5], "click": 0})") ==
        "column 'emb': dense value has the wrong number of floats, expected dim 2");
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": null})") ==
        "label 'click': null label; every sample needs its labels");
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": 2})") ==
        "label 'click': value out of range, labels must be in [0, 1]");
  CHECK(ReasonOf("[1, 2]") == "not a valid sample: expected a JSON object, got list");
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": 1, "ts": "2024-02-30"})") ==
        "not a valid sample: field 'ts': expected an ISO-8601 timestamp string or null (carried, "
        "dtype timestamp), got \"2024-02-30\", not a timestamp");
  CHECK(ReasonOf(R"({"user": 99999999999999999999, "items": [], "emb": [0.5, 1], "click": 1})") ==
        "not a valid sample: field 'user': expected an integer (kind id, dtype int64), got "
        "99999999999999999999, out of the int64 range");
  CHECK(ReasonOf(R"({"user": 7, "items": [1, null], "emb": [0.5, 1], "click": 1})") ==
        "column 'items': null inside the list; lists may be empty but cannot hold nulls");
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": 1, "price": 1e400})") ==
        "not a valid sample: not JSON (number too big to be stored in a double at byte 63, in "
        "field 'price')");
  CHECK(ReasonOf("{\"user\": 7, \"items\": [], \"emb\": [0.5, 1], \"click\": 1, \"price\": \"\xff\"}") ==
        "not a valid sample: not JSON (invalid UTF-8 in a string at byte 64, in field 'price')");
  // a syntax error inside a field's value names the field (known or not); one outside does not
  CHECK(ReasonOf(R"({"user": 7, "items": [], "emb": [0.5, 1], "click": 1, "x": {"y": "\ud800"}})") ==
        "not a valid sample: not JSON (invalid surrogate pair in a string at byte 66, in field "
        "'x')");
  CHECK(ReasonOf(R"({"user": 7, "items": [1 2], "emb": [0.5, 1], "click": 1})") ==
        "not a valid sample: not JSON (expected ',' or ']' in a list at byte 24, in field 'items')");
  CHECK(ReasonOf(R"({"user": 7 "items": []})") ==
        "not a valid sample: not JSON (expected ',' or '}' after a field value at byte 11)");
  CHECK(ReasonOf("  ") == "empty message; expected one JSON object");
}

TEST_CASE("a rejected message leaves no trace in the columns; threads split the same result") {
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) {
    texts.push_back(i % 3 == 1 ? R"({"user": 1, "items": [5, 6, 7], "emb": [1, 2], "click": 9})"
                               : kGood);
  }
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    const DecodeOutput out = Decode(texts, threads);
    CHECK(out.rejected.size() == 67);
    size_t rows = 0;
    for (const DecodedChunk& chunk : out.chunks) {
      const size_t n = chunk.messages.size();
      rows += n;
      CHECK(chunk.columns[1].offsets.size() == n + 1);
      CHECK(chunk.columns[1].ints.size() == 2 * n);  // none of the rejected [5, 6, 7]
      CHECK(chunk.columns[2].floats.size() == 2 * n);
      for (size_t r = 0; r < n; ++r) CHECK(chunk.messages[r] % 3 != 1);
    }
    CHECK(rows == 133);
  }
}

}  // namespace
}  // namespace prefixrec::json
