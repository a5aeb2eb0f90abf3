// The parser behind JsonSampleDecoder: decodes one contiguous range of a batch's messages
// (one thread's share) with the semantics described in prefixrec/json_samples.h.
#ifndef PREFIXREC_INTERNAL_JSON_PARSER_H_
#define PREFIXREC_INTERNAL_JSON_PARSER_H_

#include <cstddef>
#include <vector>

#include "prefixrec/json_samples.h"

namespace prefixrec::json::internal {

// Appends to `out` the accepted rows of messages[begin, end) (in chunks of at most 1 GiB of
// input, so that int32 offsets fit) and a Rejection for every other message. `columns` must
// have passed JsonSampleDecoder's checks. O(input bytes); holds no state between calls.
void DecodeRange(const std::vector<ColumnSpec>& columns, size_t max_message_bytes,
                 const MessageRef* messages, size_t begin, size_t end, DecodeOutput* out);

}  // namespace prefixrec::json::internal

#endif  // PREFIXREC_INTERNAL_JSON_PARSER_H_
