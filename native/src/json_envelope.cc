// The request envelope scanner (see prefixrec/json_envelope.h).
//
// One iterative walk over the body with the sample decoder's own tokens (internal/json_lexer.h).
// Inside a message it also words its structure errors as the decoder does: at the message
// object's own level a missing comma is "expected ',' or '}' after a field value" (the decoder's
// field loop), deeper it is SkipValue's "in an object" / "in a list"; an error inside a field's
// value names the field. So the reason given for a message equals what JsonSampleDecoder says
// about the message's bytes (tests/native/test_json_envelope.py checks it on mutated bodies).
#include "prefixrec/json_envelope.h"

#include <cstring>
#include <string>
#include <utility>

#include "internal/json_bytes.h"
#include "internal/json_lexer.h"
#include "internal/py_repr.h"
#include "prefixrec/json_samples.h"
#include "prefixrec/store_error.h"

namespace prefixrec::json {
namespace internal {
namespace {

constexpr size_t kPadding = 8;  // zero bytes after a copied body (one is what the lexer reads)

bool IsValueStart(uint8_t c) {
  return c == '{' || c == '[' || c == '"' || c == '-' || IsDigit(c) || c == 't' || c == 'f' ||
         c == 'n' || c == 'N' || c == 'I';
}

class EnvelopeScanner : private Lexer {
 public:
  explicit EnvelopeScanner(const EnvelopeOptions& options)
      : options_(options),
        too_deep_text_("arrays and objects nested deeper than " +
                       std::to_string(options.max_depth) + " levels") {}

  Envelope Run(const uint8_t* begin, const uint8_t* end) {
    StartInput(begin, end);
    Envelope out;
    out.members.resize(options_.members.size());
    const uint8_t* p = begin;
    if (end - p >= 3 && p[0] == 0xEF && p[1] == 0xBB && p[2] == 0xBF) p += 3;  // a UTF-8 BOM
    p = SkipWs(p);
    out.is_object = *p == '{' && p < end;
    p = out.is_object ? Members(p, &out) : Value(p, 0);
    if (p != nullptr) {
      p = SkipWs(p);
      if (p != end) p = Syntax(p, "unexpected data after the JSON value");
    }
    if (p == nullptr) {
      Refuse(&out.error);
      for (EnvelopeMember& m : out.members) m = EnvelopeMember();
      return out;
    }
    out.ok = true;
    return out;
  }

 private:
  // The body's object (level 1): its members, the listed ones' spans recorded.
  const uint8_t* Members(const uint8_t* p, Envelope* out) {
    if (options_.max_depth < 1) return TooDeep(p);
    p = SkipWs(p + 1);
    if (*p == '}') return p + 1;
    for (;;) {
      if (*p != '"') return Syntax(p, "expected a field name in double quotes");
      const uint8_t* key_at = p;
      key_.clear();
      p = ScanString(p + 1, &key_);
      if (p == nullptr) return nullptr;
      p = SkipWs(p);
      if (*p != ':') return Syntax(p, "expected ':' after a field name");
      p = SkipWs(p + 1);
      const int m = Listed();
      if (m < 0) {
        p = Value(p, 1);
      } else {
        EnvelopeMember& member = out->members[static_cast<size_t>(m)];
        if (member.present) {
          custom_what_ = "member " + PyRepr(options_.members[static_cast<size_t>(m)]) +
                         " given twice";
          return Syntax(key_at, custom_what_.c_str());
        }
        member.present = true;
        member.value.begin = static_cast<size_t>(p - begin_);
        member_ = m;
        if (*p == '[') {
          member.is_array = true;
          p = Elements(p, &member);
        } else if (*p == '{') {
          p = Message(p, 1, -1);
        } else {
          p = Value(p, 1);
        }
        if (p == nullptr) return nullptr;
        member_ = -1;
        member.value.end = static_cast<size_t>(p - begin_);
      }
      if (p == nullptr) return nullptr;
      p = SkipWs(p);
      if (*p == ',') {
        p = SkipWs(p + 1);
        continue;
      }
      if (*p == '}') return p + 1;
      return Syntax(p, "expected ',' or '}' in an object");
    }
  }

  int Listed() const {
    for (size_t m = 0; m < options_.members.size(); ++m) {
      const std::string& name = options_.members[m];
      if (name.size() == key_.size() && std::memcmp(name.data(), key_.data(), key_.size()) == 0) {
        return static_cast<int>(m);
      }
    }
    return -1;
  }

  // A listed member's array (level 2): every element is a message.
  const uint8_t* Elements(const uint8_t* p, EnvelopeMember* member) {
    if (options_.max_depth < 2) return TooDeep(p);
    p = SkipWs(p + 1);
    if (*p == ']') return p + 1;
    for (;;) {
      if (!IsValueStart(*p)) return Syntax(p, "expected a value");
      const uint8_t* start = p;
      p = Message(p, 2, static_cast<int64_t>(member->count));
      if (p == nullptr) return nullptr;
      if (member->count < options_.max_elements) {
        member->elements.push_back(
            Span{static_cast<size_t>(start - begin_), static_cast<size_t>(p - begin_)});
      }
      ++member->count;
      p = SkipWs(p);
      if (*p == ',') {
        p = SkipWs(p + 1);
        continue;
      }
      if (*p == ']') return p + 1;
      return Syntax(p, "expected ',' or ']' in a list");
    }
  }

  // One message at p, inside `outer` levels of nesting.
  const uint8_t* Message(const uint8_t* p, size_t outer, int64_t element) {
    message_ = p;
    message_object_ = *p == '{';
    element_ = element;
    in_field_ = false;
    p = Value(p, outer);
    if (p != nullptr) {
      message_ = nullptr;
      element_ = -1;
    }
    return p;
  }

  // At the message object's own level: its fields (the decoder's field loop).
  bool AtMessageFields() const {
    return message_ != nullptr && message_object_ && stack_.size() == 1;
  }

  // One value at p (whitespace skipped) inside `outer` levels of nesting; returns the position
  // after it, or nullptr with the error recorded. Iterative: stack_ holds the closing bracket
  // of every open array or object.
  const uint8_t* Value(const uint8_t* p, size_t outer) {
    stack_.clear();
    for (;;) {
      // A value at p.
      if (*p == '{' || *p == '[') {
        if (outer + stack_.size() + 1 > options_.max_depth) return TooDeep(p);
        const uint8_t close = *p == '{' ? '}' : ']';
        p = SkipWs(p + 1);
        if (*p == close) {
          ++p;
        } else {
          stack_.push_back(close);
          if (close == '}') {
            p = Key(p);
            if (p == nullptr) return nullptr;
          }
          continue;
        }
      } else {
        p = ScanScalar(p, &scratch_);
        if (p == nullptr) return nullptr;
      }
      // After a value: close finished containers, or move to the next element.
      for (;;) {
        if (stack_.size() == 0) return p;
        if (AtMessageFields()) in_field_ = false;
        p = SkipWs(p);
        const uint8_t close = stack_.back();
        if (*p == close) {
          ++p;
          stack_.truncate(stack_.size() - 1);
          continue;
        }
        if (*p != ',') {
          return Syntax(p, close == ']'           ? "expected ',' or ']' in a list"
                           : AtMessageFields() ? "expected ',' or '}' after a field value"
                                               : "expected ',' or '}' in an object");
        }
        p = SkipWs(p + 1);
        if (close == '}') {
          p = Key(p);
          if (p == nullptr) return nullptr;
        }
        break;
      }
    }
  }

  // A key and its colon inside an object; returns the position of the value. At a message's
  // own level the key is kept: an error inside its value names it.
  const uint8_t* Key(const uint8_t* p) {
    if (*p != '"') return Syntax(p, "expected a field name in double quotes");
    const bool field = AtMessageFields();
    PodBuffer<uint8_t>* name = field ? &field_ : &scratch_;
    name->clear();
    p = ScanString(p + 1, name);
    if (p == nullptr) return nullptr;
    p = SkipWs(p);
    if (*p != ':') return Syntax(p, "expected ':' after a field name");
    if (field) in_field_ = true;  // deeper keys are inside the field's value: still named
    return SkipWs(p + 1);
  }

  const uint8_t* TooDeep(const uint8_t* at) {
    too_deep_ = syntax_what_ == nullptr;
    return Syntax(at, too_deep_text_.c_str());
  }

  void Refuse(EnvelopeError* e) const {
    e->what = syntax_what_;
    e->offset = static_cast<size_t>(syntax_at_ - begin_);
    e->at_end = SyntaxAtEnd();
    e->too_deep = too_deep_;
    e->member = member_;
    e->element = message_ != nullptr ? element_ : -1;
    e->in_message = message_ != nullptr;
    if (!e->in_message) return;
    e->message = static_cast<size_t>(message_ - begin_);
    if (too_deep_) return;
    const std::string field =
        in_field_ ? PyRepr(std::string(reinterpret_cast<const char*>(field_.data()),
                                       field_.size()))
                  : std::string();
    e->reason = NotJsonReason(syntax_what_, static_cast<size_t>(syntax_at_ - message_),
                              e->at_end, field);
  }

  const EnvelopeOptions& options_;
  const std::string too_deep_text_;
  std::string custom_what_;
  bool too_deep_ = false;
  PodBuffer<uint8_t> stack_;
  PodBuffer<uint8_t> scratch_;
  PodBuffer<uint8_t> key_;
  PodBuffer<uint8_t> field_;   // the message field whose value is being scanned
  int member_ = -1;            // the listed member being scanned, or -1
  const uint8_t* message_ = nullptr;  // the message being scanned, or nullptr
  bool message_object_ = false;
  int64_t element_ = -1;
  bool in_field_ = false;      // inside the value of field_
};

}  // namespace
}  // namespace internal

Envelope ScanEnvelope(const char* body, size_t size, bool terminated,
                      const EnvelopeOptions& options) {
  if (options.max_depth < 1) {
    throw StoreError(ErrorCode::kInvalidArgument, "max_depth must be at least 1");
  }
  for (size_t i = 0; i < options.members.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (options.members[i] == options.members[j]) {
        throw StoreError(ErrorCode::kInvalidArgument,
                         "member '" + options.members[i] + "' is listed twice");
      }
    }
  }
  const auto* p = reinterpret_cast<const uint8_t*>(body);
  PodBuffer<uint8_t> copy;
  if (!terminated || p[size] != 0) {
    copy.reserve(size + internal::kPadding);
    if (size > 0) std::memcpy(copy.data(), body, size);
    std::memset(copy.data() + size, 0, internal::kPadding);
    p = copy.data();
  }
  return internal::EnvelopeScanner(options).Run(p, p + size);
}

}  // namespace prefixrec::json
