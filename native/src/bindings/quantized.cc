// native._store.QuantizedTable, the binding of QuantizedTable (facade: native.QuantizedStore,
// native/quantized.py), and the quantized export functions (quantize_rows, dequantize_rows,
// quantize_snapshot, quantize_delta, read_quantized_delta).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "prefixrec/quantized.h"

namespace prefixrec::bindings {
namespace {

std::pair<const int64_t*, size_t> Ids(const py::array& ids) {
  if (!py::isinstance<py::array_t<int64_t>>(ids) || ids.dtype().kind() != 'i' || ids.itemsize() != 8) {
    Invalid("ids must be an int64 numpy array, got dtype " + std::string(py::str(ids.dtype())));
  }
  if (ids.ndim() != 1) Invalid("ids must be 1-D, got " + std::to_string(ids.ndim()) + " dimensions");
  if (!(ids.flags() & py::array::c_style)) Invalid("ids must be C-contiguous");
  if (static_cast<uint64_t>(ids.shape(0)) >= 0x7fffffffULL) Invalid("at most 2**31 - 2 ids per call");
  return {static_cast<const int64_t*>(ids.data()), static_cast<size_t>(ids.shape(0))};
}

template <typename T>
py::array_t<T> Owned(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owned->data(), owner);
}

// The distinct ids of ids[0..n) in order of first appearance into `unique`, and each id's
// position there into `inverse`: a flat open-addressing table of twice n slots (a request's
// ids, a few thousand: it stays in cache).
void Dedupe(const int64_t* ids, size_t n, std::vector<int64_t>* unique, int64_t* inverse) {
  size_t capacity = 16;
  while (capacity < 2 * n) capacity *= 2;
  const size_t mask = capacity - 1;
  std::vector<int32_t> slots(capacity, -1);
  unique->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    size_t pos = static_cast<size_t>((static_cast<uint64_t>(id) * 0x9e3779b97f4a7c15ULL) >> 32) & mask;
    while (slots[pos] >= 0 && (*unique)[static_cast<size_t>(slots[pos])] != id) pos = (pos + 1) & mask;
    if (slots[pos] < 0) {
      slots[pos] = static_cast<int32_t>(unique->size());
      unique->push_back(id);
    }
    inverse[i] = slots[pos];
  }
}

// Float rows of a file's contents, dequantized without the GIL.
py::dict ContentsDict(QuantizedContents&& c) {
  const size_t n = c.ids.size(), dim = c.dim, row_bytes = QuantRowBytes(c.format, dim);
  std::vector<float> rows(n * dim);
  {
    py::gil_scoped_release release;
    for (size_t i = 0; i < n; ++i) DequantizeRow(c.format, c.rows.data() + i * row_bytes, dim, rows.data() + i * dim);
  }
  py::dict d;
  d["format"] = QuantFormatName(c.format);
  d["dim"] = c.dim;
  d["sequence"] = c.sequence;
  d["global_step"] = c.global_step;
  d["ids"] = Owned(std::move(c.ids), {static_cast<py::ssize_t>(n)});
  d["rows"] = Owned(std::move(rows), {static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(dim)});
  const auto tombstones = static_cast<py::ssize_t>(c.tombstones.size());
  d["tombstones"] = Owned(std::move(c.tombstones), {tombstones});
  d["rebase"] = c.rebase ? py::object(py::int_(c.rebase_sequence)) : py::object(py::none());
  return d;
}

py::array_t<uint8_t> QuantizeRowsPy(const py::array_t<float, py::array::c_style | py::array::forcecast>& rows,
                                    uint32_t code) {
  const QuantFormat format = QuantFormatOf(code);
  if (rows.ndim() != 2 || rows.shape(1) < 1) Invalid("rows must be 2-D [n, dim] with dim >= 1");
  const size_t n = static_cast<size_t>(rows.shape(0)), dim = static_cast<size_t>(rows.shape(1));
  const size_t row_bytes = QuantRowBytes(format, dim);
  py::array_t<uint8_t> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(row_bytes)});
  const float* src = rows.data();
  uint8_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    QuantizeRows(format, src, n, dim, nullptr, dst);
  }
  return out;
}

py::array_t<float> DequantizeRowsPy(const py::array_t<uint8_t, py::array::c_style>& rows, uint32_t code,
                                    size_t dim) {
  const QuantFormat format = QuantFormatOf(code);
  const size_t row_bytes = QuantRowBytes(format, dim);
  if (dim < 1 || rows.ndim() != 2 || static_cast<size_t>(rows.shape(1)) != row_bytes) {
    Invalid("rows must be 2-D [n, " + std::to_string(row_bytes) + "] for " + QuantFormatName(format) +
            " at dim " + std::to_string(dim));
  }
  const size_t n = static_cast<size_t>(rows.shape(0));
  py::array_t<float> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(dim)});
  const uint8_t* src = rows.data();
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    for (size_t i = 0; i < n; ++i) DequantizeRow(format, src + i * row_bytes, dim, dst + i * dim);
  }
  return out;
}

}  // namespace

void BindQuantized(py::module_& m) {
  py::class_<QuantizedTable>(m, "QuantizedTable")
      .def_static("load",
                  [](const std::string& path) {
                    py::gil_scoped_release release;
                    return QuantizedTable::Load(path);
                  },
                  py::arg("path"))
      .def_property_readonly("dim", &QuantizedTable::dim)
      .def_property_readonly("format", [](const QuantizedTable& t) { return QuantFormatName(t.format()); })
      .def("__len__", &QuantizedTable::size)
      .def("lookup",
           [](const QuantizedTable& t, const py::array& ids) {
             auto [data, n] = Ids(ids);
             py::array_t<float> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(t.dim())});
             float* dst = out.mutable_data();
             {
               py::gil_scoped_release release;
               t.Lookup(data, n, dst);
             }
             return out;
           },
           py::arg("ids"))
      .def("contains",
           [](const QuantizedTable& t, const py::array& ids) {
             auto [data, n] = Ids(ids);
             py::array_t<bool> out(static_cast<py::ssize_t>(n));
             auto* flags = reinterpret_cast<uint8_t*>(out.mutable_data());
             {
               py::gil_scoped_release release;
               t.Contains(data, n, flags);
             }
             return out;
           },
           py::arg("ids"))
      .def("lookup_unique",
           [](const QuantizedTable& t, const py::array& ids) {
             auto [data, n] = Ids(ids);
             const auto dim = static_cast<py::ssize_t>(t.dim());
             std::vector<int64_t> unique;
             std::vector<int64_t> inverse(n);
             {
               py::gil_scoped_release release;
               Dedupe(data, n, &unique, inverse.data());
             }
             const auto m = static_cast<py::ssize_t>(unique.size());
             py::array_t<float> rows({m, dim});
             float* dst = rows.mutable_data();
             {
               py::gil_scoped_release release;
               t.Lookup(unique.data(), unique.size(), dst);
             }
             return py::make_tuple(Owned(std::move(unique), {m}),
                                   Owned(std::move(inverse), {static_cast<py::ssize_t>(n)}), rows);
           },
           py::arg("ids"))
      .def("stats",
           [](const QuantizedTable& t) {
             py::dict d;
             d["rows"] = t.size();
             d["bytes"] = t.bytes();
             d["lookups"] = t.lookups();
             d["global_step"] = t.global_step();
             d["delta_sequence"] = t.delta_sequence();
             return d;
           })
      .def("apply_delta",
           [](QuantizedTable& t, const std::string& path) {
             py::gil_scoped_release release;
             return t.ApplyDelta(path);
           },
           py::arg("path"))
      .def("read_delta",
           [](const QuantizedTable& t, const std::string& path, uint64_t ahead) {
             QuantizedContents c;
             {
               py::gil_scoped_release release;
               c = t.ReadDelta(path, ahead);
             }
             return ContentsDict(std::move(c));
           },
           py::arg("path"), py::arg("ahead") = 0)
      .def("write_rebase_delta",
           [](const QuantizedTable& t, const std::string& snapshot_path, const std::string& path) {
             QuantizedTable::RebaseStats stats;
             {
               py::gil_scoped_release release;
               stats = t.WriteRebaseDelta(snapshot_path, path);
             }
             return RebaseStatsDict(stats);
           },
           py::arg("snapshot_path"), py::arg("path"));
  m.def("quantize_rows", &QuantizeRowsPy, py::arg("rows"), py::arg("format"));
  m.def("dequantize_rows", &DequantizeRowsPy, py::arg("rows"), py::arg("format"), py::arg("dim"));
  m.def("quantized_row_bytes",
        [](uint32_t code, size_t dim) { return QuantRowBytes(QuantFormatOf(code), dim); },
        py::arg("format"), py::arg("dim"));
  m.def("quantize_snapshot",
        [](const std::string& snapshot_dir, const std::string& path, uint32_t code) {
          const QuantFormat format = QuantFormatOf(code);
          py::gil_scoped_release release;
          return QuantizeSnapshotFile(snapshot_dir, path, format);
        },
        py::arg("snapshot_dir"), py::arg("path"), py::arg("format"));
  m.def("quantize_delta",
        [](const std::string& delta_path, const std::string& path, uint32_t code) {
          const QuantFormat format = QuantFormatOf(code);
          py::gil_scoped_release release;
          return QuantizeDeltaFile(delta_path, path, format);
        },
        py::arg("delta_path"), py::arg("path"), py::arg("format"));
  m.def("read_quantized_delta",
        [](const std::string& path) {
          QuantizedContents c;
          {
            py::gil_scoped_release release;
            c = ReadQuantizedDelta(path);
          }
          return ContentsDict(std::move(c));
        },
        py::arg("path"));
  m.def("read_quantized_snapshot",
        [](const std::string& path) {
          QuantizedContents c;
          {
            py::gil_scoped_release release;
            c = ReadQuantizedSnapshot(path);
          }
          return ContentsDict(std::move(c));
        },
        py::arg("path"));
}

}  // namespace prefixrec::bindings
