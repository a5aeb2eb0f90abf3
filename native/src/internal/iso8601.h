// ISO-8601 timestamps as pyarrow's JSON reader parses them for a timestamp[us] column.
#ifndef PREFIXREC_INTERNAL_ISO8601_H_
#define PREFIXREC_INTERNAL_ISO8601_H_

#include <cstddef>
#include <cstdint>

namespace prefixrec::json::internal {

// Exactly the grammar of Arrow's ParseTimestampISO8601 (unit: microseconds).
// Accepted: YYYY-MM-DD, then optionally [ T]hh, [ T]hh:mm, [ T]hh:mm:ss or [ T]hh:mm:ss.f{1,6},
// each followed by an optional zone: Z, [+-]hh, [+-]hhmm or [+-]hh:mm (hours < 24, minutes
// < 60, seconds < 60; the date must exist; years 0000-9999). The offset is subtracted: UTC.
// s[0..length) is the decoded string; reads nothing outside it. On success *out is
// microseconds since 1970-01-01T00:00:00Z; on failure *out is left as it was.
bool ParseIso8601Micros(const uint8_t* s, size_t length, int64_t* out);

}  // namespace prefixrec::json::internal

#endif  // PREFIXREC_INTERNAL_ISO8601_H_
