// The engine side. Every call that waits releases the GIL; hooks take it back.
#include "bindings.h"

#include <weightsync/engine_layout.h>
#include <weightsync/layouts.h>
#include <weightsync/subscriber.h>

#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <tuple>

namespace weightsync::python {
namespace {

using ReleaseGil = nb::call_guard<nb::gil_scoped_release>;

double seconds(std::chrono::milliseconds ms) {
  return static_cast<double>(ms.count()) / 1000.0;
}

// DLPack's code for a dtype (the torch tensors handed to on_weights come from
// DLPack capsules).
nb::dlpack::dtype dlpack_dtype(DType d) {
  using C = nb::dlpack::dtype_code;
  C code = C::Float;
  switch (d) {
    case DType::BOOL:
      code = C::Bool;
      break;
    case DType::U8:
    case DType::U16:
    case DType::U32:
    case DType::U64:
      code = C::UInt;
      break;
    case DType::I8:
    case DType::I16:
    case DType::I32:
    case DType::I64:
      code = C::Int;
      break;
    case DType::F16:
    case DType::F32:
    case DType::F64:
      code = C::Float;
      break;
    case DType::BF16:
      code = C::Bfloat;
      break;
    case DType::F8_E4M3:
      code = C::Float8_E4M3FN;
      break;
    case DType::F8_E5M2:
      code = C::Float8_E5M2;
      break;
    case DType::F8_E8M0:
      code = C::Float8_E8M0FNU;
      break;
  }
  return {static_cast<uint8_t>(code), static_cast<uint8_t>(8 * itemsize(d)), 1};
}

// A torch tensor over `v`'s memory: no copy, no ownership (valid while the
// memory is; for on_weights, the duration of the call).
nb::object torch_view(const TensorView& v) {
  std::vector<size_t> shape(v.shape.begin(), v.shape.end());
  const Shape strides = v.effective_strides();
  const bool cuda = v.memory == MemoryKind::cuda;
  nb::ndarray<nb::pytorch> a(
      v.data, shape.size(), shape.data(), nb::handle(), strides.data(), dlpack_dtype(v.dtype),
      cuda ? nb::device::cuda::value : nb::device::cpu::value, cuda ? v.device : 0);
  return nb::cast(a);
}

// on_weights for Python: fn(batch), batch a list of (hf_key, torch.Tensor),
// as model.load_weights takes them.
Subscriber::WeightsHook weights_callback(std::shared_ptr<PyRef> ref) {
  if (!ref) return {};
  return [ref](int64_t, const std::vector<std::pair<std::string, TensorView>>& tensors) {
    nb::gil_scoped_acquire gil;
    try {
      nb::list batch;
      for (const auto& [name, view] : tensors) batch.append(nb::make_tuple(name, torch_view(view)));
      nb::handle(ref->obj)(batch);
    } catch (nb::python_error& e) {  // converted while the GIL is held
      fail(Errc::cancelled, "the on_weights hook raised ", python_error_line(e));
    } catch (const std::exception& e) {
      fail(Errc::cancelled, "handing tensors to the on_weights hook failed: ", e.what());
    }
  };
}

class PySubscriber : public Handle<Subscriber> {
 public:
  enum Hook { kBegin, kEnd, kWeights, kLoaded, kHooks };

  void open(const SubscriberOptions& options) { reset(std::make_unique<Subscriber>(options)); }
  // The Python callable behind hook `h` (null: none), set or replaced; the
  // C++ hook holds the same reference.
  std::shared_ptr<PyRef> set_hook(Hook h, nb::object fn, const char* what) {
    get("subscriber");  // a closed one is refused before anything is kept
    hooks_[h] = callable_ref(std::move(fn), what);
    return hooks_[h];
  }

  // Python's garbage collector sees the hooks through these: a hook that
  // refers back to its Subscriber (a closure over it, a bound method of an
  // object that holds it) would otherwise make a cycle that nothing collects,
  // which nanobind reports as a leak at exit.
  static int traverse(PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(Py_TYPE(self));
    if (!nb::inst_ready(self)) return 0;
    for (const auto& ref : nb::inst_ptr<PySubscriber>(self)->hooks_)
      if (ref) Py_VISIT(ref->obj);
    return 0;
  }
  // Breaks such a cycle: the subscriber is closed (its C++ hooks, which hold
  // the same references, go with it), then the references are dropped.
  static int clear(PyObject* self) {
    auto* s = nb::inst_ptr<PySubscriber>(self);
    {
      nb::gil_scoped_release release;  // closing may wait for a hook on another thread
      s->close();
    }
    for (auto& ref : s->hooks_) ref.reset();
    return 0;
  }
  void register_param(const std::string& name, uintptr_t data, const std::string& dtype,
                      const Shape& shape, const Shape& strides, int device) {
    get("subscriber")
        .register_param(
            name, tensor_view(data, dtype, shape, strides, device, "engine param '" + name + "'"));
  }
  std::optional<StepOutcome> run_step(double timeout) {
    return get("subscriber").run_step(millis(timeout, "timeout"));
  }
  // The layout of this rank: (name, dtype, shape) of every param it holds.
  std::vector<std::tuple<std::string, std::string, Shape>> params() {
    std::vector<std::tuple<std::string, std::string, Shape>> out;
    for (const EngineParam& p : get("subscriber").layout().params)
      out.emplace_back(p.name, std::string(dtype_name(p.dtype)), p.shape);
    return out;
  }

 private:
  std::array<std::shared_ptr<PyRef>, kHooks> hooks_;
};

PyType_Slot subscriber_slots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(&PySubscriber::traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(&PySubscriber::clear)},
    {0, nullptr}};

nb::dict step_phases(const StepPhases& p) {
  nb::dict d;
  d["receive"] = p.receive;
  d["verify"] = p.verify;
  d["apply"] = p.apply;
  d["commit"] = p.commit;
  return d;
}

// SubscriberOptions: the engine config set as JSON text (the package reads
// files and dicts), timeouts in seconds.
void bind_subscriber_options(nb::module_& m) {
  using O = SubscriberOptions;
  nb::class_<O>(m, "SubscriberOptions")
      .def(nb::init<>())
      .def_rw("coordinator", &O::coordinator)
      .def_rw("token", &O::token)
      .def(
          "set_engine",
          [](O& o, const std::string& engine, const std::string& base_dir) {
            o.engine = engine_spec_from_json(parse_json(engine, "engine config"), base_dir);
          },
          nb::arg("engine"), nb::arg("base_dir"))
      .def_rw("replica", &O::replica)
      .def_rw("rank", &O::rank)
      .def_rw("transport", &O::transport)
      .def_rw("staging", &O::staging)
      .def_rw("weights_device", &O::weights_device)
      .def_rw("job", &O::job)
      .def_rw("parity", &O::parity)
      .def_prop_rw(
          "connect_timeout", [](const O& o) { return seconds(o.connect_timeout); },
          [](O& o, double s) { o.connect_timeout = millis(s, "connect_timeout"); })
      .def_prop_rw(
          "step_timeout", [](const O& o) { return seconds(o.step_timeout); },
          [](O& o, double s) { o.step_timeout = millis(s, "step_timeout"); })
      .def_prop_rw(
          "coordinator_reconnect", [](const O& o) { return seconds(o.coordinator_reconnect); },
          [](O& o, double s) {
            o.coordinator_reconnect = millis_or_zero(s, "coordinator_reconnect");
          });
}

void bind_outcome(nb::module_& m) {
  nb::class_<StepOutcome>(m, "StepOutcome")
      .def_ro("step", &StepOutcome::step)
      .def_ro("committed", &StepOutcome::committed)
      .def_ro("reason", &StepOutcome::reason)
      .def_ro("bytes", &StepOutcome::bytes)
      .def_ro("bytes_direct", &StepOutcome::bytes_direct)
      .def_ro("buckets_lent", &StepOutcome::buckets_lent)
      .def_ro("delta_buckets", &StepOutcome::delta_buckets)
      .def_ro("weights_handed", &StepOutcome::weights_handed)
      .def_ro("checksum", &StepOutcome::checksum)
      .def_ro("seconds", &StepOutcome::seconds)
      .def_ro("torn", &StepOutcome::torn)
      .def_ro("torn_reason", &StepOutcome::torn_reason)
      .def_prop_ro("phases", [](const StepOutcome& o) { return step_phases(o.phases); })
      .def("__repr__", [](const StepOutcome& o) {
        return cat("StepOutcome(step=", o.step, ", committed=", o.committed ? "True" : "False",
                   o.reason.empty() ? "" : ", reason='" + o.reason + "'",
                   o.torn ? ", torn=True" : "", ", bytes=", o.bytes, ", seconds=", o.seconds, ")");
      });
}

}  // namespace

void bind_subscriber(nb::module_& m) {
  bind_subscriber_options(m);
  bind_outcome(m);
  using S = PySubscriber;
  nb::class_<PySubscriber>(m, "Subscriber", nb::type_slots(subscriber_slots))
      .def(nb::init<>())
      .def("open", &PySubscriber::open, nb::arg("options"), ReleaseGil())
      .def("register_param", &PySubscriber::register_param, nb::arg("name"), nb::arg("data"),
           nb::arg("dtype"), nb::arg("shape"), nb::arg("strides"), nb::arg("device"))
      .def(
          "on_begin",
          [](S& s, nb::object fn) {
            const char* what = "the on_begin hook";
            s.get("subscriber").on_begin(step_callback(s.set_hook(S::kBegin, fn, what), what));
          },
          nb::arg("fn").none())
      .def(
          "on_end",
          [](S& s, nb::object fn) {
            const char* what = "the on_end hook";
            s.get("subscriber").on_end(step_callback(s.set_hook(S::kEnd, fn, what), what));
          },
          nb::arg("fn").none())
      .def(
          "on_weights",
          [](S& s, nb::object fn, bool changed_only) {
            auto ref = s.set_hook(S::kWeights, fn, "the on_weights hook");
            s.get("subscriber").on_weights(weights_callback(ref), changed_only);
          },
          nb::arg("fn").none(), nb::arg("changed_only") = false)
      .def(
          "on_loaded",
          [](S& s, nb::object fn) {
            const char* what = "the on_loaded hook";
            s.get("subscriber").on_loaded(step_callback(s.set_hook(S::kLoaded, fn, what), what));
          },
          nb::arg("fn").none())
      .def(
          "prepare", [](PySubscriber& s) { s.get("subscriber").prepare(); }, ReleaseGil())
      .def("run_step", &PySubscriber::run_step, nb::arg("timeout"), ReleaseGil())
      .def("stop", [](PySubscriber& s) { s.get("subscriber").stop(); })
      .def_prop_ro("version", [](PySubscriber& s) { return s.get("subscriber").version(); })
      .def_prop_ro("torn", [](PySubscriber& s) { return s.get("subscriber").torn(); })
      .def(
          "restored", [](PySubscriber& s, int64_t step) { s.get("subscriber").restored(step); },
          nb::arg("step"), ReleaseGil())
      .def(
          "applied",
          [](PySubscriber& s, int64_t step, const std::map<std::string, int64_t>& requests) {
            return s.get("subscriber").applied(step, requests);
          },
          nb::arg("step"), nb::arg("requests"), ReleaseGil())
      .def(
          "set_coordinator",
          [](PySubscriber& s, const std::string& address) {
            s.get("subscriber").set_coordinator(address);
          },
          nb::arg("address"))
      .def_prop_ro("coordinator", [](PySubscriber& s) { return s.get("subscriber").coordinator(); })
      .def_prop_ro("global_rank", [](PySubscriber& s) { return s.get("subscriber").global_rank(); })
      .def("params", &PySubscriber::params)
      .def("close", &PySubscriber::close, ReleaseGil());
}

}  // namespace weightsync::python
