// Byte and UTF-8 helpers of the JSON decoder (internal/json_bytes.h).
#include "internal/json_bytes.h"

#include <doctest/doctest.h>

#include <string>

namespace prefixrec::json::internal {
namespace {

// Utf8Length of `bytes` followed by NUL padding (the decoder's sentinel).
size_t LengthOf(const std::string& bytes) {
  std::string padded = bytes + std::string(8, '\0');
  return Utf8Length(reinterpret_cast<const uint8_t*>(padded.data()));
}

TEST_CASE("Utf8Length accepts the shortest form of every sequence length") {
  CHECK(LengthOf("\xC2\x80") == 2);          // U+0080, the smallest 2-byte character
  CHECK(LengthOf("\xC3\xA9") == 2);          // e acute
  CHECK(LengthOf("\xDF\xBF") == 2);          // U+07FF
  CHECK(LengthOf("\xE0\xA0\x80") == 3);      // U+0800
  CHECK(LengthOf("\xE4\xB8\xAD") == 3);      // a CJK character
  CHECK(LengthOf("\xED\x9F\xBF") == 3);      // U+D7FF, just below the surrogates
  CHECK(LengthOf("\xEE\x80\x80") == 3);      // U+E000, just above them
  CHECK(LengthOf("\xEF\xBF\xBF") == 3);      // U+FFFF
  CHECK(LengthOf("\xF0\x90\x80\x80") == 4);  // U+10000
  CHECK(LengthOf("\xF0\x9F\x98\x80") == 4);  // an emoji
  CHECK(LengthOf("\xF4\x8F\xBF\xBF") == 4);  // U+10FFFF, the largest code point
}

TEST_CASE("Utf8Length refuses overlong forms") {
  CHECK(LengthOf("\xC0\x80") == 0);          // NUL in two bytes
  CHECK(LengthOf("\xC1\xBF") == 0);          // U+007F in two bytes
  CHECK(LengthOf("\xE0\x80\x80") == 0);      // NUL in three bytes
  CHECK(LengthOf("\xE0\x9F\xBF") == 0);      // U+07FF in three bytes
  CHECK(LengthOf("\xF0\x80\x80\x80") == 0);  // NUL in four bytes
  CHECK(LengthOf("\xF0\x8F\xBF\xBF") == 0);  // U+FFFF in four bytes
}

TEST_CASE("Utf8Length refuses surrogates and code points above U+10FFFF") {
  CHECK(LengthOf("\xED\xA0\x80") == 0);      // U+D800
  CHECK(LengthOf("\xED\xBF\xBF") == 0);      // U+DFFF
  CHECK(LengthOf("\xF4\x90\x80\x80") == 0);  // U+110000
  CHECK(LengthOf("\xF5\x80\x80\x80") == 0);
  CHECK(LengthOf("\xFF") == 0);
}

TEST_CASE("Utf8Length refuses stray continuation bytes and truncated sequences") {
  CHECK(LengthOf("\x80") == 0);
  CHECK(LengthOf("\xBF") == 0);
  CHECK(LengthOf("\xC3") == 0);              // then the NUL sentinel
  CHECK(LengthOf("\xC3" "A") == 0);
  CHECK(LengthOf("\xE4\xB8") == 0);
  CHECK(LengthOf("\xE4" "A" "\xAD") == 0);
  CHECK(LengthOf("\xF0\x9F\x98") == 0);
  CHECK(LengthOf("\xF0\x9F" "A" "\x80") == 0);
}

TEST_CASE("PutUtf8 writes what Utf8Length accepts, for every sequence length") {
  const struct {
    uint32_t code_point;
    std::string bytes;
  } cases[] = {{0x41, "A"}, {0x7F, "\x7F"}, {0x80, "\xC2\x80"}, {0xE9, "\xC3\xA9"},
               {0x7FF, "\xDF\xBF"}, {0x800, "\xE0\xA0\x80"}, {0xFFFF, "\xEF\xBF\xBF"},
               {0x10000, "\xF0\x90\x80\x80"}, {0x1F600, "\xF0\x9F\x98\x80"},
               {0x10FFFF, "\xF4\x8F\xBF\xBF"}};
  for (const auto& c : cases) {
    CAPTURE(c.code_point);
    uint8_t out[8] = {};
    const uint8_t* end = PutUtf8(out, c.code_point);
    CHECK(std::string(reinterpret_cast<const char*>(out), end - out) == c.bytes);
    if (c.code_point >= 0x80) CHECK(LengthOf(c.bytes) == c.bytes.size());
  }
}

TEST_CASE("EightDigits counts and reads the leading digits of 8 bytes") {
  const struct {
    const char* text;
    int digits;
    uint64_t value;
  } cases[] = {{"12345678", 8, 12345678}, {"00000007", 8, 7}, {"99999999", 8, 99999999},
               {"1234567,", 7, 1234567},  {"42]     ", 2, 42}, {"7\0\0\0\0\0\0\0", 1, 7},
               {"x1234567", 0, 0},        {"0.5e1234", 1, 0},   {"9/:12345", 1, 9}};
  for (const auto& c : cases) {
    CAPTURE(c.text);
    uint64_t value = 12345;
    CHECK(EightDigits(reinterpret_cast<const uint8_t*>(c.text), &value) == c.digits);
    CHECK(value == c.value);
  }
}

TEST_CASE("SameBytes compares every byte, whatever the length") {
  const std::string a = "user_id_of_the_sample";
  for (size_t n = 0; n <= a.size(); ++n) {
    CAPTURE(n);
    const auto* p = reinterpret_cast<const uint8_t*>(a.data());
    CHECK(SameBytes(p, a.data(), n));
    for (size_t k = 0; k < n; ++k) {
      std::string b = a;
      b[k] ^= 0x20;
      CHECK_FALSE(SameBytes(p, b.data(), n));
    }
  }
}

TEST_CASE("HexValue and the character classes") {
  CHECK(HexValue('0') == 0);
  CHECK(HexValue('9') == 9);
  CHECK(HexValue('a') == 10);
  CHECK(HexValue('F') == 15);
  CHECK(HexValue('g') == -1);
  CHECK(HexValue('G') == -1);
  CHECK(HexValue('/') == -1);
  CHECK(HexValue(0) == -1);
  CHECK(IsDigit('0'));
  CHECK(IsDigit('9'));
  CHECK_FALSE(IsDigit('/'));
  CHECK_FALSE(IsDigit(':'));
  const auto* text = reinterpret_cast<const uint8_t*>(" \t\r\n x");
  CHECK(*SkipWs(text) == 'x');
  CHECK_FALSE(IsWs('\v'));  // JSON whitespace is these four only
  CHECK_FALSE(IsWs('\f'));
}

}  // namespace
}  // namespace prefixrec::json::internal
