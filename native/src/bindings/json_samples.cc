// native._store.JsonSampleDecoder (facade: native/json_samples.py): JSON sample decoding.
// The messages are taken from a tuple copy of the sequence (so another thread changing the
// caller's list cannot free a bytes object while the GIL is released); the whole decode runs
// without the GIL; the column buffers are handed to numpy without a copy.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "prefixrec/json_samples.h"

namespace prefixrec::bindings {
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

}  // namespace

void BindJsonSamples(py::module_& m) {
  py::class_<pj::JsonSampleDecoder>(m, "JsonSampleDecoder")
      .def(py::init(&MakeJsonDecoder), py::arg("columns"), py::arg("max_message_bytes"))
      .def_property_readonly("max_message_bytes", &pj::JsonSampleDecoder::max_message_bytes)
      .def("decode", &DecodeJson, py::arg("values"), py::arg("num_threads"),
           py::arg("copy_messages") = false)
      .def("decode_spans", &DecodeJsonSpans, py::arg("data"), py::arg("starts"), py::arg("ends"),
           py::arg("num_threads"));
}

}  // namespace prefixrec::bindings
