#include "bindings.h"

#include <nlohmann/json.hpp>

#include <weightsync/dtype.h>

#include <nanobind/stl/string.h>

namespace weightsync::python {

nlohmann::json parse_json(const std::string& text, const std::string& what) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(Errc::format, what, " is not valid JSON: ", e.what());
  }
}

std::chrono::milliseconds millis(double seconds, const char* what) {
  if (!(seconds > 0)) fail(Errc::invalid_argument, what, " must be positive, got ", seconds, " s");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

std::chrono::milliseconds millis_or_zero(double seconds, const char* what) {
  if (!(seconds >= 0))
    fail(Errc::invalid_argument, what, " must be 0 (off) or positive, got ", seconds, " s");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

TensorView tensor_view(uintptr_t data, const std::string& dtype, const Shape& shape,
                       const Shape& strides, int device, const std::string& what) {
  TensorView v;
  v.data = reinterpret_cast<void*>(data);
  v.dtype = dtype_from_name(dtype, what);
  v.shape = shape;
  if (strides.size() != shape.size())
    fail(Errc::invalid_argument, what, ": ", strides.size(), " strides for shape ",
         shape_str(shape));
  if (strides != contiguous_strides(shape)) v.strides = strides;
  v.memory = device < 0 ? MemoryKind::host : MemoryKind::cuda;
  v.device = device;
  return v;
}

std::shared_ptr<PyRef> callable_ref(nb::object fn, const std::string& what) {
  if (!fn.is_valid() || fn.is_none()) return nullptr;
  if (!PyCallable_Check(fn.ptr())) fail(Errc::invalid_argument, what, ": not callable");
  return std::make_shared<PyRef>(std::move(fn));
}

std::string python_error_line(nb::python_error& e) {
  try {
    const std::string type = nb::cast<std::string>(e.type().attr("__name__"));
    const std::string message = nb::cast<std::string>(nb::str(e.value()));
    return message.empty() ? type : type + ": " + message;
  } catch (const std::exception&) {
    return e.what();  // the formatted exception, traceback and all
  }
}

std::function<void(int64_t)> step_callback(nb::object fn, const std::string& what) {
  return step_callback(callable_ref(std::move(fn), what), what);
}

std::function<void(int64_t)> step_callback(std::shared_ptr<PyRef> ref, const std::string& what) {
  if (!ref) return {};
  return [ref, what](int64_t step) {
    nb::gil_scoped_acquire gil;
    try {
      nb::handle(ref->obj)(step);
    } catch (nb::python_error& e) {
      // Converted while the GIL is held: the Python exception dies here.
      fail(Errc::cancelled, what, " raised ", python_error_line(e));
    }
  };
}

void bind_errors(nb::module_& m) {
  // weightsync.Error (python/weightsync/_errors.py) carries the code's name.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      nb::object cls = nb::module_::import_("weightsync._errors").attr("Error");
      nb::object exc = cls(std::string(errc_name(e.code())), e.what());
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
}

}  // namespace weightsync::python

NB_MODULE(_core, m) {
  using namespace weightsync::python;
  m.doc() = "weightsync's C++ library (use the `weightsync` package, not this module)";
  bind_errors(m);
  bind_layouts(m);
  bind_coordinator(m);
  bind_publisher(m);
  bind_subscriber(m);
}
