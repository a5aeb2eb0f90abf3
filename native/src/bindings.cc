// pybind11 binding of EmbeddingStore as the private module native._store.
//
// This file only converts types, releases the GIL around batch work and turns StoreError into
// the Python exceptions of native/errors.py (in one translator). Argument checking that gives
// friendly messages lives in the facade (native/store.py); the checks here only guarantee that
// native code never sees a buffer of the wrong type or shape.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "internal/kernels.h"
#include "internal/memory.h"
#include "prefixrec/embedding_store.h"

namespace py = pybind11;
using prefixrec::EmbeddingStore;
using prefixrec::ErrorCode;
using prefixrec::StoreError;
using prefixrec::internal::BlockCache;
using prefixrec::internal::LargeBlock;

namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw StoreError(ErrorCode::kInvalidArgument, message);
}

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

template <typename T>
py::array_t<T> ToNumpy(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owned->data(), owner);
}

// The ids buffer: 1-D, C-contiguous int64, fewer than 2**32 entries.
std::pair<const int64_t*, size_t> IdsOf(const py::array& ids) {
  if (!py::isinstance<py::array_t<int64_t>>(ids) || ids.dtype().kind() != 'i' || ids.itemsize() != 8) {
    Invalid("ids must be an int64 numpy array, got dtype " + std::string(py::str(ids.dtype())));
  }
  if (ids.ndim() != 1) Invalid("ids must be 1-D, got " + std::to_string(ids.ndim()) + " dimensions");
  if (!(ids.flags() & py::array::c_style)) Invalid("ids must be C-contiguous");
  if (static_cast<uint64_t>(ids.shape(0)) >= 0xffffffffULL) Invalid("at most 2**32 - 2 ids per call");
  return {static_cast<const int64_t*>(ids.data()), static_cast<size_t>(ids.shape(0))};
}

// Output rows. An output of 2 MiB or more is mapped directly in 2 MiB-aligned, huge-page-advised
// memory (a LargeBlock owned by the array): fresh memory is faulted in on first touch, and with
// 4 KiB pages those faults cost more than the lookup itself on a 25 MB output (each fault is
// taken by the thread that writes that part of the output, in parallel). A freed output's block
// goes to BlockCache and comes back as a later output, already faulted in (1M x 64: lookups
// with each output dropped before the next ran 1.8x faster than with every output fresh).
py::array_t<float> NewRows(size_t n, int dim) {
  const size_t bytes = n * static_cast<size_t>(dim) * sizeof(float);
  std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(dim)};
  if (bytes < LargeBlock::kHugePage) return py::array_t<float>(shape);
  auto block = std::make_unique<LargeBlock>(BlockCache::Take(bytes));
  float* data = reinterpret_cast<float*>(block->data());
  py::capsule owner(block.get(), [](void* p) {
    auto* owned = static_cast<LargeBlock*>(p);
    BlockCache::Give(std::move(*owned));
    delete owned;
  });
  block.release();  // owned by the capsule from here on
  return py::array_t<float>(shape, data, owner);
}

py::dict OptionsDict(const prefixrec::StoreOptions& o) {
  py::dict d;
  d["dim"] = o.dim;
  d["optimizer"] = static_cast<uint32_t>(o.optimizer.kind);
  d["optimizer_params"] = std::vector<float>{
      o.optimizer.learning_rate, o.optimizer.initial_accumulator, o.optimizer.beta1, o.optimizer.beta2,
      o.optimizer.epsilon, o.optimizer.alpha, o.optimizer.beta, o.optimizer.l1, o.optimizer.l2};
  d["initializer"] = static_cast<uint32_t>(o.initializer.kind);
  d["initializer_scale"] = o.initializer.scale;
  d["seed"] = o.seed;
  d["num_shards"] = o.num_shards;
  d["filter"] = static_cast<uint32_t>(o.filter.kind);
  d["probability"] = o.filter.probability;
  d["min_count"] = o.filter.min_count;
  d["capacity"] = o.filter.capacity;
  d["false_positive_rate"] = o.filter.false_positive_rate;
  d["max_rows"] = o.max_rows;
  d["num_threads"] = o.num_threads;
  return d;
}

std::unique_ptr<EmbeddingStore> MakeStore(int dim, uint32_t optimizer, std::vector<float> params,
                                          uint32_t initializer, float scale, uint64_t seed,
                                          int num_shards, uint32_t filter, double probability,
                                          uint32_t min_count, uint64_t capacity, double fpr,
                                          uint64_t max_rows, int num_threads) {
  if (params.size() != 9) Invalid("optimizer_params must have 9 entries");
  prefixrec::StoreOptions o;
  o.dim = dim;
  o.optimizer.kind = static_cast<prefixrec::OptimizerKind>(optimizer);
  o.optimizer.learning_rate = params[0];
  o.optimizer.initial_accumulator = params[1];
  o.optimizer.beta1 = params[2];
  o.optimizer.beta2 = params[3];
  o.optimizer.epsilon = params[4];
  o.optimizer.alpha = params[5];
  o.optimizer.beta = params[6];
  o.optimizer.l1 = params[7];
  o.optimizer.l2 = params[8];
  o.initializer.kind = static_cast<prefixrec::InitializerKind>(initializer);
  o.initializer.scale = scale;
  o.seed = seed;
  o.num_shards = num_shards;
  o.filter.kind = static_cast<prefixrec::FilterKind>(filter);
  o.filter.probability = probability;
  o.filter.min_count = min_count;
  o.filter.capacity = capacity;
  o.filter.false_positive_rate = fpr;
  o.max_rows = max_rows;
  o.num_threads = num_threads;
  return std::make_unique<EmbeddingStore>(o);
}

// scatter_add_rows: see native.scatter_add_rows (native/store.py). Checks every index before
// touching the output, so a bad one raises and writes nothing out of bounds.
template <typename Index>
void AddRowsChecked(float* out, const float* values, const Index* index, size_t n, size_t dim,
                    int64_t num_rows) {
  for (size_t i = 0; i < n; ++i) {
    if (index[i] < 0 || static_cast<int64_t>(index[i]) >= num_rows) {
      Invalid("index[" + std::to_string(i) + "] = " + std::to_string(static_cast<int64_t>(index[i])) +
              " is outside [0, " + std::to_string(num_rows) + ")");
    }
  }
  prefixrec::internal::AddRowsAt(out, values, index, n, dim);
}

py::array_t<float> ScatterAddRows(const py::array& values, const py::array& index, int64_t num_rows) {
  if (!py::isinstance<py::array_t<float>>(values) || values.dtype().kind() != 'f' || values.itemsize() != 4) {
    Invalid("values must be a float32 numpy array, got dtype " + std::string(py::str(values.dtype())));
  }
  if (values.ndim() != 2) Invalid("values must be 2-D, got " + std::to_string(values.ndim()) + " dimensions");
  if (!(values.flags() & py::array::c_style)) Invalid("values must be C-contiguous");
  if (index.ndim() != 1 || index.dtype().kind() != 'i' || (index.itemsize() != 4 && index.itemsize() != 8)) {
    Invalid("index must be a 1-D int32 or int64 numpy array");
  }
  if (!(index.flags() & py::array::c_style)) Invalid("index must be C-contiguous");
  const size_t n = static_cast<size_t>(values.shape(0)), dim = static_cast<size_t>(values.shape(1));
  if (static_cast<size_t>(index.shape(0)) != n) {
    Invalid("index has " + std::to_string(index.shape(0)) + " entries, values " + std::to_string(n) + " rows");
  }
  if (num_rows < 0 || num_rows > (int64_t{1} << 40)) Invalid("num_rows must be in [0, 2**40]");
  py::array_t<float> out({static_cast<py::ssize_t>(num_rows), static_cast<py::ssize_t>(dim)});
  float* dst = out.mutable_data();
  const float* src = static_cast<const float*>(values.data());
  const bool wide = index.itemsize() == 8;
  const void* idx = index.data();
  {
    py::gil_scoped_release release;
    std::fill(dst, dst + static_cast<size_t>(num_rows) * dim, 0.0f);
    if (wide) {
      AddRowsChecked(dst, src, static_cast<const int64_t*>(idx), n, dim, num_rows);
    } else {
      AddRowsChecked(dst, src, static_cast<const int32_t*>(idx), n, dim, num_rows);
    }
  }
  return out;
}

// JSON sample decoding (native.json_samples): defined in the last section of this file.
void BindJsonSamples(py::module_& m);

}  // namespace

PYBIND11_MODULE(_store, m) {
  m.doc() = "Private native core of native.EmbeddingStore; use the facade in native/store.py.";

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

  py::class_<EmbeddingStore>(m, "Store")
      .def(py::init(&MakeStore), py::arg("dim"), py::arg("optimizer"), py::arg("optimizer_params"),
           py::arg("initializer"), py::arg("initializer_scale"), py::arg("seed"), py::arg("num_shards"),
           py::arg("filter"), py::arg("probability"), py::arg("min_count"), py::arg("capacity"),
           py::arg("false_positive_rate"), py::arg("max_rows"), py::arg("num_threads"))
      .def_property_readonly("dim", &EmbeddingStore::dim)
      .def_property_readonly("state_floats", &EmbeddingStore::state_floats)
      .def("options", [](const EmbeddingStore& s) { return OptionsDict(s.options()); })
      .def("__len__", &EmbeddingStore::size)
      .def("lookup",
           [](EmbeddingStore& s, const py::array& ids, bool train, double now) {
             auto [data, n] = IdsOf(ids);
             py::array_t<float> rows = NewRows(n, s.dim());
             float* out = rows.mutable_data();
             {
               py::gil_scoped_release release;
               s.Lookup(data, n, train, now, out);
             }
             return rows;
           },
           py::arg("ids"), py::arg("train"), py::arg("now"))
      .def("lookup_unique",
           [](EmbeddingStore& s, const py::array& ids, bool train, double now) {
             auto [data, n] = IdsOf(ids);
             py::array_t<int64_t> inverse(static_cast<py::ssize_t>(n));
             int64_t* inverse_data = inverse.mutable_data();
             std::vector<int64_t> unique;
             std::vector<float> rows;
             {
               py::gil_scoped_release release;
               s.LookupUnique(data, n, train, now, &unique, inverse_data, &rows);
             }
             auto count = static_cast<py::ssize_t>(unique.size());
             return py::make_tuple(ToNumpy(std::move(unique), {count}), inverse,
                                   ToNumpy(std::move(rows), {count, s.dim()}));
           },
           py::arg("ids"), py::arg("train"), py::arg("now"))
      .def("apply_gradients",
           [](EmbeddingStore& s, const py::array& ids, const py::array& grads, int64_t step, double now,
              double l2) {
             auto [data, n] = IdsOf(ids);
             if (!py::isinstance<py::array_t<float>>(grads) || grads.dtype().kind() != 'f' ||
                 grads.itemsize() != 4) {
               Invalid("grads must be a float32 numpy array");
             }
             if (grads.ndim() != 2 || static_cast<size_t>(grads.shape(0)) != n ||
                 grads.shape(1) != s.dim()) {
               Invalid("grads must have shape (" + std::to_string(n) + ", " + std::to_string(s.dim()) + ")");
             }
             if (!(grads.flags() & py::array::c_style)) Invalid("grads must be C-contiguous");
             const float* g = static_cast<const float*>(grads.data());
             if (!(std::isfinite(l2) && l2 >= 0.0 && l2 <= std::numeric_limits<float>::max())) {
               Invalid("l2 must be a finite number >= 0, got " + std::to_string(l2));
             }
             py::gil_scoped_release release;
             s.ApplyGradients(data, g, n, step, now, static_cast<float>(l2));
           },
           py::arg("ids"), py::arg("grads"), py::arg("step"), py::arg("now"), py::arg("l2") = 0.0)
      .def("expire",
           [](EmbeddingStore& s, int64_t max_idle_steps, double max_idle_seconds, double now) {
             py::gil_scoped_release release;
             return s.Expire(max_idle_steps, max_idle_seconds, now);
           },
           py::arg("max_idle_steps"), py::arg("max_idle_seconds"), py::arg("now"))
      .def("remove",
           [](EmbeddingStore& s, const py::array& ids) {
             auto [data, n] = IdsOf(ids);
             py::gil_scoped_release release;
             return s.Remove(data, n);
           },
           py::arg("ids"))
      .def("rows",
           [](const EmbeddingStore& s, bool with_values) {
             prefixrec::RowArrays rows;
             {
               py::gil_scoped_release release;
               rows = s.ExportRows(with_values);
             }
             auto n = static_cast<py::ssize_t>(rows.ids.size());
             py::dict d;
             d["ids"] = ToNumpy(std::move(rows.ids), {n});
             d["update_counts"] = ToNumpy(std::move(rows.update_counts), {n});
             d["last_steps"] = ToNumpy(std::move(rows.last_steps), {n});
             d["last_times"] = ToNumpy(std::move(rows.last_times), {n});
             d["l2_norms"] = ToNumpy(std::move(rows.l2_norms), {n});
             if (with_values) {
               d["values"] = ToNumpy(std::move(rows.values), {n, s.dim()});
               d["state"] = ToNumpy(std::move(rows.state), {n, s.state_floats()});
             }
             return d;
           },
           py::arg("with_values"))
      .def("filter_state",
           [](const EmbeddingStore& s) {
             prefixrec::FilterState state;
             {
               py::gil_scoped_release release;
               state = s.ExportFilter();
             }
             auto n = static_cast<py::ssize_t>(state.ids.size());
             auto bloom = static_cast<py::ssize_t>(state.bloom.size());
             py::dict d;
             d["ids"] = ToNumpy(std::move(state.ids), {n});
             d["counts"] = ToNumpy(std::move(state.counts), {n});
             d["bloom"] = ToNumpy(std::move(state.bloom), {bloom});
             return d;
           })
      .def("merge_filter_state",
           [](EmbeddingStore& s, const py::array& ids, const py::array& counts, const py::array& bloom) {
             auto [id_data, n] = IdsOf(ids);
             if (!py::isinstance<py::array_t<uint32_t>>(counts) || counts.dtype().kind() != 'u' ||
                 counts.itemsize() != 4) {
               Invalid("counts must be a uint32 numpy array");
             }
             if (counts.ndim() != 1 || static_cast<size_t>(counts.shape(0)) != n) {
               Invalid("counts must have shape (" + std::to_string(n) + ",) like ids");
             }
             if (!(counts.flags() & py::array::c_style)) Invalid("counts must be C-contiguous");
             if (!py::isinstance<py::array_t<uint8_t>>(bloom) || bloom.dtype().kind() != 'u' ||
                 bloom.itemsize() != 1) {
               Invalid("bloom must be a uint8 numpy array");
             }
             if (bloom.ndim() != 1) Invalid("bloom must be 1-D");
             if (!(bloom.flags() & py::array::c_style)) Invalid("bloom must be C-contiguous");
             const uint32_t* count_data = static_cast<const uint32_t*>(counts.data());
             const uint8_t* bloom_data = static_cast<const uint8_t*>(bloom.data());
             auto bloom_size = static_cast<size_t>(bloom.shape(0));
             py::gil_scoped_release release;
             return s.MergeFilter(id_data, count_data, n, bloom_data, bloom_size);
           },
           py::arg("ids"), py::arg("counts"), py::arg("bloom"))
      .def("initial_rows",
           [](const EmbeddingStore& s, const py::array& ids) {
             auto [data, n] = IdsOf(ids);
             py::array_t<float> rows = NewRows(n, s.dim());
             float* out = rows.mutable_data();
             py::gil_scoped_release release;
             s.InitialRows(data, n, out);
             return rows;
           },
           py::arg("ids"))
      .def("stats",
           [](const EmbeddingStore& s) {
             prefixrec::StoreStats st;
             {
               py::gil_scoped_release release;
               st = s.Stats();
             }
             py::dict d;
             d["rows"] = st.rows;
             d["bytes"] = st.bytes;
             d["filter_bytes"] = st.filter_bytes;
             d["admitted"] = st.admitted;
             d["rejected"] = st.rejected;
             d["expired"] = st.expired;
             d["evicted"] = st.evicted;
             d["lookups"] = st.lookups;
             d["updates"] = st.updates;
             d["global_step"] = st.global_step;
             d["delta_sequence"] = st.delta_sequence;
             return d;
           })
      .def("save",
           [](const EmbeddingStore& s, const std::string& dir) {
             py::gil_scoped_release release;
             return s.Save(dir);
           },
           py::arg("dir"))
      .def_static("load",
                  [](const std::string& dir) {
                    py::gil_scoped_release release;
                    return EmbeddingStore::Load(dir);
                  },
                  py::arg("dir"))
      .def("export_delta",
           [](EmbeddingStore& s, const std::string& dir) {
             uint64_t bytes = 0;
             std::string path;
             {
               py::gil_scoped_release release;
               path = s.ExportDelta(dir, &bytes);
             }
             return py::make_tuple(path, bytes);
           },
           py::arg("dir"))
      .def("apply_delta",
           [](EmbeddingStore& s, const std::string& path) {
             py::gil_scoped_release release;
             return s.ApplyDelta(path);
           },
           py::arg("path"))
      .def("read_delta",
           [](const EmbeddingStore& s, const std::string& path, uint64_t ahead) {
             auto c = std::make_unique<EmbeddingStore::DeltaContents>();
             {
               py::gil_scoped_release release;
               *c = s.ReadDelta(path, ahead);
             }
             // The arrays share the vectors' memory (a rebase delta holds a table's rows):
             // the capsule owns the contents until the last array goes.
             EmbeddingStore::DeltaContents* owned = c.get();
             py::capsule owner(c.release(), [](void* p) {
               delete static_cast<EmbeddingStore::DeltaContents*>(p);
             });
             const auto n = static_cast<py::ssize_t>(owned->ids.size());
             const auto dim = static_cast<py::ssize_t>(s.dim());
             py::dict d;
             d["sequence"] = owned->sequence;
             d["global_step"] = owned->global_step;
             d["ids"] = py::array_t<int64_t>({n}, owned->ids.data(), owner);
             d["rows"] = py::array_t<float>({n, dim}, owned->embeddings.data(), owner);
             d["tombstones"] = py::array_t<int64_t>(
                 {static_cast<py::ssize_t>(owned->tombstones.size())}, owned->tombstones.data(),
                 owner);
             d["rebase"] = owned->rebase ? py::object(py::int_(owned->rebase_sequence))
                                         : py::object(py::none());
             return d;
           },
           py::arg("path"), py::arg("ahead") = 0)
      .def("write_rebase_delta",
           [](const EmbeddingStore& s, const std::string& snapshot_dir, const std::string& path) {
             EmbeddingStore::RebaseStats stats;
             {
               py::gil_scoped_release release;
               stats = s.WriteRebaseDelta(snapshot_dir, path);
             }
             py::dict d;
             d["rows"] = stats.rows;
             d["tombstones"] = stats.tombstones;
             d["unchanged"] = stats.unchanged;
             d["bytes"] = stats.bytes;
             return d;
           },
           py::arg("snapshot_dir"), py::arg("path"));

  m.def("scatter_add_rows", &ScatterAddRows, py::arg("values"), py::arg("index"), py::arg("num_rows"));

  BindJsonSamples(m);
}

// ---------------------------------------------------------------------------------------------
// JSON sample decoding: native._store.JsonSampleDecoder (facade: native/json_samples.py) and
// the request envelope scan: native._store.scan_json_envelope (facade: native/json_envelope.py).
// The messages are taken from a tuple copy of the sequence (so another thread changing the
// caller's list cannot free a bytes object while the GIL is released); the whole decode runs
// without the GIL; the column buffers are handed to numpy without a copy.
// ---------------------------------------------------------------------------------------------
#include "prefixrec/json_envelope.h"
#include "prefixrec/json_samples.h"

namespace {

namespace pj = prefixrec::json;

template <typename T>
py::array_t<T> Release(pj::PodBuffer<T>& buffer) {
  const auto n = static_cast<py::ssize_t>(buffer.size());
  T* data = buffer.release();
  py::capsule owner(data, [](void* p) { std::free(p); });
  return py::array_t<T>({n}, data, owner);
}

py::tuple ColumnArrays(const pj::ColumnSpec& spec, pj::ColumnData& d) {
  const bool strings = spec.type == pj::ValueType::kString;
  switch (spec.kind) {
    case pj::ColumnKind::kId:
      if (strings) return py::make_tuple(Release(d.str_offsets), Release(d.str_data));
      return py::make_tuple(Release(d.ints));
    case pj::ColumnKind::kIds:
      if (strings) {
        return py::make_tuple(Release(d.offsets), Release(d.str_offsets), Release(d.str_data));
      }
      return py::make_tuple(Release(d.offsets), Release(d.ints));
    case pj::ColumnKind::kDense:
      return py::make_tuple(Release(d.offsets), Release(d.floats));
    case pj::ColumnKind::kLabel:
      return py::make_tuple(Release(d.floats));
    case pj::ColumnKind::kCarried: {
      // The validity bitmap only when the chunk has a null in this column (None: all valid).
      py::object validity = py::none();
      if (d.nulls > 0) validity = Release(d.validity);
      if (strings) return py::make_tuple(validity, Release(d.str_offsets), Release(d.str_data));
      if (spec.type == pj::ValueType::kFloat64) return py::make_tuple(validity, Release(d.doubles));
      return py::make_tuple(validity, Release(d.ints));  // int64, timestamp (microseconds)
    }
  }
  return py::tuple();
}

std::unique_ptr<pj::JsonSampleDecoder> MakeJsonDecoder(const py::list& columns,
                                                      size_t max_message_bytes) {
  std::vector<pj::ColumnSpec> specs;
  for (const py::handle item : columns) {
    auto t = item.cast<std::tuple<std::string, int, int, int, bool>>();
    pj::ColumnSpec spec;
    spec.name = std::get<0>(t);
    const int kind = std::get<1>(t), type = std::get<2>(t);
    if (kind < 0 || kind > 4 || type < 0 || type > 4) Invalid("column " + spec.name + ": bad kind/type code");
    spec.kind = static_cast<pj::ColumnKind>(kind);
    spec.type = static_cast<pj::ValueType>(type);
    spec.dim = std::get<3>(t);
    spec.is_key = std::get<4>(t);
    specs.push_back(std::move(spec));
  }
  return std::make_unique<pj::JsonSampleDecoder>(std::move(specs), max_message_bytes);
}

py::tuple DecodeResult(const pj::JsonSampleDecoder& decoder, pj::DecodeOutput& out);

// copy_messages (tests only): parse copies of the messages in zero-padded buffers, as the
// decoder does for messages that are not NUL-terminated, instead of the bytes in place.
py::tuple DecodeJson(const pj::JsonSampleDecoder& decoder, const py::handle& values,
                     int num_threads, bool copy_messages) {
  PyObject* seq = PySequence_Tuple(values.ptr());
  if (seq == nullptr) throw py::error_already_set();
  py::tuple items = py::reinterpret_steal<py::tuple>(seq);
  const size_t n = items.size();
  std::vector<pj::MessageRef> refs(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* o = PyTuple_GET_ITEM(seq, static_cast<py::ssize_t>(i));
    if (o == Py_None) continue;
    if (!PyBytes_Check(o)) {
      Invalid("values[" + std::to_string(i) + "] must be bytes or None, got " +
              std::string(Py_TYPE(o)->tp_name));
    }
    // CPython keeps a NUL after the bytes of every bytes object (terminated = true).
    refs[i] = pj::MessageRef{PyBytes_AS_STRING(o), static_cast<size_t>(PyBytes_GET_SIZE(o)), true,
                             !copy_messages};
  }
  pj::DecodeOutput out;
  {
    py::gil_scoped_release release;
    out = decoder.Decode(refs.data(), n, num_threads);
  }
  return DecodeResult(decoder, out);
}

// A decode's output as (chunks, rejected index, reasons); the buffers go to numpy uncopied.
py::tuple DecodeResult(const pj::JsonSampleDecoder& decoder, pj::DecodeOutput& out) {
  const auto& specs = decoder.columns();
  py::list chunks;
  for (auto& chunk : out.chunks) {
    py::list columns;
    for (size_t c = 0; c < specs.size(); ++c) columns.append(ColumnArrays(specs[c], chunk.columns[c]));
    chunks.append(py::make_tuple(Release(chunk.messages), columns));
  }
  py::array_t<int64_t> rejected(static_cast<py::ssize_t>(out.rejected.size()));
  int64_t* index = rejected.mutable_data();
  py::list reasons;
  for (size_t k = 0; k < out.rejected.size(); ++k) {
    index[k] = out.rejected[k].message;
    const std::string& r = out.rejected[k].reason;
    PyObject* text = PyUnicode_DecodeUTF8(r.data(), static_cast<py::ssize_t>(r.size()), "replace");
    if (text == nullptr) throw py::error_already_set();
    reasons.append(py::reinterpret_steal<py::str>(text));
  }
  return py::make_tuple(chunks, rejected, reasons);
}

// spans of one bytes object: the messages data[starts[i]:ends[i]] (int64 offsets, checked).
py::tuple DecodeJsonSpans(const pj::JsonSampleDecoder& decoder, const py::bytes& data,
                          const py::array& starts, const py::array& ends, int num_threads) {
  for (const py::array* a : {&starts, &ends}) {
    if (a->ndim() != 1 || a->dtype().kind() != 'i' || a->itemsize() != 8 ||
        !(a->flags() & py::array::c_style)) {
      Invalid("starts and ends must be 1-D C-contiguous int64 arrays");
    }
  }
  const size_t n = static_cast<size_t>(starts.shape(0));
  if (static_cast<size_t>(ends.shape(0)) != n) {
    Invalid("starts has " + std::to_string(n) + " entries, ends " + std::to_string(ends.shape(0)));
  }
  const char* base = PyBytes_AS_STRING(data.ptr());
  const auto size = static_cast<int64_t>(PyBytes_GET_SIZE(data.ptr()));
  const auto* s = static_cast<const int64_t*>(starts.data());
  const auto* e = static_cast<const int64_t*>(ends.data());
  std::vector<pj::MessageRef> refs(n);
  for (size_t i = 0; i < n; ++i) {
    if (s[i] < 0 || s[i] > e[i] || e[i] > size) {
      Invalid("span " + std::to_string(i) + " [" + std::to_string(s[i]) + ", " +
              std::to_string(e[i]) + ") is not inside the " + std::to_string(size) + " bytes");
    }
    // only the last span of the bytes is followed by the NUL CPython keeps after them
    refs[i] = pj::MessageRef{base + s[i], static_cast<size_t>(e[i] - s[i]), true, e[i] == size};
  }
  pj::DecodeOutput out;
  {
    py::gil_scoped_release release;
    out = decoder.Decode(refs.data(), n, num_threads);
  }
  return DecodeResult(decoder, out);
}

// The envelope scan: (ok, is_object, members, error); members: one (present, begin, end,
// is_array, count, element starts, element ends) per name; error: None or (what, offset,
// at_end, too_deep, member, element, in_message, message, reason).
py::tuple ScanJsonEnvelope(const py::bytes& body, const std::vector<std::string>& members,
                           size_t max_depth, size_t max_elements) {
  pj::EnvelopeOptions options;
  options.members = members;
  options.max_depth = max_depth;
  options.max_elements = max_elements;
  const char* data = PyBytes_AS_STRING(body.ptr());
  const auto size = static_cast<size_t>(PyBytes_GET_SIZE(body.ptr()));
  pj::Envelope out;
  {
    py::gil_scoped_release release;
    out = pj::ScanEnvelope(data, size, true, options);
  }
  py::list spans;
  for (const pj::EnvelopeMember& m : out.members) {
    const auto count = static_cast<py::ssize_t>(m.elements.size());
    py::array_t<int64_t> begins(count), ends(count);
    int64_t* b = begins.mutable_data();
    int64_t* e = ends.mutable_data();
    for (py::ssize_t i = 0; i < count; ++i) {
      b[i] = static_cast<int64_t>(m.elements[static_cast<size_t>(i)].begin);
      e[i] = static_cast<int64_t>(m.elements[static_cast<size_t>(i)].end);
    }
    spans.append(py::make_tuple(m.present, m.value.begin, m.value.end, m.is_array, m.count,
                                begins, ends));
  }
  py::object error = py::none();
  if (!out.ok) {
    const pj::EnvelopeError& e = out.error;
    // the texts are UTF-8 (field names were validated); "replace" guards the conversion anyway
    auto text = [](const std::string& t) {
      PyObject* o = PyUnicode_DecodeUTF8(t.data(), static_cast<py::ssize_t>(t.size()), "replace");
      if (o == nullptr) throw py::error_already_set();
      return py::reinterpret_steal<py::str>(o);
    };
    error = py::make_tuple(text(e.what), e.offset, e.at_end, e.too_deep, e.member, e.element,
                           e.in_message, e.message, text(e.reason));
  }
  return py::make_tuple(out.ok, out.is_object, spans, error);
}

void BindJsonSamples(py::module_& m) {
  py::class_<pj::JsonSampleDecoder>(m, "JsonSampleDecoder")
      .def(py::init(&MakeJsonDecoder), py::arg("columns"), py::arg("max_message_bytes"))
      .def_property_readonly("max_message_bytes", &pj::JsonSampleDecoder::max_message_bytes)
      .def("decode", &DecodeJson, py::arg("values"), py::arg("num_threads"),
           py::arg("copy_messages") = false)
      .def("decode_spans", &DecodeJsonSpans, py::arg("data"), py::arg("starts"), py::arg("ends"),
           py::arg("num_threads"));
  m.def("scan_json_envelope", &ScanJsonEnvelope, py::arg("body"), py::arg("members"),
        py::arg("max_depth"), py::arg("max_elements"));
}

}  // namespace
