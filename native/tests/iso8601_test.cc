// The ISO-8601 timestamp parser (internal/iso8601.h) against pyarrow's JSON reader.
#include "internal/iso8601.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>

namespace prefixrec::json::internal {
namespace {

bool Parse(const std::string& text, int64_t* out) {
  return ParseIso8601Micros(reinterpret_cast<const uint8_t*>(text.data()), text.size(), out);
}

TEST_CASE("ParseIso8601Micros gives pyarrow's microseconds for every accepted form") {
  // Expected: pyarrow.json.read_json of {"ts": text} as timestamp[us, tz=UTC], cast to int64.
  const struct {
    const char* text;
    int64_t micros;
  } cases[] = {
      {"1970-01-01", int64_t{0}},
      {"2024-02-29", int64_t{1709164800000000}},
      {"2024-03-05T12", int64_t{1709640000000000}},
      {"2024-03-05 12:34", int64_t{1709642040000000}},
      {"2024-03-05T12:34:56", int64_t{1709642096000000}},
      {"2024-03-05T12:34:56.5", int64_t{1709642096500000}},
      {"2024-03-05T12:34:56.123456", int64_t{1709642096123456}},
      {"2024-03-05T12:34:56.123Z", int64_t{1709642096123000}},
      {"2024-03-05T12:34:56+01:30", int64_t{1709636696000000}},
      {"2024-03-05T12:34:56-0130", int64_t{1709647496000000}},
      {"2024-03-05T12:34+05", int64_t{1709624040000000}},
      {"2024-03-05T12-05", int64_t{1709658000000000}},
      {"2000-02-29T23:59:59.999999Z", int64_t{951868799999999}},
      {"1969-12-31T23:59:59.999999", int64_t{-1}},
      {"0000-01-01", int64_t{-62167219200000000}},
      {"0001-01-01", int64_t{-62135596800000000}},
      {"9999-12-31T23:59:59.999999", int64_t{253402300799999999}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    int64_t got = 0;
    REQUIRE(Parse(c.text, &got));
    CHECK(got == c.micros);
  }
}

TEST_CASE("ParseIso8601Micros refuses what pyarrow refuses, leaving the output alone") {
  // Each of these makes pyarrow.json.read_json fail for a timestamp[us, tz=UTC] field.
  const char* refused[] = {
      "", "2024-01-0", "24-01-01", "2024/01/01", "2024-1-01", "+2024-03-05",
      "2023-02-29", "1900-02-29", "2024-13-01", "2024-00-10", "2024-01-00", "2024-04-31",
      "2024-01-32", "2024-03-05Z", "2024-03-05T", "2024-03-05X12:00", "2024-03-05t12:34:56",
      "2024-03-05T1", "2024-03-05T12:3", "2024-03-05T24:00", "2024-03-05T23:60",
      "2024-03-05T23:59:60", "2024-03-05T12:34:5a", "2024-03-05T12:34:56.",
      "2024-03-05T12:34:56,5", "2024-03-05T12:34:56.12a", "2024-03-05T12:34:56.1234567",
      "2024-03-05T12:34:56.123456789", "2024-03-05T12:34:56+24", "2024-03-05T12:34:56+01:60",
      "2024-03-05T12:34:56+1", "2024-03-05T12:34:56 +01:00", "2024-03-05T12:34:56z",
      "2024-03-05T12:34:56ZZ", " 2024-03-05", "2024-03-05 ",
  };
  for (const char* text : refused) {
    CAPTURE(text);
    int64_t out = 42;
    CHECK_FALSE(Parse(text, &out));
    CHECK(out == 42);
  }
}

TEST_CASE("ParseIso8601Micros reads nothing past the given length") {
  const std::string text = "2024-03-05T12:34:56.123456Z";
  int64_t out = 0;
  // Cut inside the fraction: a shorter, valid fraction, whatever follows in memory.
  REQUIRE(ParseIso8601Micros(reinterpret_cast<const uint8_t*>(text.data()), 21, &out));
  CHECK(out == int64_t{1709642096100000});
  CHECK_FALSE(ParseIso8601Micros(reinterpret_cast<const uint8_t*>(text.data()), 9, &out));
}

}  // namespace
}  // namespace prefixrec::json::internal
