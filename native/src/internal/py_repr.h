// Python's repr() of a str, emulated for the decoder's reasons (they quote unknown field names
// as the Python path prints them).
#ifndef PREFIXREC_INTERNAL_PY_REPR_H_
#define PREFIXREC_INTERNAL_PY_REPR_H_

#include <string>

namespace prefixrec::json::internal {

// Python's repr() of a str, for field names in reasons (exact for ASCII; of the non-ASCII
// characters only U+0080..U+00A0 and U+00AD are escaped, where Python escapes every character
// that str.isprintable() rejects). `s` is valid UTF-8 (keys are validated before).
std::string PyRepr(const std::string& s);

}  // namespace prefixrec::json::internal

#endif  // PREFIXREC_INTERNAL_PY_REPR_H_
