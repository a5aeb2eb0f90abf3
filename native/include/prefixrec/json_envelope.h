// Scanner of a JSON request envelope: one JSON object whose members hold the parts of a request,
// each part one JSON sample message or an array of them, for JsonSampleDecoder to decode.
//
//   body:    {"root": {"uid": 7}, "candidates": [{"item": 1}, {"item": 2}], "trace": "x"}
//   options: members {"root", "candidates"}, max_depth 64, max_elements 10000
//   result:  members[0] root:       value [9, 19)
//            members[1] candidates: value [35, 61), count 2, elements [36, 47) and [49, 60)
//
// The whole body is validated, every member (unknown ones too): the JSON of JsonSampleDecoder
// (internal/json_lexer.h: RFC 8259 plus NaN / Inf / Infinity, valid UTF-8, no lone surrogate
// escapes), an optional leading UTF-8 BOM, and at most max_depth nested arrays and objects
// (the body's object is level 1). Listed members may not be given twice.
//
// A "message" is the value of a listed member when it is an object, or an element of a listed
// member's array. A syntax error inside a message comes with the reason JsonSampleDecoder gives
// for that message's bytes (from its first byte on), so a request's sample is refused in the
// same words as the same sample in a file or a Kafka message.
//
// Complexity: O(body bytes), no recursion (nesting costs one byte of heap per level); memory at
// most two buffers of the body's size plus the kept spans. Holds no Python state: callers
// release the GIL around it. Thread-safe (no shared state).
#ifndef PREFIXREC_JSON_ENVELOPE_H_
#define PREFIXREC_JSON_ENVELOPE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace prefixrec {
namespace json {

struct EnvelopeOptions {
  std::vector<std::string> members;  // top-level members whose spans are wanted
  size_t max_depth = 64;             // deeper nesting of arrays and objects is refused (>= 1)
  size_t max_elements = 10000;       // element spans kept per array member (counting goes on)
};

struct Span {
  size_t begin = 0;  // first byte
  size_t end = 0;    // one past the last byte
};

struct EnvelopeMember {
  bool present = false;
  Span value;                  // the member's value
  bool is_array = false;
  size_t count = 0;            // array: its number of elements
  std::vector<Span> elements;  // array: the spans of its first max_elements elements
};

// Why and where a body is refused.
struct EnvelopeError {
  std::string what;      // e.g. "invalid surrogate pair in a string"
  size_t offset = 0;     // the byte of the body where it was found
  bool at_end = false;   // the body ended first
  bool too_deep = false; // arrays and objects nested deeper than max_depth
  int member = -1;       // index (in EnvelopeOptions::members) of the member holding it, or -1
  int64_t element = -1;  // index of the element of that member's array holding it, or -1
  bool in_message = false;
  size_t message = 0;    // in_message: the message's first byte
  std::string reason;    // in_message and not too_deep: JsonSampleDecoder's reason for the
                         // message's bytes from its first byte on
};

struct Envelope {
  bool ok = false;
  bool is_object = false;               // members are only looked for in an object
  std::vector<EnvelopeMember> members;  // one per EnvelopeOptions::members
  EnvelopeError error;                  // when !ok
};

// Scans body[0, size). `terminated` promises that body[size] is a readable NUL byte (true of
// Python bytes): the body is then scanned in place, else copied into a padded buffer first.
// Throws StoreError(kInvalidArgument) for invalid options (max_depth 0, a member named twice).
Envelope ScanEnvelope(const char* body, size_t size, bool terminated,
                      const EnvelopeOptions& options);

}  // namespace json
}  // namespace prefixrec

#endif  // PREFIXREC_JSON_ENVELOPE_H_
