// native._store.Store, the binding of EmbeddingStore (facade: native.EmbeddingStore,
// native/store.py), and native._store.scatter_add_rows (facade: native.scatter_add_rows).
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

#include "bindings/bindings.h"
#include "internal/kernels.h"
#include "internal/memory.h"
#include "prefixrec/embedding_store.h"

namespace prefixrec::bindings {
namespace {

using prefixrec::internal::BlockCache;
using prefixrec::internal::LargeBlock;

template <typename T>
py::array_t<T> ToNumpy(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owned->data(), owner);
}

// The ids buffer: 1-D, C-contiguous int64, fewer than 2**32 entries.
// The store's counters, read without the GIL (Stats locks every shard in turn).
prefixrec::StoreStats StatsWithoutGil(const EmbeddingStore& s) {
  py::gil_scoped_release release;
  return s.Stats();
}

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
  d["memory_budget_bytes"] = o.memory_budget_bytes;
  d["disk_dir"] = o.disk_dir;
  d["eviction"] = static_cast<uint32_t>(o.eviction);
  return d;
}

std::unique_ptr<EmbeddingStore> MakeStore(int dim, uint32_t optimizer, std::vector<float> params,
                                          uint32_t initializer, float scale, uint64_t seed,
                                          int num_shards, uint32_t filter, double probability,
                                          uint32_t min_count, uint64_t capacity, double fpr,
                                          uint64_t max_rows, int num_threads,
                                          uint64_t memory_budget_bytes, const std::string& disk_dir,
                                          uint32_t eviction) {
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
  o.memory_budget_bytes = memory_budget_bytes;
  o.disk_dir = disk_dir;
  o.eviction = static_cast<prefixrec::EvictionKind>(eviction);
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

}  // namespace

void BindStore(py::module_& m) {
  py::class_<EmbeddingStore>(m, "Store")
      .def(py::init(&MakeStore), py::arg("dim"), py::arg("optimizer"), py::arg("optimizer_params"),
           py::arg("initializer"), py::arg("initializer_scale"), py::arg("seed"), py::arg("num_shards"),
           py::arg("filter"), py::arg("probability"), py::arg("min_count"), py::arg("capacity"),
           py::arg("false_positive_rate"), py::arg("max_rows"), py::arg("num_threads"),
           py::arg("memory_budget_bytes") = 0, py::arg("disk_dir") = "", py::arg("eviction") = 0)
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
      .def("prefetch",
           [](EmbeddingStore& s, const py::array& ids) {
             auto [data, n] = IdsOf(ids);
             py::gil_scoped_release release;
             return s.Prefetch(data, n);
           },
           py::arg("ids"))
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
      .def("contains",
           [](const EmbeddingStore& s, const py::array& ids) {
             auto [data, n] = IdsOf(ids);
             py::array_t<bool> out(static_cast<py::ssize_t>(n));
             auto* flags = reinterpret_cast<uint8_t*>(out.mutable_data());
             {
               py::gil_scoped_release release;
               s.Contains(data, n, flags);
             }
             return out;
           },
           py::arg("ids"))
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
             const prefixrec::StoreStats st = StatsWithoutGil(s);
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
      .def("tier_stats",  // the two tiers' part of StoreStats (docs/tiered-store.md)
           [](const EmbeddingStore& s) {
             const prefixrec::StoreStats st = StatsWithoutGil(s);
             py::dict d;
             d["memory_rows"] = st.memory_rows;
             d["disk_rows"] = st.disk_rows;
             d["disk_bytes"] = st.disk_bytes;
             d["faults"] = st.faults;
             d["prefetched"] = st.prefetched;
             d["disk_reads"] = st.disk_reads;
             d["disk_writes"] = st.disk_writes;
             d["evicted_to_disk"] = st.evicted_to_disk;
             return d;
           })
      .def("save",
           [](const EmbeddingStore& s, const std::string& dir) {
             py::gil_scoped_release release;
             return s.Save(dir);
           },
           py::arg("dir"))
      .def_static("load",
                  [](const std::string& dir, uint64_t memory_budget_bytes, const std::string& disk_dir,
                     uint32_t eviction) {
                    py::gil_scoped_release release;
                    return EmbeddingStore::Load(dir, memory_budget_bytes, disk_dir,
                                                static_cast<prefixrec::EvictionKind>(eviction));
                  },
                  py::arg("dir"), py::arg("memory_budget_bytes") = 0, py::arg("disk_dir") = "",
                  py::arg("eviction") = 0)
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
             return RebaseStatsDict(stats);
           },
           py::arg("snapshot_dir"), py::arg("path"));
}

void BindScatterAddRows(py::module_& m) {
  m.def("scatter_add_rows", &ScatterAddRows, py::arg("values"), py::arg("index"), py::arg("num_rows"));
}

}  // namespace prefixrec::bindings
