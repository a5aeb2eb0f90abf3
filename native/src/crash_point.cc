// Crash points of the native code's durable and disk-tier writes (internal/crash_point.h).
#include "internal/crash_point.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace prefixrec::internal {

// PREFIXREC_CRASH_POINT=<name>[:<n>] (read once): the n-th arrival (default the first) at the
// crash point `name` ends the process with _exit(86), as if it were killed there. The names and
// their meaning are listed in native/crash_points.py.
constexpr int kCrashExitCode = 86;

void CrashPoint(const std::string& name) {
  struct Wanted {
    std::string name;
    uint64_t n = 0;  // 0: no crash point asked for
  };
  static const Wanted wanted = [] {
    Wanted w;
    const char* text = std::getenv("PREFIXREC_CRASH_POINT");
    if (text == nullptr || *text == '\0') return w;
    std::string value(text);
    size_t colon = value.find(':');
    w.name = value.substr(0, colon);
    w.n = 1;
    if (colon != std::string::npos) {
      char* end = nullptr;
      unsigned long long n = std::strtoull(value.c_str() + colon + 1, &end, 10);
      w.n = (end != nullptr && *end == '\0' && end != value.c_str() + colon + 1) ? n : 0;
    }
    return w;
  }();
  static std::atomic<uint64_t> hits{0};
  if (wanted.n == 0 || name != wanted.name) return;
  if (hits.fetch_add(1) + 1 == wanted.n) _exit(kCrashExitCode);
}

}  // namespace prefixrec::internal
