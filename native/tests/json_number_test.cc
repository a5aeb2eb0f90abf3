// JSON numbers as pyarrow reads them (internal/json_number.h): conversion, RapidJSON's refusal
// of some large exponents, overflow to infinity and underflow to zero.
#include "internal/json_number.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

namespace prefixrec::json::internal {
namespace {

// The Number of a valid JSON number text (the parser's scanner, reduced to valid input).
Number Scan(const std::string& text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t size = text.size();
  auto digit = [&](size_t i) { return i < size && p[i] >= '0' && p[i] <= '9'; };
  Number n;
  size_t i = 0;
  n.negative = p[0] == '-';
  i += n.negative;
  n.int_digits = p + i;
  while (digit(i)) ++i;
  n.int_len = static_cast<size_t>(p + i - n.int_digits);
  if (i < size && p[i] == '.') {
    n.frac_digits = p + ++i;
    while (digit(i)) ++i;
    n.frac_len = static_cast<size_t>(p + i - n.frac_digits);
  }
  if (i < size && (p[i] == 'e' || p[i] == 'E')) {
    n.has_exp = true;
    ++i;
    if (p[i] == '+' || p[i] == '-') n.exp_negative = p[i++] == '-';
    while (digit(i)) n.exp = n.exp * 10 + (p[i++] - '0');
  }
  REQUIRE(i == size);
  return n;
}

double AsDouble(const std::string& text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  return ToDouble(p, p + text.size(), Scan(text));
}

float AsFloat(const std::string& text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  return ToFloat(p, p + text.size(), Scan(text));
}

bool TooBig(const std::string& text) { return RapidJsonTooBig(Scan(text)); }

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();

TEST_CASE("RapidJsonTooBig refuses exactly the exponents pyarrow refuses") {
  // pyarrow.json.read_json fails with "Number too big to be stored in double" for these ...
  for (const char* text : {"1e309", "10e309", "-1e309", "1e400", "0e999", "0.0e400",
                           "0.00000000000000000001e329"}) {
    CAPTURE(text);
    CHECK(TooBig(text));
  }
  // ... and reads these (as infinity, or as 1e308 when the fraction brings them back).
  for (const char* text : {"1.5e309", "1.0e309", "0.1e309", "0.01e310", "-1.5e309",
                           "0.00000000000000000001e328", "1.00000000000000000000e320",
                           "1.0000000000000000000000000e325"}) {
    CAPTURE(text);
    CHECK_FALSE(TooBig(text));
  }
}

TEST_CASE("ToDouble rounds as pyarrow does up to and past the ends of the range") {
  CHECK(AsDouble("1.7976931348623157e308") == std::numeric_limits<double>::max());
  CHECK(AsDouble("1.7976931348623159e308") == kInf);  // rounds past the largest double
  CHECK(AsDouble("1.5e309") == kInf);
  CHECK(AsDouble("-1.5e309") == -kInf);
  CHECK(AsDouble("123.456e307") == kInf);
  CHECK(AsDouble("100000000000000000000e300") == kInf);
  CHECK(AsDouble("0.1e309") == 1e308);
  CHECK(AsDouble("4.9e-324") == std::numeric_limits<double>::denorm_min());
  CHECK(AsDouble("2e-324") == 0.0);  // below half the smallest subnormal
  const double tiny = AsDouble("1e-400");
  CHECK(tiny == 0.0);
  CHECK_FALSE(std::signbit(tiny));
  const double negative_tiny = AsDouble("-1e-400");
  CHECK(negative_tiny == 0.0);
  CHECK(std::signbit(negative_tiny));  // -0.0, as pyarrow gives it
  CHECK(AsDouble("123456789012345") == 123456789012345.0);  // the exact integer path
  CHECK(AsDouble("-0") == 0.0);
  CHECK(std::signbit(AsDouble("-0")));
}

TEST_CASE("ToFloat rounds straight to float32 at the ends of its range") {
  CHECK(AsFloat("3.4028235e38") == std::numeric_limits<float>::max());
  CHECK(AsFloat("3.5e38") == kInfF);
  CHECK(AsFloat("-3.5e38") == -kInfF);
  CHECK(AsFloat("1e39") == kInfF);
  CHECK(AsFloat("1.4e-45") == std::numeric_limits<float>::denorm_min());
  const float tiny = AsFloat("-1e-46");
  CHECK(tiny == 0.0f);
  CHECK(std::signbit(tiny));
  CHECK(AsFloat("1234567") == 1234567.0f);   // the exact integer path
  CHECK(AsFloat("16777217") == 16777216.0f);  // one rounding, to even
  // Through double this would round twice: 1 + 2^-24 + 2^-60 is just above the float32 tie.
  CHECK(AsFloat("1.00000005960464477539930798") == 1.00000011920928955078125f);
}

TEST_CASE("OutOfRange: infinity when the leading digit is at position >= 0, else zero") {
  CHECK(OutOfRange<double>(Scan("123e400")) == kInf);
  CHECK(OutOfRange<double>(Scan("-0.5e400")) == -kInf);
  CHECK(OutOfRange<float>(Scan("0.01e41")) == kInfF);
  CHECK(OutOfRange<double>(Scan("0.000123e-400")) == 0.0);
  const double negative_zero = OutOfRange<double>(Scan("-5e-330"));
  CHECK(negative_zero == 0.0);
  CHECK(std::signbit(negative_zero));
  CHECK(OutOfRange<float>(Scan("0.000e400")) == 0.0f);  // all zeros: zero, whatever the exponent
  CHECK(OutOfRange<float>(Scan("9e-46")) == 0.0f);
  // The boundary itself (values the callers never pass, as they are in range): 1 is the
  // smallest value that counts as an overflow.
  CHECK(OutOfRange<double>(Scan("1e0")) == kInf);
  CHECK(OutOfRange<double>(Scan("0.01e2")) == kInf);
  CHECK(OutOfRange<double>(Scan("0.999e0")) == 0.0);
  CHECK(OutOfRange<double>(Scan("99e-2")) == 0.0);
}

TEST_CASE("NaN and infinity keep their sign") {
  Number nan;
  nan.special = 1;
  nan.negative = true;
  const auto* none = reinterpret_cast<const uint8_t*>("");
  const double d = ToDouble(none, none, nan);
  CHECK(std::isnan(d));
  CHECK(std::signbit(d));
  CHECK(std::isnan(ToFloat(none, none, nan)));
  Number inf;
  inf.special = 2;
  inf.negative = true;
  CHECK(ToDouble(none, none, inf) == -kInf);
  CHECK(ToFloat(none, none, inf) == -kInfF);
}

}  // namespace
}  // namespace prefixrec::json::internal
