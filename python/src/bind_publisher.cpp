// The coordinator and the trainer side. Every call that waits releases the GIL.
#include "bindings.h"

#include <nlohmann/json.hpp>

#include <weightsync/control.h>
#include <weightsync/engine_layout.h>
#include <weightsync/layouts.h>
#include <weightsync/publisher.h>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <optional>
#include <tuple>

namespace weightsync::python {
namespace {

using ReleaseGil = nb::call_guard<nb::gil_scoped_release>;

double seconds(std::chrono::milliseconds ms) {
  return static_cast<double>(ms.count()) / 1000.0;
}

class PyCoordinator : public Handle<control::Coordinator> {
 public:
  PyCoordinator(const std::string& host, int port, const std::string& token, int metrics_port) {
    if (port < 0 || port > 65535) fail(Errc::invalid_argument, "coordinator port ", port);
    control::CoordinatorOptions o;
    o.host = host;
    o.port = static_cast<uint16_t>(port);
    o.token = token;
    o.metrics_port = metrics_port;
    o.metrics_host = host;
    reset(std::make_unique<control::Coordinator>(o));
  }
  std::string address() { return get("coordinator").address(); }
  int port() { return get("coordinator").port(); }
  int metrics_port() { return get("coordinator").metrics_port(); }
  // (role, rank, replica, member id) of every registered member.
  std::vector<std::tuple<std::string, int, int, uint64_t>> members() {
    std::vector<std::tuple<std::string, int, int, uint64_t>> out;
    for (const auto& m : get("coordinator").members())
      out.emplace_back(std::string(control::role_name(m.role)), m.rank, m.replica, m.id);
    return out;
  }
  int64_t committed_version(int engine_rank) {
    return get("coordinator").committed_version(engine_rank);
  }
};

class PyPublisher : public Handle<Publisher> {
 public:
  void open(const PublisherOptions& options) { reset(std::make_unique<Publisher>(options)); }
  void register_tensor(const std::string& name, uintptr_t data, const std::string& dtype,
                       const Shape& shape, const Shape& strides, int device) {
    get("publisher")
        .register_tensor(
            name, tensor_view(data, dtype, shape, strides, device, "trainer param '" + name + "'"));
  }
  std::string plan_summary() { return get("publisher").plan().summary_json().dump(); }
  SaveHfResult save_hf(const std::string& dir, const std::string& config, int64_t max_file_bytes,
                       int64_t bucket_bytes, const std::string& transport, double timeout,
                       bool sync, bool direct_io) {
    SaveHfOptions o;
    o.sync = sync;
    o.direct_io = direct_io;
    o.config = config;
    o.max_file_bytes = max_file_bytes;
    o.bucket_bytes = bucket_bytes;
    o.transport = transport;
    if (timeout > 0) o.timeout = millis(timeout, "timeout");
    return get("publisher").save_hf(dir, o);
  }
};

nb::dict push_phases(const PushPhases& p) {
  nb::dict d;
  d["begin"] = p.begin;
  d["pack"] = p.pack;
  d["gather"] = p.gather;
  d["wire"] = p.wire;
  d["commit"] = p.commit;
  return d;
}

// The plan's and the wire's options, read and written field by field; the
// enums as their names ("p2p", "sender"), parsed on assignment.
void bind_plan_options(nb::module_& m) {
  nb::class_<PlanOptions>(m, "PlanOptions")
      .def(nb::init<>())
      .def_prop_rw(
          "mode", [](const PlanOptions& o) { return std::string(plan_mode_name(o.mode)); },
          [](PlanOptions& o, const std::string& v) { o.mode = parse_plan_mode(v); })
      .def_rw("bucket_bytes", &PlanOptions::bucket_bytes)
      .def_prop_rw(
          "fp8_site", [](const PlanOptions& o) { return std::string(fp8_site_name(o.fp8_site)); },
          [](PlanOptions& o, const std::string& v) { o.fp8_site = parse_fp8_site(v); })
      .def_rw("replicas", &PlanOptions::replicas)
      .def_rw("same_buckets_per_replica", &PlanOptions::same_buckets_per_replica)
      .def("to_json", [](const PlanOptions& o) { return o.to_json().dump(); });
  nb::class_<WireOptions>(m, "WireOptions")
      .def(nb::init<>())
      .def_rw("checksums", &WireOptions::checksums)
      .def_rw("checksums_gpu", &WireOptions::checksums_gpu)
      .def_rw("direct_min_bytes", &WireOptions::direct_min_bytes)
      .def_rw("delta", &WireOptions::delta)
      .def_rw("lend", &WireOptions::lend)
      .def("to_json", [](const WireOptions& o) { return o.to_json().dump(); });
}

// PublisherOptions: the layout and the engine config set as JSON text (the
// package reads files and dicts), timeouts in seconds, CUDA handles as ints.
void bind_publisher_options(nb::module_& m) {
  using O = PublisherOptions;
  nb::class_<O>(m, "PublisherOptions")
      .def(nb::init<>())
      .def_rw("coordinator", &O::coordinator)
      .def_rw("token", &O::token)
      .def_rw("rank", &O::rank)
      .def(
          "set_layout",
          [](O& o, const std::string& layout) {
            o.layout = TrainerLayout::from_json(parse_json(layout, "trainer layout"));
          },
          nb::arg("layout"))
      .def(
          "set_engine",
          [](O& o, const std::string& engine, const std::string& base_dir) {
            o.engine = engine_spec_from_json(parse_json(engine, "engine config"), base_dir);
          },
          nb::arg("engine"), nb::arg("base_dir"))
      .def_rw("transport", &O::transport)
      .def_rw("plan", &O::plan)
      .def_rw("elastic", &O::elastic)
      .def_rw("min_replicas", &O::min_replicas)
      .def_rw("wire", &O::wire)
      .def_prop_rw(
          "delta", [](const O& o) { return std::string(delta_mode_name(o.delta)); },
          [](O& o, const std::string& v) { o.delta = parse_delta_mode(v); })
      .def_rw("delta_verify", &O::delta_verify)
      .def_rw("job", &O::job)
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
          })
      .def_prop_rw(
          "producer_stream",
          [](const O& o) { return reinterpret_cast<uintptr_t>(o.producer_stream); },
          [](O& o, uintptr_t h) { o.producer_stream = reinterpret_cast<void*>(h); })
      .def_prop_rw(
          "producer_event",
          [](const O& o) { return reinterpret_cast<uintptr_t>(o.producer_event); },
          [](O& o, uintptr_t h) { o.producer_event = reinterpret_cast<void*>(h); });
}

}  // namespace

void bind_coordinator(nb::module_& m) {
  nb::class_<PyCoordinator>(m, "Coordinator")
      .def(nb::init<const std::string&, int, const std::string&, int>(), nb::arg("host"),
           nb::arg("port"), nb::arg("token"), nb::arg("metrics_port") = -1, ReleaseGil())
      .def_prop_ro("address", &PyCoordinator::address)
      .def_prop_ro("port", &PyCoordinator::port)
      .def_prop_ro("metrics_port", &PyCoordinator::metrics_port)
      .def("committed_version", &PyCoordinator::committed_version, nb::arg("engine_rank"))
      .def("members", &PyCoordinator::members)
      .def("close", &PyCoordinator::close, ReleaseGil())
      .def_prop_ro("closed", [](const PyCoordinator& c) { return !c.open(); });
  // What `weightsync status --json` prints, asked as an observer (it takes
  // no part in steps) that leaves at once.
  m.def(
      "coordinator_status",
      [](const std::string& address, const std::string& token, double timeout) {
        control::ClientOptions c;
        c.address = address;
        c.token = token;
        c.role = control::Role::observer;
        c.connect_timeout = millis(timeout, "timeout");
        c.request_timeout = c.connect_timeout;
        control::Client client(c);
        std::string out = client.status_json();
        client.leave();
        return out;
      },
      nb::arg("address"), nb::arg("token"), nb::arg("timeout"), ReleaseGil());
}

// What a push, save_hf and load_hf return.
static void bind_results(nb::module_& m) {
  nb::class_<PushResult>(m, "PushResult")
      .def_ro("step", &PushResult::step)
      .def_ro("committed", &PushResult::committed)
      .def_ro("failed", &PushResult::failed)
      .def_ro("bytes_sent", &PushResult::bytes_sent)
      .def_ro("bytes_direct", &PushResult::bytes_direct)
      .def_ro("buckets_lent", &PushResult::buckets_lent)
      .def_ro("delta_buckets", &PushResult::delta_buckets)
      .def_ro("delta_bytes_whole", &PushResult::delta_bytes_whole)
      .def_ro("delta_base_bytes", &PushResult::delta_base_bytes)
      .def_ro("seconds", &PushResult::seconds)
      .def_ro("plan_id", &PushResult::plan_id)
      .def_ro("replicas", &PushResult::replicas)
      .def_prop_ro("phases", [](const PushResult& r) { return push_phases(r.phases); })
      .def("__repr__", [](const PushResult& r) {
        return cat("PushResult(step=", r.step, ", committed=", r.committed.size(),
                   " engine ranks, failed=", r.failed.size(), ", bytes_sent=", r.bytes_sent,
                   ", seconds=", r.seconds, ")");
      });
  nb::class_<SaveHfResult>(m, "SaveHfResult")
      .def_ro("dir", &SaveHfResult::dir)
      .def_ro("files", &SaveHfResult::files)
      .def_ro("total_bytes", &SaveHfResult::total_bytes)
      .def_ro("files_written", &SaveHfResult::files_written)
      .def_ro("bytes_written", &SaveHfResult::bytes_written)
      .def_ro("bytes_local", &SaveHfResult::bytes_local)
      .def_ro("bytes_sent", &SaveHfResult::bytes_sent)
      .def_ro("bytes_received", &SaveHfResult::bytes_received)
      .def_ro("arena_bytes", &SaveHfResult::arena_bytes)
      .def_ro("staging_bytes", &SaveHfResult::staging_bytes)
      .def_ro("disk_wait_s", &SaveHfResult::disk_wait_s)
      .def_ro("disk_s", &SaveHfResult::disk_s)
      .def_ro("seconds", &SaveHfResult::seconds)
      .def_ro("setup_s", &SaveHfResult::setup_s)
      .def_ro("data_s", &SaveHfResult::data_s)
      .def_ro("finish_s", &SaveHfResult::finish_s)
      .def("__repr__", [](const SaveHfResult& r) {
        return cat("SaveHfResult(dir='", r.dir, "', files=", r.files,
                   ", total_bytes=", r.total_bytes, ", files_written=", r.files_written.size(),
                   ", bytes_sent=", r.bytes_sent, ", seconds=", r.seconds, ")");
      });
  nb::class_<LoadReport>(m, "LoadReport")
      .def_ro("bytes", &LoadReport::bytes)
      .def_ro("pieces", &LoadReport::pieces)
      .def_ro("files", &LoadReport::files)
      .def_ro("seconds", &LoadReport::seconds)
      .def("__repr__", [](const LoadReport& r) {
        return cat("LoadReport(bytes=", r.bytes, ", pieces=", r.pieces, ", files=", r.files,
                   ", seconds=", r.seconds, ")");
      });
}

void bind_publisher(nb::module_& m) {
  bind_plan_options(m);
  bind_publisher_options(m);
  bind_results(m);
  nb::class_<PyPublisher>(m, "Publisher")
      .def(nb::init<>())
      .def("open", &PyPublisher::open, nb::arg("options"), ReleaseGil())
      .def("register_tensor", &PyPublisher::register_tensor, nb::arg("name"), nb::arg("data"),
           nb::arg("dtype"), nb::arg("shape"), nb::arg("strides"), nb::arg("device"))
      .def(
          "prepare", [](PyPublisher& p) { p.get("publisher").prepare(); }, ReleaseGil())
      .def(
          "push", [](PyPublisher& p, int64_t step) { return p.get("publisher").push(step); },
          nb::arg("step"), ReleaseGil())
      .def("plan_summary", &PyPublisher::plan_summary)
      .def("save_hf", &PyPublisher::save_hf, nb::arg("dir"), nb::arg("config"),
           nb::arg("max_file_bytes"), nb::arg("bucket_bytes"), nb::arg("transport"),
           nb::arg("timeout"), nb::arg("sync"), nb::arg("direct_io"), ReleaseGil())
      .def(
          "load_hf",
          [](PyPublisher& p, const std::string& dir) { return p.get("publisher").load_hf(dir); },
          nb::arg("dir"), ReleaseGil())
      .def_prop_ro("rank", [](PyPublisher& p) { return p.get("publisher").rank(); })
      .def(
          "set_coordinator",
          [](PyPublisher& p, const std::string& address) {
            p.get("publisher").set_coordinator(address);
          },
          nb::arg("address"))
      .def_prop_ro("coordinator", [](PyPublisher& p) { return p.get("publisher").coordinator(); })
      .def_prop_ro("staging_bytes",
                   [](PyPublisher& p) { return p.get("publisher").staging_bytes(); })
      .def("close", &PyPublisher::close, ReleaseGil());
}

}  // namespace weightsync::python
