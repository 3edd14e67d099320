// The Python extension weightsync._core: a thin layer over the C++ API.
// The package (python/weightsync) wraps it; logic lives in C++ where the C++
// tests see it, or in the package where it concerns Python objects (torch
// tensors, DTensor meshes).
#pragma once

#include <weightsync/error.h>
#include <weightsync/tensor.h>

#include <nanobind/nanobind.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weightsync::python {

namespace nb = nanobind;

void bind_errors(nb::module_& m);
void bind_layouts(nb::module_& m);
void bind_coordinator(nb::module_& m);
void bind_publisher(nb::module_& m);
void bind_subscriber(nb::module_& m);

// JSON text from Python, parsed; Errc::format naming `what` when malformed.
nlohmann::json parse_json(const std::string& text, const std::string& what);

// A tensor as the package describes it: data pointer, safetensors dtype name,
// shape, strides (elements), device (-1: host memory, else the CUDA ordinal).
TensorView tensor_view(uintptr_t data, const std::string& dtype, const Shape& shape,
                       const Shape& strides, int device, const std::string& what);

// Seconds from Python as milliseconds; Errc::invalid_argument unless positive.
std::chrono::milliseconds millis(double seconds, const char* what);
// The same, where 0 means off.
std::chrono::milliseconds millis_or_zero(double seconds, const char* what);

// Owns a C++ endpoint so that close() can release it (leaving the
// coordinator) before Python's garbage collector would.
template <class T>
class Handle {
 public:
  T& get(const char* what) {
    if (!obj_) fail(Errc::invalid_argument, what, " is closed");
    return *obj_;
  }
  void reset(std::unique_ptr<T> obj) { obj_ = std::move(obj); }
  void close() { obj_.reset(); }
  bool open() const { return obj_ != nullptr; }

 private:
  std::unique_ptr<T> obj_;
};

// Owns a reference to a Python object; released under the GIL (C++ may drop
// the last copy on a thread that does not hold it), never after finalization.
struct PyRef {
  PyObject* obj;
  explicit PyRef(nb::object o) : obj(o.release().ptr()) {}
  ~PyRef() {
    if (!Py_IsInitialized()) return;
    nb::gil_scoped_acquire gil;
    Py_XDECREF(obj);
  }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
};

// `fn` kept for calls from any thread; nullptr for None, Errc::invalid_argument
// naming `what` when it is not callable.
std::shared_ptr<PyRef> callable_ref(nb::object fn, const std::string& what);

// A Python exception in one line, its type and message ("KeyError: 'w'"),
// for a failure reason that travels (step outcomes, the coordinator, logs);
// with the GIL held.
std::string python_error_line(nb::python_error& e);

// A Python callable that C++ may call from any thread: the call takes the GIL,
// and a Python exception becomes a weightsync::Error naming `what`; the last
// reference is dropped under the GIL.
std::function<void(int64_t)> step_callback(nb::object fn, const std::string& what);
// The same over a callable already held (`ref` from callable_ref; null: no hook).
std::function<void(int64_t)> step_callback(std::shared_ptr<PyRef> ref, const std::string& what);

}  // namespace weightsync::python
