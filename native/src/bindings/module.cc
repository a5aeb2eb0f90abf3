// The private module native._store: its docstring, the translator of StoreError into the
// Python exceptions of native/errors.py, then each bound class or area (bindings.h), in this
// order.
#include <pybind11/pybind11.h>

#include <exception>

#include "bindings/bindings.h"
#include "prefixrec/store_error.h"

namespace prefixrec::bindings {
namespace {

const char* ErrorClassName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidInputError";
    case ErrorCode::kCorruptFile: return "CorruptFileError";
    case ErrorCode::kIncompatible: return "IncompatibleStoreError";
    case ErrorCode::kOutOfOrder: return "DeltaOrderError";
    case ErrorCode::kIo: return "StoreIOError";
  }
  return "StoreError";
}

}  // namespace

void BindErrors() {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const StoreError& e) {
      py::object cls;
      try {
        cls = py::module_::import("native.errors").attr(ErrorClassName(e.code()));
      } catch (py::error_already_set&) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return;
      }
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
}

}  // namespace prefixrec::bindings

PYBIND11_MODULE(_store, m) {
  namespace b = prefixrec::bindings;
  m.doc() = "Private native core of native.EmbeddingStore; use the facade in native/store.py.";
  b::BindErrors();
  b::BindStore(m);
  b::BindScatterAddRows(m);
  b::BindQuantized(m);
  b::BindJsonSamples(m);
  b::BindJsonEnvelope(m);
}
