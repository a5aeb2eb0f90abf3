// Python's repr() of a str (see internal/py_repr.h).
#include "internal/py_repr.h"

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "internal/json_bytes.h"

namespace prefixrec::json::internal {

std::string PyRepr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  char hex[8];
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      if (c == '\\' || c == static_cast<uint8_t>(quote)) {
        out += '\\';
        out += static_cast<char>(c);
      } else if (c == '\t') {
        out += "\\t";
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '\r') {
        out += "\\r";
      } else if (c < 0x20 || c == 0x7F) {
        std::snprintf(hex, sizeof hex, "\\x%02x", c);
        out += hex;
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    uint8_t tmp[5] = {0, 0, 0, 0, 0};
    const size_t left = s.size() - i;
    std::memcpy(tmp, s.data() + i, left < 4 ? left : 4);
    const size_t n = Utf8Length(tmp);
    if (n == 0 || n > left) {  // not UTF-8 (cannot happen for a validated key)
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
      ++i;
      continue;
    }
    const uint32_t cp = n == 2 ? ((c & 0x1Fu) << 6) | (tmp[1] & 0x3Fu) : 0;
    if (n == 2 && (cp <= 0xA0 || cp == 0xAD)) {
      std::snprintf(hex, sizeof hex, "\\x%02x", cp);
      out += hex;
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out += quote;
  return out;
}
}  // namespace prefixrec::json::internal
