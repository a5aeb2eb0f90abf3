// What pyarrow's JSON parsers do with numbers at the edges of the range (see
// internal/json_number.h).
#include "internal/json_number.h"

namespace prefixrec::json::internal {

bool RapidJsonTooBig(const Number& n) {
  const bool neg = n.negative;
  int significand = 0;
  uint64_t i = 0, i64 = 0;
  bool use64 = false, use_double = false, nonzero = false;
  const uint8_t* d = n.int_digits;
  size_t k = 1;
  if (d[0] != '0') {
    i = d[0] - '0';
    nonzero = true;
    for (; k < n.int_len; ++k) {
      const unsigned c = d[k] - '0';
      if (neg ? (i >= 214748364 && (i != 214748364 || c > 8))
              : (i >= 429496729 && (i != 429496729 || c > 5))) {
        i64 = i;
        use64 = true;
        break;
      }
      i = i * 10 + c;
      ++significand;
    }
    if (use64) {
      for (; k < n.int_len; ++k) {
        const unsigned c = d[k] - '0';
        const uint64_t limit = neg ? 0x0CCCCCCCCCCCCCCCULL : 0x1999999999999999ULL;
        if (i64 >= limit && (i64 != limit || c > (neg ? 8u : 5u))) {
          use_double = true;
          break;
        }
        i64 = i64 * 10 + c;
        ++significand;
      }
    }
  }
  int64_t exp_frac = 0;
  size_t f = 0;
  if (n.frac_len > 0) {
    if (!use_double) {
      if (!use64) i64 = i;
      for (; f < n.frac_len; ++f) {
        if (i64 > 0x1FFFFFFFFFFFFFULL) break;
        i64 = i64 * 10 + static_cast<unsigned>(n.frac_digits[f] - '0');
        --exp_frac;
        if (i64 != 0) ++significand;
      }
      nonzero = i64 != 0;
    }
    for (; f < n.frac_len; ++f) {
      if (significand < 17) {
        if (n.frac_digits[f] != '0') nonzero = true;
        --exp_frac;
        if (nonzero) ++significand;
      }
    }
  }
  return n.exp > 308 - exp_frac;
}

template <typename T>
T OutOfRange(const Number& n) {
  int64_t lead = 0;  // the value lies in [10^(lead-1), 10^lead)
  if (n.int_digits[0] != '0') {
    lead = static_cast<int64_t>(n.int_len);
  } else {
    size_t zeros = 0;
    while (zeros < n.frac_len && n.frac_digits[zeros] == '0') ++zeros;
    if (zeros == n.frac_len) return n.negative ? -T(0) : T(0);
    lead = -static_cast<int64_t>(zeros);
  }
  lead += n.exp_negative ? -n.exp : n.exp;
  const T magnitude = lead >= 1 ? std::numeric_limits<T>::infinity() : T(0);
  return n.negative ? -magnitude : magnitude;
}

template float OutOfRange<float>(const Number& n);
template double OutOfRange<double>(const Number& n);

}  // namespace prefixrec::json::internal
