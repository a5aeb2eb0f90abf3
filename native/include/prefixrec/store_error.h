// The one exception type the native embedding store throws.
//
// Every failure the caller can cause (bad arguments, corrupt or incompatible files, deltas out
// of order, I/O errors) is a StoreError carrying a code; the Python binding maps each code to
// one Python exception class in a single place (native/src/bindings/module.cc). A method that
// throws leaves the store as it was unless its comment says otherwise.
#ifndef PREFIXREC_STORE_ERROR_H_
#define PREFIXREC_STORE_ERROR_H_

#include <stdexcept>
#include <string>

namespace prefixrec {

enum class ErrorCode {
  kInvalidArgument,  // a bad id, shape, gradient value or option; message names it
  kCorruptFile,      // a snapshot or delta that fails its checksum, magic or structure checks
  kIncompatible,     // a well-formed file written by a store of another dim or optimizer
  kOutOfOrder,       // a delta whose sequence number is not the next one expected
  kIo,               // the operating system refused a read, write, fsync or rename
};

class StoreError : public std::runtime_error {
 public:
  StoreError(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace prefixrec

#endif  // PREFIXREC_STORE_ERROR_H_
