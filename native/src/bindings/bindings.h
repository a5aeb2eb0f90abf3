// The pybind11 binding of the native core as the private module native._store: one
// registration function per bound class or area, each in its own file, called in turn by the
// module definition (module.cc).
//
// The binding only converts types, releases the GIL around batch work and turns StoreError into
// the Python exceptions of native/errors.py (in one translator, BindErrors). Argument checking
// that gives friendly messages lives in the facades (native/store.py, native/json_samples.py,
// native/json_envelope.py); the checks here only guarantee that native code never sees a
// buffer of the wrong type or shape.
#ifndef PREFIXREC_BINDINGS_BINDINGS_H_
#define PREFIXREC_BINDINGS_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <string>

#include "prefixrec/store_error.h"

namespace prefixrec::bindings {

namespace py = pybind11;

// A bad argument: raised in Python as native.errors.InvalidInputError (see BindErrors).
[[noreturn]] inline void Invalid(const std::string& message) {
  throw StoreError(ErrorCode::kInvalidArgument, message);
}

// A rebase delta's counts (EmbeddingStore::RebaseStats, QuantizedTable::RebaseStats) as the
// dict write_rebase_delta returns: rows, tombstones, unchanged, bytes.
template <typename Stats>
py::dict RebaseStatsDict(const Stats& stats) {
  py::dict d;
  d["rows"] = stats.rows;
  d["tombstones"] = stats.tombstones;
  d["unchanged"] = stats.unchanged;
  d["bytes"] = stats.bytes;
  return d;
}

// The translator of StoreError into the classes of native/errors.py (module.cc); pybind11
// keeps it for the whole process, so it takes no module.
void BindErrors();
// native._store.Store (facade: native.EmbeddingStore, native/store.py) (store.cc).
void BindStore(py::module_& m);
// native._store.scatter_add_rows (facade: native.scatter_add_rows, native/store.py) (store.cc).
void BindScatterAddRows(py::module_& m);
// native._store.QuantizedTable and the quantized export functions (facade: native/quantized.py)
// (quantized.cc).
void BindQuantized(py::module_& m);
// native._store.JsonSampleDecoder (facade: native/json_samples.py) (json_samples.cc).
void BindJsonSamples(py::module_& m);
// native._store.scan_json_envelope (facade: native/json_envelope.py) (json_envelope.cc).
void BindJsonEnvelope(py::module_& m);

}  // namespace prefixrec::bindings

#endif  // PREFIXREC_BINDINGS_BINDINGS_H_
