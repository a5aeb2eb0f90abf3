// Crash points of the native code's durable and disk-tier writes (native/crash_points.py lists
// every point of the project and what a crash there leaves behind).
#ifndef PREFIXREC_INTERNAL_CRASH_POINT_H_
#define PREFIXREC_INTERNAL_CRASH_POINT_H_

#include <string>

namespace prefixrec::internal {

// PREFIXREC_CRASH_POINT=<name>[:<n>] (read once): the n-th arrival (default the first) at
// `name` ends the process with _exit(86), as if it were killed there.
void CrashPoint(const std::string& name);

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_CRASH_POINT_H_
