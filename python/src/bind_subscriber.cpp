// The engine side. Every call that waits releases the GIL; hooks take it back.
#include "bindings.h"

#include <weightsync/engine_layout.h>
#include <weightsync/layouts.h>
#include <weightsync/subscriber.h>

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
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
Subscriber::WeightsHook weights_callback(nb::object fn) {
  auto ref = callable_ref(std::move(fn), "the on_weights hook");
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
  void open(const SubscriberOptions& options) { reset(std::make_unique<Subscriber>(options)); }
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
};

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
      .def_prop_rw(
          "connect_timeout", [](const O& o) { return seconds(o.connect_timeout); },
          [](O& o, double s) { o.connect_timeout = millis(s, "connect_timeout"); })
      .def_prop_rw(
          "step_timeout", [](const O& o) { return seconds(o.step_timeout); },
          [](O& o, double s) { o.step_timeout = millis(s, "step_timeout"); });
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
  nb::class_<PySubscriber>(m, "Subscriber")
      .def(nb::init<>())
      .def("open", &PySubscriber::open, nb::arg("options"), ReleaseGil())
      .def("register_param", &PySubscriber::register_param, nb::arg("name"), nb::arg("data"),
           nb::arg("dtype"), nb::arg("shape"), nb::arg("strides"), nb::arg("device"))
      .def(
          "on_begin",
          [](PySubscriber& s, nb::object fn) {
            s.get("subscriber").on_begin(step_callback(std::move(fn), "the on_begin hook"));
          },
          nb::arg("fn").none())
      .def(
          "on_end",
          [](PySubscriber& s, nb::object fn) {
            s.get("subscriber").on_end(step_callback(std::move(fn), "the on_end hook"));
          },
          nb::arg("fn").none())
      .def(
          "on_weights",
          [](PySubscriber& s, nb::object fn, bool changed_only) {
            s.get("subscriber").on_weights(weights_callback(std::move(fn)), changed_only);
          },
          nb::arg("fn").none(), nb::arg("changed_only") = false)
      .def(
          "on_loaded",
          [](PySubscriber& s, nb::object fn) {
            s.get("subscriber").on_loaded(step_callback(std::move(fn), "the on_loaded hook"));
          },
          nb::arg("fn").none())
      .def(
          "prepare", [](PySubscriber& s) { s.get("subscriber").prepare(); }, ReleaseGil())
      .def("run_step", &PySubscriber::run_step, nb::arg("timeout"), ReleaseGil())
      .def("stop", [](PySubscriber& s) { s.get("subscriber").stop(); })
      .def_prop_ro("version", [](PySubscriber& s) { return s.get("subscriber").version(); })
      .def_prop_ro("torn", [](PySubscriber& s) { return s.get("subscriber").torn(); })
      .def_prop_ro("global_rank", [](PySubscriber& s) { return s.get("subscriber").global_rank(); })
      .def("params", &PySubscriber::params)
      .def("close", &PySubscriber::close, ReleaseGil());
}

}  // namespace weightsync::python
