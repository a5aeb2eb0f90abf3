// The emulation of Python's repr() of a str (internal/py_repr.h).
#include "internal/py_repr.h"

#include <doctest/doctest.h>

#include <string>

namespace prefixrec::json::internal {
namespace {

TEST_CASE("PyRepr equals Python's repr() on the strings it is exact for") {
  // The expected texts are what CPython 3.11 prints for repr(s.decode()) (octal escapes keep
  // the bytes exact; \042 is '"', \134 a backslash).
  const struct {
    std::string utf8;
    std::string repr;
  } cases[] = {
      {"", "''"},
      {"abc", "'abc'"},
      {"it's", "\042it's\042"},
      {"say \042hi\042", "'say \042hi\042'"},
      {"both ' and \042", "'both \134' and \042'"},
      {"back\134slash", "'back\134\134slash'"},
      {"tab\011nl\012cr\015", "'tab\134tnl\134ncr\134r'"},
      {std::string("\000\001\037\177", 4), "'\134x00\134x01\134x1f\134x7f'"},
      {"caf\303\251", "'caf\303\251'"},
      {"\302\200\302\205\302\237\302\240\302\241\302\255\302\256",
       "'\134x80\134x85\134x9f\134xa0\302\241\134xad\302\256'"},
      {"\344\270\255\346\226\207", "'\344\270\255\346\226\207'"},
      {"\360\237\230\200", "'\360\237\230\200'"},
      {"a b~", "'a b~'"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.utf8);
    CHECK(PyRepr(c.utf8) == c.repr);
  }
}

TEST_CASE("PyRepr escapes every ASCII control character as Python does") {
  for (int c = 0; c < 0x80; ++c) {
    CAPTURE(c);
    const std::string got = PyRepr(std::string(1, static_cast<char>(c)));
    std::string want;
    if (c == '\t') {
      want = "'\\t'";
    } else if (c == '\n') {
      want = "'\\n'";
    } else if (c == '\r') {
      want = "'\\r'";
    } else if (c == '\\') {
      want = "'\\\\'";
    } else if (c == '\'') {
      want = "\"'\"";
    } else if (c < 0x20 || c == 0x7F) {
      const char* hex = "0123456789abcdef";
      want = std::string("'\\x") + hex[c >> 4] + hex[c & 15] + "'";
    } else {
      want = std::string("'") + static_cast<char>(c) + "'";
    }
    CHECK(got == want);
  }
}

TEST_CASE("PyRepr escapes bytes that are not UTF-8 instead of copying them") {
  // Keys are validated before they reach PyRepr; this only pins that nothing is read past the
  // string and the result stays ASCII for such bytes.
  CHECK(PyRepr("a\377") == "'a\\xff'");
  CHECK(PyRepr("\303") == "'\\xc3'");
  CHECK(PyRepr("\355\240\200") == "'\\xed\\xa0\\x80'");  // a surrogate
}

}  // namespace
}  // namespace prefixrec::json::internal
