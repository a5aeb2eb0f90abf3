// native._store.scan_json_envelope (facade: native/json_envelope.py): the scan of the
// prediction service's request envelopes, run without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "prefixrec/json_envelope.h"

namespace prefixrec::bindings {
namespace {

namespace pj = prefixrec::json;

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

}  // namespace

void BindJsonEnvelope(py::module_& m) {
  m.def("scan_json_envelope", &ScanJsonEnvelope, py::arg("body"), py::arg("members"),
        py::arg("max_depth"), py::arg("max_elements"));
}

}  // namespace prefixrec::bindings
