// ISO-8601 timestamps, exactly as Arrow's ParseTimestampISO8601 (see internal/iso8601.h).
#include "internal/iso8601.h"

#include "internal/json_bytes.h"

namespace prefixrec::json::internal {
namespace {

// n decimal digits (n <= 9), nothing else.
inline bool FixedDigits(const uint8_t* s, size_t n, uint32_t* out) {
  uint32_t v = 0;
  for (size_t k = 0; k < n; ++k) {
    if (!IsDigit(s[k])) return false;
    v = v * 10 + static_cast<uint32_t>(s[k] - '0');
  }
  *out = v;
  return true;
}

// Days from 1970-01-01 to y-m-d in the proleptic Gregorian calendar (H. Hinnant's algorithm).
inline int64_t DaysFromCivil(int64_t y, uint32_t m, uint32_t d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const auto yoe = static_cast<uint32_t>(y - era * 400);
  const uint32_t doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
  const uint32_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<int64_t>(doe) - 719468;
}

inline uint32_t DaysInMonth(uint32_t y, uint32_t m) {
  static constexpr uint8_t kDays[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  return m == 2 && leap ? 29 : kDays[m - 1];
}

inline bool IsoHH(const uint8_t* s, int64_t* seconds) {
  uint32_t h;
  if (!FixedDigits(s, 2, &h) || h >= 24) return false;
  *seconds = int64_t{3600} * h;
  return true;
}

inline bool IsoHHMM(const uint8_t* s, bool colon, int64_t* seconds) {
  uint32_t h, m;
  if (colon && s[2] != ':') return false;
  if (!FixedDigits(s, 2, &h) || !FixedDigits(s + (colon ? 3 : 2), 2, &m)) return false;
  if (h >= 24 || m >= 60) return false;
  *seconds = int64_t{3600} * h + int64_t{60} * m;
  return true;
}

inline bool IsoHHMMSS(const uint8_t* s, int64_t* seconds) {
  uint32_t h, m, sec;
  if (s[2] != ':' || s[5] != ':') return false;
  if (!FixedDigits(s, 2, &h) || !FixedDigits(s + 3, 2, &m) || !FixedDigits(s + 6, 2, &sec)) {
    return false;
  }
  if (h >= 24 || m >= 60 || sec >= 60) return false;
  *seconds = int64_t{3600} * h + int64_t{60} * m + sec;
  return true;
}

}  // namespace

bool ParseIso8601Micros(const uint8_t* s, size_t length, int64_t* out) {
  constexpr int64_t kMicros = 1000000;
  if (length < 10) return false;
  if (s[4] != '-' || s[7] != '-') return false;
  uint32_t year, month, day;
  if (!FixedDigits(s, 4, &year) || !FixedDigits(s + 5, 2, &month) ||
      !FixedDigits(s + 8, 2, &day)) {
    return false;
  }
  if (month < 1 || month > 12 || day < 1 || day > DaysInMonth(year, month)) return false;
  int64_t seconds = DaysFromCivil(year, month, day) * 86400;
  if (length == 10) {
    *out = seconds * kMicros;
    return true;
  }
  if (s[10] != ' ' && s[10] != 'T') return false;
  // length >= 11 from here, so s[length - 6] is inside the string.
  int64_t zone = 0;
  if (s[length - 1] == 'Z') {
    --length;
  } else if (s[length - 3] == '+' || s[length - 3] == '-') {
    length -= 3;
    if (!IsoHH(s + length + 1, &zone)) return false;
    if (s[length] == '+') zone = -zone;
  } else if (s[length - 5] == '+' || s[length - 5] == '-') {
    length -= 5;
    if (!IsoHHMM(s + length + 1, false, &zone)) return false;
    if (s[length] == '+') zone = -zone;
  } else if ((s[length - 6] == '+' || s[length - 6] == '-') && s[length - 3] == ':') {
    length -= 6;
    if (!IsoHHMM(s + length + 1, true, &zone)) return false;
    if (s[length] == '+') zone = -zone;
  }
  int64_t time_of_day = 0;
  switch (length) {
    case 13:
      if (!IsoHH(s + 11, &time_of_day)) return false;
      break;
    case 16:
      if (!IsoHHMM(s + 11, true, &time_of_day)) return false;
      break;
    case 19: case 21: case 22: case 23: case 24: case 25: case 26: case 27: case 28: case 29:
      if (!IsoHHMMSS(s + 11, &time_of_day)) return false;
      break;
    default:
      return false;
  }
  seconds += time_of_day + zone;
  if (length <= 19) {
    *out = seconds * kMicros;
    return true;
  }
  if (s[19] != '.') return false;
  const size_t digits = length - 20;  // 1..9
  if (digits > 6) return false;
  uint32_t sub;
  if (!FixedDigits(s + 20, digits, &sub)) return false;
  for (size_t k = digits; k < 6; ++k) sub *= 10;
  *out = seconds * kMicros + sub;
  return true;
}

}  // namespace prefixrec::json::internal
