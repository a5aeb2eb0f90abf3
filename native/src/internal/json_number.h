// JSON numbers as pyarrow's JSON reader reads them: the scanned form of a number, its
// conversion to float32 / float64 (correctly rounded from the decimal text), and what pyarrow's
// parsers do at the edges: RapidJSON's refusal of some large exponents, fast_float's overflow to
// infinity and underflow to zero. The conversions are on the parser's hot path (inline); the
// edge cases are not.
#ifndef PREFIXREC_INTERNAL_JSON_NUMBER_H_
#define PREFIXREC_INTERNAL_JSON_NUMBER_H_

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <locale.h>
#include <stdlib.h>
#include <string>
#include <system_error>

namespace prefixrec::json::internal {

// A JSON number as scanned: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, or NaN / Inf /
// Infinity with an optional minus (pyarrow's RapidJSON accepts those, kParseNanAndInfFlag).
struct Number {
  bool negative = false;
  uint8_t special = 0;  // 0: finite, 1: NaN, 2: infinity
  const uint8_t* int_digits = nullptr;
  size_t int_len = 0;
  const uint8_t* frac_digits = nullptr;
  size_t frac_len = 0;
  bool has_exp = false;
  bool exp_negative = false;
  int64_t exp = 0;  // absolute value, saturated
};

// RapidJSON (as used by pyarrow) rejects a number with a positive exponent e when
// e > 308 - (the fraction digits it counted); this reproduces its counting exactly.
// Only called for a positive exponent above 308 (n.has_exp, !n.exp_negative).
bool RapidJsonTooBig(const Number& n);

// A finite number out of T's range: the value is >= 1 (overflow to infinity) iff its
// leading significant digit sits at a decimal position >= 0; else it underflows to zero.
// Defined for float and double.
template <typename T>
T OutOfRange(const Number& n);

// A number converted to float32 with correct rounding from its decimal text (as pyarrow's
// converter does; not through double, which would round twice).
inline float ToFloat(const uint8_t* start, const uint8_t* stop, const Number& n) {
  if (n.special == 1) return std::numeric_limits<float>::quiet_NaN();
  if (n.special == 2) {
    return n.negative ? -std::numeric_limits<float>::infinity()
                      : std::numeric_limits<float>::infinity();
  }
  if (n.frac_len == 0 && !n.has_exp && n.int_len <= 7) {  // exact in float32
    int32_t v = 0;
    for (size_t k = 0; k < n.int_len; ++k) v = v * 10 + (n.int_digits[k] - '0');
    const float f = static_cast<float>(v);
    return n.negative ? -f : f;
  }
#if defined(__cpp_lib_to_chars) && !defined(PREFIXREC_JSON_STRTOF)
  // libstdc++ >= 12: fast_float, correctly rounded straight to float.
  float f = 0.0f;
  const auto r = std::from_chars(reinterpret_cast<const char*>(start),
                                 reinterpret_cast<const char*>(stop), f);
  if (r.ec == std::errc() && r.ptr == reinterpret_cast<const char*>(stop)) return f;
#else
  // Older standard libraries: glibc's strtof rounds correctly too (and gives +-inf / the
  // rounded subnormal or zero out of range); "C" locale for the decimal point.
  static const locale_t c_locale = newlocale(LC_ALL_MASK, "C", static_cast<locale_t>(nullptr));
  const std::string text(reinterpret_cast<const char*>(start), static_cast<size_t>(stop - start));
  return strtof_l(text.c_str(), nullptr, c_locale);
#endif
  return OutOfRange<float>(n);
}

// The same for a float64 (carried) value: correctly rounded from the decimal text, as
// pyarrow's converter (fast_float) does; out of range: +-infinity or +-0.
inline double ToDouble(const uint8_t* start, const uint8_t* stop, const Number& n) {
  if (n.special == 1) {  // -NaN keeps its sign bit, as fast_float gives it
    return std::copysign(std::numeric_limits<double>::quiet_NaN(), n.negative ? -1.0 : 1.0);
  }
  if (n.special == 2) {
    return n.negative ? -std::numeric_limits<double>::infinity()
                      : std::numeric_limits<double>::infinity();
  }
  if (n.frac_len == 0 && !n.has_exp && n.int_len <= 15) {  // exact in float64
    int64_t v = 0;
    for (size_t k = 0; k < n.int_len; ++k) v = v * 10 + (n.int_digits[k] - '0');
    const auto f = static_cast<double>(v);
    return n.negative ? -f : f;
  }
#if defined(__cpp_lib_to_chars) && !defined(PREFIXREC_JSON_STRTOF)
  double f = 0.0;
  const auto r = std::from_chars(reinterpret_cast<const char*>(start),
                                 reinterpret_cast<const char*>(stop), f);
  if (r.ec == std::errc() && r.ptr == reinterpret_cast<const char*>(stop)) return f;
#else
  static const locale_t c_locale = newlocale(LC_ALL_MASK, "C", static_cast<locale_t>(nullptr));
  const std::string text(reinterpret_cast<const char*>(start), static_cast<size_t>(stop - start));
  return strtod_l(text.c_str(), nullptr, c_locale);
#endif
  return OutOfRange<double>(n);
}

}  // namespace prefixrec::json::internal

#endif  // PREFIXREC_INTERNAL_JSON_NUMBER_H_
