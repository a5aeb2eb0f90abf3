// Byte-level helpers of the JSON sample decoder: character classes, word-at-a-time compares and
// digit loads, UTF-8 validation and encoding. Everything here is on the parser's hot path, so it
// is all inline.
#ifndef PREFIXREC_INTERNAL_JSON_BYTES_H_
#define PREFIXREC_INTERNAL_JSON_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace prefixrec::json::internal {

inline bool IsDigit(uint8_t c) { return static_cast<uint8_t>(c - '0') < 10; }
inline bool IsWs(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
inline const uint8_t* SkipWs(const uint8_t* p) {
  while (IsWs(*p)) ++p;
  return p;
}
// a[0..n) == b[0..n), both readable for n bytes; inline (names are short, memcmp is a call).
inline bool SameBytes(const uint8_t* a, const char* b, size_t n) {
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t x, y;
    std::memcpy(&x, a + k, 8);
    std::memcpy(&y, b + k, 8);
    if (x != y) return false;
  }
  if (n - k >= 4) {
    uint32_t x, y;
    std::memcpy(&x, a + k, 4);
    std::memcpy(&y, b + k, 4);
    if (x != y) return false;
    k += 4;
  }
  for (; k < n; ++k) {
    if (a[k] != static_cast<uint8_t>(b[k])) return false;
  }
  return true;
}
// The number of leading decimal digits of p[0..8) (which must be readable), at most 8, and
// their value (SWAR: one 8-byte load, three multiplies). Little-endian only.
inline int EightDigits(const uint8_t* p, uint64_t* value) {
  uint64_t chunk;
  std::memcpy(&chunk, p, 8);
  // Byte b is a digit iff b - '0' <= 9: then neither (b - '0') nor (b - '0' + 0x76) has its top
  // bit set. Borrows and carries only start at a non-digit byte, so the lowest flagged byte is
  // the first non-digit.
  const uint64_t x = chunk - 0x3030303030303030ULL;
  const uint64_t nondigit = (x | (x + 0x7676767676767676ULL)) & 0x8080808080808080ULL;
  const int n = nondigit != 0 ? __builtin_ctzll(nondigit) >> 3 : 8;
  if (n == 0) {
    *value = 0;
    return 0;
  }
  // Keep the n digits, as the last n of 8 (leading zeros), then combine pairs, quads, octets.
  uint64_t d = (chunk << (8 * (8 - n))) & 0x0F0F0F0F0F0F0F0FULL;
  d = (d * 2561) >> 8;
  d = ((d & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
  d = ((d & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
  *value = d;
  return n;
}

constexpr uint64_t kPow10[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};

inline int HexValue(uint8_t c) {
  if (IsDigit(c)) return c - '0';
  c |= 0x20;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// Length of the valid UTF-8 sequence starting at p (a byte >= 0x80), or 0 if invalid
// (overlong forms, surrogates and code points above U+10FFFF are invalid, as in RFC 3629).
inline size_t Utf8Length(const uint8_t* p) {
  const uint8_t c = p[0];
  auto cont = [](uint8_t b) { return (b & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) return cont(p[1]) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    const uint8_t lo = c == 0xE0 ? 0xA0 : 0x80;
    const uint8_t hi = c == 0xED ? 0x9F : 0xBF;
    return (p[1] >= lo && p[1] <= hi && cont(p[2])) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    const uint8_t lo = c == 0xF0 ? 0x90 : 0x80;
    const uint8_t hi = c == 0xF4 ? 0x8F : 0xBF;
    return (p[1] >= lo && p[1] <= hi && cont(p[2]) && cont(p[3])) ? 4 : 0;
  }
  return 0;
}

inline uint8_t* PutUtf8(uint8_t* w, uint32_t cp) {
  if (cp < 0x80) {
    *w++ = static_cast<uint8_t>(cp);
  } else if (cp < 0x800) {
    *w++ = static_cast<uint8_t>(0xC0 | (cp >> 6));
    *w++ = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *w++ = static_cast<uint8_t>(0xE0 | (cp >> 12));
    *w++ = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    *w++ = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  } else {
    *w++ = static_cast<uint8_t>(0xF0 | (cp >> 18));
    *w++ = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
    *w++ = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    *w++ = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  }
  return w;
}

}  // namespace prefixrec::json::internal

#endif  // PREFIXREC_INTERNAL_JSON_BYTES_H_
