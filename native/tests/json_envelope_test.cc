// The request envelope scanner (prefixrec/json_envelope.h): spans, refusals, nesting without
// recursion, and reasons equal to the sample decoder's for the same message bytes.
#include "prefixrec/json_envelope.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "prefixrec/json_samples.h"
#include "prefixrec/store_error.h"

namespace prefixrec::json {
namespace {

EnvelopeOptions Options(size_t max_depth = 64, size_t max_elements = 10000) {
  EnvelopeOptions o;
  o.members = {"samples", "root", "candidates"};
  o.max_depth = max_depth;
  o.max_elements = max_elements;
  return o;
}

// Scanned from a copy (not NUL-terminated in place), as a non-Python caller would.
Envelope Scan(const std::string& body, const EnvelopeOptions& options = Options()) {
  return ScanEnvelope(body.data(), body.size(), false, options);
}

std::string SpanText(const std::string& body, const Span& s) {
  return body.substr(s.begin, s.end - s.begin);
}

// What the sample decoder says about `message` (one string column, so any field is decoded or
// unknown; syntax reasons do not depend on the columns).
std::string DecoderReason(const std::string& message) {
  const JsonSampleDecoder decoder({{"pid", ColumnKind::kId, ValueType::kString, 0, false}},
                                  size_t{1} << 20);
  const MessageRef ref{message.data(), message.size(), true, false};
  const DecodeOutput out = decoder.Decode(&ref, 1, 1);
  return out.rejected.empty() ? std::string("accepted") : out.rejected[0].reason;
}

TEST_CASE("the listed members' values and their elements come back as spans") {
  const std::string body =
      "\xEF\xBB\xBF {\"trace\": {\"a\": [1, {\"b\": null}]}, \"root\": {\"uid\": 7},\n"
      " \"candidates\": [ {\"item\": 1} , {\"item\": \"\\u00e9\"}, [], 3 ], \"x\": NaN}  ";
  const Envelope e = Scan(body);
  REQUIRE(e.ok);
  CHECK(e.is_object);
  CHECK_FALSE(e.members[0].present);
  REQUIRE(e.members[1].present);
  CHECK(SpanText(body, e.members[1].value) == "{\"uid\": 7}");
  CHECK_FALSE(e.members[1].is_array);
  const EnvelopeMember& c = e.members[2];
  REQUIRE(c.is_array);
  CHECK(c.count == 4);
  REQUIRE(c.elements.size() == 4);
  CHECK(SpanText(body, c.elements[0]) == "{\"item\": 1}");
  CHECK(SpanText(body, c.elements[1]) == "{\"item\": \"\\u00e9\"}");
  CHECK(SpanText(body, c.elements[2]) == "[]");
  CHECK(SpanText(body, c.elements[3]) == "3");
  CHECK(SpanText(body, c.value).front() == '[');
  CHECK(SpanText(body, c.value).back() == ']');
}

TEST_CASE("element spans stop at max_elements, the count goes on") {
  const Envelope e = Scan("{\"samples\": [{}, {}, {}, {}, {}]}", Options(64, 2));
  REQUIRE(e.ok);
  CHECK(e.members[0].count == 5);
  CHECK(e.members[0].elements.size() == 2);
}

TEST_CASE("a body that is not an object is validated but holds no members") {
  const Envelope e = Scan("[{\"samples\": []}]");
  REQUIRE(e.ok);
  CHECK_FALSE(e.is_object);
  CHECK_FALSE(e.members[0].present);
}

TEST_CASE("deep nesting is refused at the limit without recursion") {
  // the three bodies of issue 39: 100,000 nested '[', and samples nested 50,000 deep
  const std::string brackets(100000, '[');
  Envelope e = Scan(brackets);
  REQUIRE_FALSE(e.ok);
  CHECK(e.error.too_deep);
  CHECK(e.error.offset == 64);
  CHECK(e.error.what == "arrays and objects nested deeper than 64 levels");
  CHECK_FALSE(e.error.in_message);

  const std::string deep = "{\"samples\": [" + std::string(50000, '[') + std::string(50000, ']') +
                           "]}";
  e = Scan(deep);
  REQUIRE_FALSE(e.ok);
  CHECK(e.error.too_deep);
  CHECK(e.error.member == 0);
  CHECK(e.error.element == 0);
  CHECK(e.error.in_message);
  CHECK(e.error.message == 13);
  CHECK(e.error.reason.empty());  // the decoder has no nesting limit: no reason of its own

  // level 1 is the body's object, 2 the samples array, 3 a sample, 4 a list in it
  const std::string four = "{\"samples\": [{\"a\": [1]}]}";
  CHECK(Scan(four, Options(4)).ok);
  e = Scan(four, Options(3));
  REQUIRE_FALSE(e.ok);
  CHECK(e.error.offset == four.find("[1]"));
  CHECK(Scan("{}", Options(1)).ok);
  CHECK_FALSE(Scan("{\"samples\": []}", Options(1)).ok);
}

TEST_CASE("a syntax error inside a message gets the decoder's reason for the message's bytes") {
  const std::vector<std::string> samples = {
      R"({"pid": "\ud800"})",              // a lone surrogate: names the field
      R"({"pid": "a\udc00b"})",
      "{\"pid\": \"\xED\xA0\x80\"}",       // an encoded surrogate: invalid UTF-8
      "{\"pid\": \"\xFF\"}",
      R"({"uid": 1 "pid": "a"})",          // the decoder's field loop words
      R"({"uid": 1, "pid": })",
      R"({"uid": [1, 2 3]})",
      R"({"uid": {"a": [}]})",             // deeper: still inside uid's value
      R"({"uid": 1,, "pid": "a"})",
      R"({"uid" 1})",
      R"({"uid": 1e400})",
      R"({"uid": 01})",
      R"({"uid": tru})",
      R"({"u\x": 1})",
      R"([1 2])",
      R"(nul)",
      R"(-)",
  };
  for (const std::string& sample : samples) {
    CAPTURE(sample);
    const std::string body = "{\"samples\": [{}, " + sample + ", {}]}";
    const Envelope e = Scan(body);
    REQUIRE_FALSE(e.ok);
    CHECK(e.error.member == 0);
    CHECK(e.error.element == 1);
    REQUIRE(e.error.in_message);
    CHECK(e.error.message == body.find(sample));
    CHECK(e.error.reason == DecoderReason(body.substr(e.error.message)));
    CHECK(e.error.reason.rfind("not a valid sample: not JSON (", 0) == 0);
  }
  const Envelope e = Scan(std::string("{\"root\": {\"uid\": 1, \"pid\": \"\\ud800\"}, ") +
                          "\"candidates\": []}");
  REQUIRE_FALSE(e.ok);
  CHECK(e.error.member == 1);
  CHECK(e.error.element == -1);
  CHECK(e.error.reason ==
        "not a valid sample: not JSON (invalid surrogate pair in a string at byte 19, in field "
        "'pid')");
}

TEST_CASE("errors outside the messages are the envelope's own") {
  struct Case {
    std::string body;
    std::string what;
    int member;
  };
  const std::vector<Case> cases = {
      {"{\"samples\": [{}, ]}", "expected a value", 0},
      {"{\"samples\": [{} {}]}", "expected ',' or ']' in a list", 0},
      {"{\"samples\": [], \"samples\": []}", "member 'samples' given twice", -1},
      {"{\"samples\": [] \"root\": {}}", "expected ',' or '}' in an object", -1},
      {"{\"other\": \"\\ud800\"}", "invalid surrogate pair in a string", -1},
      {"{\"samples\": 1e400}", "number too big to be stored in a double", 0},
      {"{} {}", "unexpected data after the JSON value", -1},
      {"\xEF\xBB\xBF", "expected a value", -1},
      {"{\"samples\": [\xEF\xBB\xBF{}]}", "expected a value", 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.body);
    const Envelope e = Scan(c.body);
    REQUIRE_FALSE(e.ok);
    CHECK(e.error.what == c.what);
    CHECK(e.error.member == c.member);
    CHECK_FALSE(e.error.in_message);
    CHECK(e.error.reason.empty());
    for (const EnvelopeMember& m : e.members) CHECK_FALSE(m.present);
  }
  const Envelope cut = Scan("{\"samples\": [{\"pid\": \"ab");
  REQUIRE_FALSE(cut.ok);
  CHECK(cut.error.at_end);
  CHECK(cut.error.in_message);
  CHECK(cut.error.reason == "not a valid sample: not JSON (the message ends too early)");
  CHECK(Scan("").error.at_end);
}

TEST_CASE("NUL bytes inside the body are refused, never read past") {
  const std::string body("{\"samples\": [{\"pid\": \"a\0b\"}]}", 29);
  const Envelope e = Scan(body);
  REQUIRE_FALSE(e.ok);
  CHECK(e.error.what == "control character in a string");
  const Envelope in_place = ScanEnvelope(body.c_str(), body.size(), true, Options());
  CHECK(in_place.error.offset == e.error.offset);
}

TEST_CASE("invalid options are refused") {
  EnvelopeOptions o = Options(0);
  CHECK_THROWS_AS(ScanEnvelope("{}", 2, true, o), StoreError);
  o = Options();
  o.members.push_back("root");
  CHECK_THROWS_AS(ScanEnvelope("{}", 2, true, o), StoreError);
}

}  // namespace
}  // namespace prefixrec::json
