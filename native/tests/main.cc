// The C++ unit tests' runner (doctest; `make test-cpp` builds and runs them).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
