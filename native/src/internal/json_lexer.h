// The JSON tokens of the sample decoder (strings, numbers, literals) and its syntax reasons,
// shared by the decoder (json_parser.cc) and the request envelope scanner (json_envelope.cc), so
// that both accept the same bytes and word a syntax error alike.
//
// Grammar: RFC 8259 plus what pyarrow's RapidJSON reads (NaN, Inf and Infinity, optionally
// negative; numbers whose exponent makes them too big for a double are refused as RapidJSON
// refuses them). Strings must be valid UTF-8 (RFC 3629: no overlong forms, no encoded
// surrogates) and a \u escape of a surrogate must be half of a pair.
//
// Every scan stops at a NUL sentinel after the last byte of the input (NUL is never valid outside
// a string, and raw inside a string it is a control character), so the input needs one readable
// NUL byte after its end.
#ifndef PREFIXREC_INTERNAL_JSON_LEXER_H_
#define PREFIXREC_INTERNAL_JSON_LEXER_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "internal/json_bytes.h"
#include "internal/json_number.h"
#include "prefixrec/json_samples.h"

namespace prefixrec::json::internal {

// The reason of a message refused for its syntax, as the decoder gives it: `what` found at
// byte `offset` of the message (or the message ends first), inside the value of `field` (a
// Python repr of the field name, empty when the error is not inside a field's value).
inline std::string NotJsonReason(const char* what, size_t offset, bool at_end,
                                 const std::string& field) {
  std::string where = at_end ? "the message ends too early"
                             : std::string(what) + " at byte " + std::to_string(offset);
  if (!at_end && !field.empty()) where += ", in field " + field;
  return "not a valid sample: not JSON (" + where + ")";
}

// Scans tokens of one input [begin_, end_) and keeps its first syntax error.
class Lexer {
 protected:
  void StartInput(const uint8_t* begin, const uint8_t* end) {
    begin_ = begin;
    end_ = end;
    syntax_what_ = nullptr;
    syntax_at_ = nullptr;
  }

  // Records the first syntax error (what was wrong, where) and returns nullptr.
  const uint8_t* Syntax(const uint8_t* at, const char* what) {
    if (syntax_what_ == nullptr) {
      syntax_what_ = what;
      syntax_at_ = at;
    }
    return nullptr;
  }
  bool SyntaxAtEnd() const { return syntax_at_ >= end_; }

  // p just after the opening quote. Writes the decoded UTF-8 bytes into out (appending) and
  // returns the position after the closing quote, or nullptr (syntax error).
  const uint8_t* ScanString(const uint8_t* p, PodBuffer<uint8_t>* out) {
    // Decoded bytes never outnumber the encoded ones.
    out->reserve(out->size() + static_cast<size_t>(end_ - p) + 4);
    uint8_t* w = out->data() + out->size();
    for (;;) {
      const uint8_t c = *p;
      if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) {
        *w++ = c;
        ++p;
        continue;
      }
      if (c == '"') {
        out->set_size(static_cast<size_t>(w - out->data()));
        return p + 1;
      }
      if (c == '\\') {
        const uint8_t e = p[1];
        switch (e) {
          case '"': *w++ = '"'; p += 2; continue;
          case '\\': *w++ = '\\'; p += 2; continue;
          case '/': *w++ = '/'; p += 2; continue;
          case 'b': *w++ = '\b'; p += 2; continue;
          case 'f': *w++ = '\f'; p += 2; continue;
          case 'n': *w++ = '\n'; p += 2; continue;
          case 'r': *w++ = '\r'; p += 2; continue;
          case 't': *w++ = '\t'; p += 2; continue;
          case 'u': {
            int cp = Hex4(p + 2);
            if (cp < 0) return Syntax(p, "invalid \\u escape in a string");
            p += 6;
            if (cp >= 0xDC00 && cp <= 0xDFFF) {
              return Syntax(p - 6, "invalid surrogate pair in a string");
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              const int lo = (p[0] == '\\' && p[1] == 'u') ? Hex4(p + 2) : -1;
              if (lo < 0xDC00 || lo > 0xDFFF) {
                return Syntax(p - 6, "invalid surrogate pair in a string");
              }
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
              p += 6;
            }
            w = PutUtf8(w, static_cast<uint32_t>(cp));
            continue;
          }
          default:
            return Syntax(p, "invalid escape in a string");
        }
      }
      if (c < 0x20) {
        return Syntax(p, p >= end_ ? "unterminated string" : "control character in a string");
      }
      const size_t n = Utf8Length(p);
      if (n == 0) return Syntax(p, "invalid UTF-8 in a string");
      std::memcpy(w, p, n);
      w += n;
      p += n;
    }
  }

  static int Hex4(const uint8_t* p) {
    int v = 0;
    for (int k = 0; k < 4; ++k) {  // stops at the first non-hex byte (the sentinel included)
      const int h = HexValue(p[k]);
      if (h < 0) return -1;
      v = (v << 4) | h;
    }
    return v;
  }

  const uint8_t* ScanNumber(const uint8_t* p, Number* n) {
    const uint8_t* start = p;
    n->negative = *p == '-';
    p += n->negative;
    if (*p == 'N') {
      if (p[1] == 'a' && p[2] == 'N') {
        n->special = 1;
        return p + 3;
      }
      return Syntax(start, "invalid value");
    }
    if (*p == 'I') {
      if (p[1] == 'n' && p[2] == 'f') {
        p += 3;
        if (*p == 'i') {
          if (!(p[1] == 'n' && p[2] == 'i' && p[3] == 't' && p[4] == 'y')) {
            return Syntax(start, "invalid value");
          }
          p += 5;
        }
        n->special = 2;
        return p;
      }
      return Syntax(start, "invalid value");
    }
    n->int_digits = p;
    if (*p == '0') {
      ++p;
    } else if (*p >= '1' && *p <= '9') {
      while (IsDigit(*p)) ++p;
    } else {
      return Syntax(start, "expected a value");
    }
    n->int_len = static_cast<size_t>(p - n->int_digits);
    if (*p == '.') {
      ++p;
      if (!IsDigit(*p)) return Syntax(p, "expected a digit after the decimal point");
      n->frac_digits = p;
      while (IsDigit(*p)) ++p;
      n->frac_len = static_cast<size_t>(p - n->frac_digits);
    }
    if (*p == 'e' || *p == 'E') {
      ++p;
      n->has_exp = true;
      if (*p == '+' || *p == '-') {
        n->exp_negative = *p == '-';
        ++p;
      }
      if (!IsDigit(*p)) return Syntax(p, "expected a digit in the exponent");
      int64_t e = 0;
      while (IsDigit(*p)) {
        if (e < (int64_t{1} << 40)) e = e * 10 + (*p - '0');
        ++p;
      }
      n->exp = e;
      if (!n->exp_negative && e > 308 && RapidJsonTooBig(*n)) {
        return Syntax(start, "number too big to be stored in a double");
      }
    }
    return p;
  }

  // One value that is not an array or an object at p (whitespace skipped): a string (decoded
  // into `scratch`, replacing what it held), true, false, null or a number. Returns the
  // position after it, or nullptr (syntax error).
  const uint8_t* ScanScalar(const uint8_t* p, PodBuffer<uint8_t>* scratch) {
    switch (*p) {
      case '"':
        scratch->clear();
        return ScanString(p + 1, scratch);
      case 't':
        if (!(p[1] == 'r' && p[2] == 'u' && p[3] == 'e')) return Syntax(p, "invalid value");
        return p + 4;
      case 'f':
        if (!(p[1] == 'a' && p[2] == 'l' && p[3] == 's' && p[4] == 'e')) {
          return Syntax(p, "invalid value");
        }
        return p + 5;
      case 'n':
        if (!(p[1] == 'u' && p[2] == 'l' && p[3] == 'l')) return Syntax(p, "invalid value");
        return p + 4;
      default: {
        Number n;
        return ScanNumber(p, &n);
      }
    }
  }

  const uint8_t* begin_ = nullptr;
  const uint8_t* end_ = nullptr;
  const char* syntax_what_ = nullptr;
  const uint8_t* syntax_at_ = nullptr;
};

}  // namespace prefixrec::json::internal

#endif  // PREFIXREC_INTERNAL_JSON_LEXER_H_
