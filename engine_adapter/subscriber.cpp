#include <weightsync/control.h>
#include <weightsync/error.h>
#include <weightsync/subscriber.h>
#include <weightsync/topology.h>
#include <weightsync/trace.h>

#include "subscriber_pipeline.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <map>

namespace weightsync {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Millis left_until(Clock::time_point deadline) {
  return std::max(Millis(0), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
}

nlohmann::json json_of(const std::vector<uint8_t>& blob) {
  return nlohmann::json::parse(blob.begin(), blob.end());
}

}  // namespace

struct Subscriber::Impl {
  SubscriberOptions opt;
  EngineLayout engine;
  int global = 0;
  std::unique_ptr<control::Client> client;
  std::map<std::string, size_t, std::less<>> index;
  std::vector<TensorView> params;
  std::vector<bool> registered;
  std::vector<std::unique_ptr<char[]>> staging_memory;
  std::vector<TensorView> staging;
  std::optional<TrainerLayout> trainer;
  std::unique_ptr<Transport> transport;
  std::optional<Plan> plan;
  std::unique_ptr<engine::ReceivePipeline> pipeline;
  std::function<void(int64_t)> on_begin, on_end;
  std::atomic<int64_t> version{-1};
  std::atomic<bool> stopping{false};
  int64_t current_step = -1;
  std::string abort_reason;

  const EngineRankLayout& rank_layout() const { return engine.rank_layout(global); }
  std::string key(const std::string& what) const { return opt.job + "/" + what; }
  void ensure_ready();
  void poll();
  StepOutcome run_one(const control::StepBegin& begin);
  bool wait_decision(int64_t step, Clock::time_point deadline, std::string& reason);
  void publish_staging();
};

void Subscriber::Impl::ensure_ready() {
  if (plan) return;
  const auto& ps = rank_layout().params;
  for (size_t i = 0; i < ps.size(); ++i)
    if (!registered[i])
      fail(Errc::invalid_argument, "engine rank ", global, ": param '", ps[i].name,
           "' was not registered before the first step");
  const auto deadline = Clock::now() + opt.connect_timeout;
  trainer = opt.trainer ? *opt.trainer
                        : TrainerLayout::from_json(
                              json_of(client->get(key("layout/trainer"), left_until(deadline))));
  const auto po = json_of(client->get(key("plan_options"), left_until(deadline)));
  PlanOptions options;
  options.mode = parse_plan_mode(po.at("mode").get<std::string>());
  options.bucket_bytes = po.at("bucket_bytes").get<int64_t>();
  const WireOptions wire = WireOptions::from_json(po.value("wire", nlohmann::json::object()));
  const int trainers = static_cast<int>(trainer->mesh.world());
  client->wait_members(trainers, engine.world(), left_until(deadline));
  TransportOptions t;
  t.name = opt.transport;
  t.store = client.get();
  t.prefix = key("transport");
  t.rank = trainers + global;
  t.world = trainers + engine.world();
  t.bootstrap_timeout = left_until(deadline);
  transport = make_transport(t);
  plan = make_plan(*trainer, engine, Topology{}, options);
  if (opt.staging) {
    for (const TensorView& p : params) {
      const size_t bytes = p.nbytes();
      staging_memory.emplace_back(new char[std::max<size_t>(bytes, 1)]());
      staging.push_back(host_view(staging_memory.back().get(), p.dtype, p.shape));
    }
  }
  pipeline = std::make_unique<engine::ReceivePipeline>(
      *plan, global, opt.staging ? staging : params, wire, transport->capabilities());
  pipeline->prepare(*transport);
  for (int peer = 0; peer < t.world; ++peer)
    if (peer != t.rank) transport->connect(peer);
}

void Subscriber::Impl::poll() {
  while (auto ev = client->poll_event()) {
    if (auto* abort = std::get_if<control::Abort>(&*ev); abort && abort->step == current_step) {
      abort_reason = abort->reason;
      fail(Errc::cancelled, "engine rank ", global, ": step ", current_step,
           " aborted: ", abort->reason);
    }
  }
}

bool Subscriber::Impl::wait_decision(int64_t step, Clock::time_point deadline,
                                     std::string& reason) {
  while (true) {
    const auto ev = client->wait_event(left_until(deadline));
    if (auto* c = std::get_if<control::Commit>(&ev); c && c->step == step) return true;
    if (auto* a = std::get_if<control::Abort>(&ev); a && a->step == step) {
      reason = a->reason;
      return false;
    }
  }
}

void Subscriber::Impl::publish_staging() {
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorView& p = params[i];
    if (p.memory == MemoryKind::host && p.is_contiguous())
      std::memcpy(p.data, staging[i].data, p.nbytes());
    else
      copy_box(staging[i], Box::full(p.shape), p, Box::full(p.shape));
  }
}

StepOutcome Subscriber::Impl::run_one(const control::StepBegin& begin) {
  const auto start = Clock::now();
  const auto deadline = start + opt.step_timeout;
  TraceSpan whole(opt.tracer, cat("step ", begin.step), "step");
  StepOutcome out;
  out.step = begin.step;
  current_step = begin.step;
  abort_reason.clear();
  if (on_begin) on_begin(begin.step);
  engine::ReceiveReport report;
  if (begin.plan_id != plan->plan_id_hex()) {
    report.error = cat("engine rank ", global, ": step ", begin.step, " uses plan ", begin.plan_id,
                       " but this engine computed plan ", plan->plan_id_hex(),
                       " (layouts or plan options differ)");
  } else {
    try {
      report = pipeline->run(
          begin.step, *transport, [this] { poll(); }, deadline, out.phases, opt.tracer);
    } catch (const Error& e) {
      pipeline->cancel_all();
      if (!abort_reason.empty()) {
        out.reason = abort_reason;
        out.seconds = seconds_since(start);
        if (on_end) on_end(begin.step);
        return out;
      }
      report.error = e.what();
    }
  }
  control::StepAck ack;
  ack.step = begin.step;
  ack.ok = report.error.empty();
  ack.bytes = report.bytes;
  ack.checksum = report.checksum;
  ack.error = report.error;
  out.bytes = report.bytes;
  out.bytes_direct = report.bytes_direct;
  out.checksum = report.checksum;
  const auto commit_start = Clock::now();
  {
    TraceSpan span(opt.tracer, "ack+decision", "control");
    client->ack(ack);
    out.committed = wait_decision(begin.step, deadline, out.reason);
  }
  if (out.committed) {
    TraceSpan span(opt.tracer, "publish", "apply");
    if (opt.staging) publish_staging();
    version = begin.step;
  }
  out.phases.commit = seconds_since(commit_start);
  out.seconds = seconds_since(start);
  if (on_end) on_end(begin.step);
  return out;
}

Subscriber::Subscriber(SubscriberOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = std::move(options);
  m.engine = make_engine_layout(m.opt.engine);
  const int tp = m.opt.engine.tp;
  if (m.opt.rank < 0 || m.opt.rank >= tp)
    fail(Errc::invalid_argument, "subscriber: rank ", m.opt.rank, " outside tp=", tp);
  if (m.opt.replica < 0 || m.opt.replica >= m.opt.engine.replicas)
    fail(Errc::invalid_argument, "subscriber: replica ", m.opt.replica, " outside the ",
         m.opt.engine.replicas, " replicas of the engine config");
  m.global = m.opt.replica * tp + m.opt.rank;
  const auto& ps = m.rank_layout().params;
  for (size_t i = 0; i < ps.size(); ++i) m.index.emplace(ps[i].name, i);
  m.params.resize(ps.size());
  m.registered.assign(ps.size(), false);
  control::ClientOptions c;
  c.address = m.opt.coordinator;
  c.token = m.opt.token;
  c.role = control::Role::engine;
  c.rank = m.global;
  c.world = m.engine.world();
  c.replica = m.opt.replica;
  c.connect_timeout = m.opt.connect_timeout;
  m.client = std::make_unique<control::Client>(c);
  if (m.global == 0) {
    const std::string config = m.opt.engine.to_json().dump();
    m.client->set(m.key("layout/engine"), std::vector<uint8_t>(config.begin(), config.end()));
  }
}

Subscriber::~Subscriber() {
  if (!impl_) return;
  impl_->pipeline.reset();
  impl_->transport.reset();
  try {
    if (impl_->client) impl_->client->leave();
  } catch (const Error&) {
  }
}

void Subscriber::register_param(const std::string& name, const TensorView& param) {
  Impl& m = *impl_;
  if (m.plan)
    fail(Errc::invalid_argument, "engine rank ", m.global, ": register_param('", name,
         "') after the first step");
  auto it = m.index.find(name);
  if (it == m.index.end())
    fail(Errc::not_found, "engine rank ", m.global, ": param '", name,
         "' is not in this rank's engine layout (", m.index.size(), " params)");
  const EngineParam& spec = m.rank_layout().params[it->second];
  if (param.dtype != spec.dtype)
    fail(Errc::mismatch, "engine rank ", m.global, ": param '", name, "' registered as ",
         dtype_name(param.dtype), " but the engine layout says ", dtype_name(spec.dtype));
  if (param.shape != spec.shape)
    fail(Errc::mismatch, "engine rank ", m.global, ": param '", name, "' registered with shape ",
         shape_str(param.shape), " but the engine layout says ", shape_str(spec.shape));
  if (!param.data && param.numel() > 0)
    fail(Errc::invalid_argument, "engine rank ", m.global, ": param '", name,
         "' registered with a null pointer");
  m.params[it->second] = param;
  m.registered[it->second] = true;
}

void Subscriber::register_param(const std::string& name, void* data, DType dtype,
                                const Shape& shape, MemoryKind memory, int device) {
  register_param(name, tensor_view(data, dtype, shape, memory, device));
}

void Subscriber::prepare() {
  impl_->ensure_ready();
}

void Subscriber::on_begin(std::function<void(int64_t)> hook) {
  impl_->on_begin = std::move(hook);
}
void Subscriber::on_end(std::function<void(int64_t)> hook) {
  impl_->on_end = std::move(hook);
}

std::optional<StepOutcome> Subscriber::run_step(std::chrono::milliseconds wait) {
  Impl& m = *impl_;
  m.ensure_ready();
  const auto deadline = Clock::now() + wait;
  while (true) {
    std::optional<control::Event> ev;
    try {
      ev = m.client->wait_event(left_until(deadline));
    } catch (const Error& e) {
      if (e.code() == Errc::timeout) return std::nullopt;
      throw;
    }
    if (auto* begin = std::get_if<control::StepBegin>(&*ev)) return m.run_one(*begin);
    // Membership changes and decisions of steps already handled need nothing here.
  }
}

void Subscriber::serve() {
  while (!impl_->stopping) run_step(Millis(200));
}

void Subscriber::stop() {
  impl_->stopping = true;
}
int64_t Subscriber::version() const {
  return impl_->version;
}
int Subscriber::global_rank() const {
  return impl_->global;
}

int Subscriber::live_trainers() {
  int n = 0;
  for (const auto& m : impl_->client->members()) n += m.role == control::Role::trainer;
  return n;
}

const EngineRankLayout& Subscriber::layout() const {
  return impl_->rank_layout();
}

const Plan& Subscriber::plan() const {
  if (!impl_->plan) fail(Errc::invalid_argument, "subscriber: no plan before the first step");
  return *impl_->plan;
}

}  // namespace weightsync
