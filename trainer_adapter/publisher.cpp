#include <weightsync/control.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/publisher.h>
#include <weightsync/topology.h>
#include <weightsync/trace.h>

#include "publisher_impl.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <thread>

namespace weightsync {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

using pipeline::seconds_since;

using pipeline::left_until;

// How long a control request of a step may wait for the coordinator: what is
// left of the step, and at least a second (a reply may be on its way).
Millis wait_until(Clock::time_point deadline) {
  return std::max(Millis(1000), left_until(deadline));
}

}  // namespace

// `e` naming the step it failed ("trainer rank 1: step 3: send to rank 4 ...
// did not complete before the step timeout (waited 10 s for it)"), so that
// an exception says which step as well as which rank and what it awaited.
Error Publisher::Impl::with_step(const Error& e, int64_t step) const {
  std::string what = e.what();
  const std::string me = cat("trainer rank ", opt.rank, ": ");
  if (what.rfind(me, 0) == 0) what.erase(0, me.size());
  const std::string named = cat("step ", step, ":");
  if (what.rfind(named, 0) == 0) return e;
  return Error(e.code(), cat(me, named, " ", what));
}

void Publisher::Impl::require_registered(const char* what) const {
  for (size_t i = 0; i < registered.size(); ++i)
    if (!registered[i])
      fail(Errc::invalid_argument, "trainer rank ", opt.rank, ": param '",
           opt.layout.params[i].name, "' was not registered before ", what);
}

void Publisher::Impl::ensure_ready() {
  if (ready) return;
  require_registered("the first push");
  pipeline::SetupSpec spec;
  spec.who = cat("trainer rank ", opt.rank);
  spec.trainer_side = true;
  spec.rank = opt.rank;
  spec.job = opt.job;
  spec.transport = opt.transport;
  spec.trainer = opt.layout;
  if (opt.engine) spec.engine = make_engine_layout(*opt.engine);
  spec.plan = opt.plan;
  spec.memory = pipeline::rank_memory(
      tensors, [&](size_t i) { return opt.layout.params[i].name; }, spec.who);
  spec.connect_timeout = opt.connect_timeout;
  pipeline::DataPath dp = pipeline::open_data_path(*client, spec);
  const auto engines = static_cast<size_t>(dp.engine.world());
  engine = std::move(dp.engine);
  take(dp);
  if (dp.plan) build_sender(*dp.plan);
  // Endpoints now rather than inside the first step's timing (elastic: the
  // trainers; engines as their replicas join).
  pipeline::connect_peers(*transport, elastic ? trainer_world() : 0);
  plan = std::move(dp.plan);
  dead.assign(engines, false);
  engine_member.assign(engines, 0);
  held.assign(engines, -1);
  ready = true;
}

void Publisher::Impl::build_sender(const Plan& p) {
  pipeline.reset();  // its slots first
  auto sender = std::make_unique<trainer::SendPipeline>(
      p, opt.rank, tensors, wire, transport->capabilities(), engine ? &*engine : nullptr);
  sender->prepare(*transport, slots, slot_device, memory,
                  trainer::Producer{opt.producer_stream, opt.producer_event});
  sender->set_delta_verify(opt.delta_verify);
  sender->on_engine_failed([this](int g, const std::string& why) { report_send_failure(g, why); });
  pipeline = std::move(sender);
}

// Told at once, the coordinator fails that engine rank's step and stops its
// receives; untold, the rank would wait for the step timeout.
void Publisher::Impl::report_send_failure(int engine_rank, const std::string& why) {
  try {
    client->send_failed(current_step, engine_rank, why, Millis(2000));
  } catch (const Error&) {
    // A coordinator that cannot be reached decides at its own timeout.
  }
}

void Publisher::Impl::use_plan(const std::vector<int>& replicas) {
  const std::vector<int32_t> want(replicas.begin(), replicas.end());
  if (plan && plan->options().replicas == want) return;
  PlanOptions o = plan_options;
  o.replicas = want;
  plan.reset();
  pipeline.reset();
  Plan p = make_plan(opt.layout, *engine, Topology{}, o);
  build_sender(p);
  plan = std::move(p);
}

std::vector<int> Publisher::Impl::choose_replicas(int64_t step, Clock::time_point deadline) {
  const EngineLayout& e = *engine;
  // An engine rank is ready once it published its member id under its ready
  // key (after preparing); a new process for the rank must publish its own.
  auto is_ready = [&](int g, uint64_t id) {
    if (auto it = ready_member.find(g); it != ready_member.end() && it->second == id) return true;
    try {
      const auto v = client->get(pipeline::JobKeys{opt.job}.ready(g), Millis(0));
      if (std::string(v.begin(), v.end()) != std::to_string(id)) return false;
    } catch (const Error& err) {
      if (err.code() != Errc::timeout) throw;
      return false;
    }
    ready_member[g] = id;
    return true;
  };
  while (true) {
    std::map<int, control::Member> live;
    for (const auto& m : client->members())
      if (m.role == control::Role::engine) live[m.rank] = m;
    std::vector<int> chosen;
    for (int r = 0; r < e.num_replicas(); ++r) {
      const int tp = e.group_of(e.global_rank(r, 0)).config.tp;
      bool all = true;
      for (int k = 0; k < tp && all; ++k) {
        const int g = e.global_rank(r, k);
        const auto it = live.find(g);
        all = it != live.end() && it->second.replica == r && is_ready(g, it->second.id);
      }
      if (all) chosen.push_back(r);
    }
    if (static_cast<int>(chosen.size()) >= min_replicas) return chosen;
    if (Clock::now() >= deadline)
      fail(Errc::timeout, "trainer rank 0: step ", step, ": ", chosen.size(),
           " engine replicas ready ", nlohmann::json(chosen).dump(), " of the ", e.num_replicas(),
           " slots, fewer than min_replicas ", min_replicas, " within the step timeout");
    std::this_thread::sleep_for(Millis(50));
  }
}

control::StepStart Publisher::Impl::begin(int64_t step, Clock::time_point deadline) {
  if (!elastic) {
    control::StepStart s;
    s.plan_id = plan->plan_id_hex();
    s.engines = client->begin_step(step, s.plan_id, wait_until(deadline));
    return s;
  }
  if (opt.rank != 0) return client->follow_step(step, wait_until(deadline));
  // Rank 0 leads: the membership, its plan, then the step.
  const std::vector<int> chosen = choose_replicas(step, deadline);
  use_plan(chosen);
  return client->begin_step(step, plan->plan_id_hex(), chosen, wait_until(deadline));
}

// Elastic replicas: the leader's plan (made here unless this rank has it),
// which must be the one it began the step with.
void Publisher::Impl::adopt(int64_t step, const control::StepStart& start) {
  if (!elastic) return;
  if (!start.replicas)
    fail(Errc::protocol, "trainer rank ", opt.rank, ": step ", step,
         " began without a membership, but this job's replicas are elastic");
  use_plan(*start.replicas);
  if (plan->plan_id_hex() != start.plan_id)
    fail(Errc::mismatch, "trainer rank ", opt.rank, ": step ", step, " uses plan ", start.plan_id,
         " for replicas ", nlohmann::json(*start.replicas).dump(), " but this rank computed plan ",
         plan->plan_id_hex(), " (layouts or plan options differ)");
}

// The step's engines, as the coordinator saw them when it began: ranks not
// among them are skipped; a rank now held by a new process (a restarted
// engine) is reconnected and served again. The plan itself does not change:
// it covers every engine rank, and absent ones are skipped.
void Publisher::Impl::admit(const std::vector<control::Member>& step_engines) {
  std::vector<uint64_t> now(engine_member.size(), 0);
  for (const auto& m : step_engines)
    if (m.rank >= 0 && m.rank < static_cast<int>(now.size()))
      now[static_cast<size_t>(m.rank)] = m.id;
  for (size_t g = 0; g < now.size(); ++g) {
    if (now[g] == 0) {
      dead[g] = true;
      held[g] = -1;
      continue;
    }
    if (engine_member[g] != now[g]) held[g] = -1;  // a new process holds nothing of ours
    // Served by this step: unless its connection failed (a rank absent from
    // earlier steps, e.g. an elastic replica that joined, is served now).
    dead[g] = transport->peer_failed(trainer_world() + static_cast<int>(g));
    // A new process for the rank, or the same one whose connection failed
    // while it lives on (a failed step's sends to it were cancelled, which
    // gives a UCX peer up; its coordinator died; a link flapped): a new
    // connection.
    if ((engine_member[g] != 0 && engine_member[g] != now[g]) || dead[g]) {
      try {
        transport->reconnect(trainer_world() + static_cast<int>(g));
        dead[g] = false;
      } catch (const Error& e) {
        if (e.code() != Errc::unsupported) throw;
        dead[g] = true;  // this backend cannot take a new process in
      }
    }
    // A live engine rank this rank cannot send to would wait for its buckets
    // until the step timeout: the coordinator fails it now.
    if (dead[g])
      report_send_failure(static_cast<int>(g),
                          cat("trainer rank ", opt.rank, ": cannot send to engine rank ", g,
                              ": its connection over ", transport->name(), " failed"));
    engine_member[g] = now[g];
  }
}

void Publisher::Impl::poll() {
  if (client->connection_losses() != losses_at_begin)
    fail(Errc::peer_failure, "trainer rank ", opt.rank, ": step ", current_step,
         ": lost the coordinator ", client->address(),
         " while sending; the step is aborted (it reconnects for the next)");
  while (auto ev = client->poll_event()) {
    if (auto* left = std::get_if<control::MemberLeft>(&*ev)) {
      const auto& m = left->member;
      if (m.role == control::Role::engine && m.rank >= 0 && m.rank < static_cast<int>(dead.size()))
        dead[static_cast<size_t>(m.rank)] = true;
    } else if (auto* abort = std::get_if<control::Abort>(&*ev)) {
      // An engine rank that failed the step already (a send to it failed
      // here or on another trainer, or it stopped receiving): its sends are
      // dropped, not waited for.
      const int g = abort->engine_rank;
      if (abort->step == current_step && g >= 0 && g < static_cast<int>(dead.size()))
        dead[static_cast<size_t>(g)] = true;
    } else if (auto* result = std::get_if<control::StepResult>(&*ev)) {
      if (result->step != current_step) continue;
      // Decided before this rank reported: only an abort does that.
      early_result = *result;
      fail(Errc::peer_failure, "trainer rank ", opt.rank, ": step ", current_step,
           " was aborted while sending: ", result->reason);
    }
  }
}

control::StepResult Publisher::Impl::decide(int64_t step, Clock::time_point deadline) {
  if (early_result) return *early_result;
  const auto began = Clock::now();
  const auto until = deadline + control::kDecisionGrace;
  while (true) {
    // A coordinator lost meanwhile never decides: a restarted one, reached
    // again, knows nothing of the step.
    if (client->connection_losses() != losses_at_begin)
      fail(Errc::peer_failure, "trainer rank ", opt.rank, ": step ", step,
           ": lost the coordinator ", client->address(),
           " before its decision; the step is aborted (it reconnects for the next)");
    try {
      return client->wait_step_result(step, std::min(Millis(100), left_until(until)));
    } catch (const Error& e) {
      if (e.code() == Errc::timeout && Clock::now() < until) continue;
      fail(e.code(), "trainer rank ", opt.rank, ": step ", step, ": sent, then waited ",
           seconds_since(began), " s for the coordinator's decision: ", e.what());
    }
  }
}

PushResult Publisher::Impl::push(int64_t step) {
  std::lock_guard lock(push_mutex);
  const auto start = Clock::now();
  TraceSpan whole(opt.tracer, cat("push ", step), "step");
  ensure_ready();
  const auto deadline = start + opt.step_timeout;
  PushResult out;
  out.step = step;
  early_result.reset();
  current_step = step;  // first: a late result of an earlier step is ignored
  losses_at_begin = client->connection_losses();
  poll();  // membership news since the last step (engines that left are skipped)
  control::StepStart begun;
  {
    TraceSpan span(opt.tracer, "begin", "control");
    const auto t = Clock::now();
    begun = begin(step, deadline);
    out.phases.begin = seconds_since(t);
  }
  try {
    send(step, begun, deadline, out);
  } catch (const Error& e) {
    give_up(step, e, deadline);
    throw with_step(e, step);
  }
  control::StepResult result;
  {
    TraceSpan span(opt.tracer, "commit", "control");
    const auto t = Clock::now();
    result = decide(step, deadline);
    out.phases.commit = seconds_since(t);
  }
  client->set_resume({-1, step, false});
  settle(step, result, out);
  out.seconds = seconds_since(start);
  return out;
}

void Publisher::Impl::send(int64_t step, const control::StepStart& begun,
                           Clock::time_point deadline, PushResult& out) {
  adopt(step, begun);
  admit(begun.engines);
  out.plan_id = plan->plan_id_hex();
  out.replicas = begun.replicas.value_or(std::vector<int>{});
  pipeline->set_engine_versions(held);
  out.bytes_sent = pipeline->run(
      step, *transport, dead, [this] { poll(); }, deadline, out.phases, opt.tracer);
  out.bytes_direct = pipeline->bytes_direct();
  out.buckets_lent = pipeline->buckets_lent();
  out.delta_buckets = pipeline->delta_buckets();
  out.delta_bytes_whole = pipeline->delta_bytes_whole();
  out.delta_base_bytes = pipeline->delta_base_bytes();
  control::RankStepStats stats;
  stats.phases = {{"begin", out.phases.begin},
                  {"pack", out.phases.pack},
                  {"gather", out.phases.gather},
                  {"wire", out.phases.wire}};
  stats.bytes = out.bytes_sent;
  stats.staging_bytes = pipeline ? pipeline->staging_bytes() : 0;
  client->sent(step, true, {}, wait_until(deadline), stats);
}

void Publisher::Impl::give_up(int64_t step, const Error& e, Clock::time_point deadline) {
  std::fill(held.begin(), held.end(), int64_t{-1});
  if (pipeline) pipeline->cancel_all();
  client->set_resume({-1, step, false});
  // Decided already, or its coordinator is gone (a new one knows nothing of it).
  if (early_result || client->connection_losses() != losses_at_begin) return;
  try {
    // Tell the coordinator, briefly: the step has failed already (a
    // coordinator that cannot be reached aborts it on its own).
    client->sent(step, false, e.what(), std::min(wait_until(deadline), Millis(5000)));
    decide(step, std::min(deadline, Clock::now() + Millis(5000)));
  } catch (const Error&) {
    // The original failure is the one worth reporting.
  }
}

void Publisher::Impl::settle(int64_t step, const control::StepResult& result, PushResult& out) {
  // Decided: what this rank sent for the step arrived or is no longer wanted,
  // so a close need not wait for the peers to flush it.
  transport->sends_settled();
  // Delta sync: what each engine rank holds of this rank's sends now.
  std::fill(held.begin(), held.end(), int64_t{-1});
  if (result.trainers_ok)
    for (int g : result.committed)
      if (g >= 0 && g < static_cast<int>(held.size())) held[static_cast<size_t>(g)] = step;
  if (!result.trainers_ok)
    fail(Errc::peer_failure, "trainer rank ", opt.rank, ": step ", step,
         " was aborted: ", result.reason);
  out.committed = result.committed;
  for (const auto& f : result.failed) out.failed.emplace_back(f.rank, f.reason);
}

Publisher::Publisher(PublisherOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = std::move(options);
  m.opt.layout.validate();
  const int world = m.trainer_world();
  if (m.opt.rank < 0 || m.opt.rank >= world)
    fail(Errc::invalid_argument, "publisher: rank ", m.opt.rank, " outside the trainer world of ",
         world, " (mesh ", shape_str(m.opt.layout.mesh.shape), ")");
  if (m.opt.elastic && m.opt.min_replicas < 1)
    fail(Errc::invalid_argument, "publisher: min_replicas ", m.opt.min_replicas,
         " must be at least 1");
  if (m.opt.plan.bucket_bytes < 1024)
    fail(Errc::invalid_argument, "publisher: bucket_bytes ", m.opt.plan.bucket_bytes,
         " is below the minimum of 1024");
  if (!m.opt.plan.replicas.empty())
    fail(Errc::invalid_argument, "publisher: plan.replicas must be empty: a step serves the ",
         "job's replicas, or with elastic on, the replicas that are ready");
  m.opt.wire.delta = m.opt.delta != DeltaMode::off;
  // Delta sync encodes a bucket once for all the replicas it goes to alike.
  m.opt.plan.same_buckets_per_replica = m.opt.wire.delta;
  m.tensors.resize(m.opt.layout.params.size());
  m.registered.assign(m.opt.layout.params.size(), false);
  // Names are unique per rank, not per layout (pipeline stages name their
  // layers by local index): index the params this rank holds. Those of other
  // stages need no tensor; they hold no element here.
  for (size_t i = 0; i < m.opt.layout.params.size(); ++i) {
    const LoadSpec& spec = m.opt.layout.params[i];
    if (holds(spec, m.opt.layout.mesh, m.opt.rank)) {
      m.index.emplace(spec.name, i);
    } else {
      TensorView none;  // this rank holds none of it
      none.dtype = spec.dtype;
      none.shape = Shape{0};
      m.tensors[i] = none;
      m.registered[i] = true;
    }
  }
  control::ClientOptions c;
  c.address = m.opt.coordinator;
  c.token = m.opt.token;
  c.role = control::Role::trainer;
  c.rank = m.opt.rank;
  c.world = world;
  c.connect_timeout = m.opt.connect_timeout;
  c.reconnect_timeout = m.opt.coordinator_reconnect;
  m.client = std::make_unique<control::Client>(c);
  if (m.opt.rank == 0) {
    // The engines plan from the same inputs: the layout and the plan options.
    pipeline::PublishedOptions published;
    published.plan = m.opt.plan;
    published.wire = m.opt.wire;
    if (m.opt.elastic) published.min_replicas = m.opt.min_replicas;
    pipeline::publish_trainer(*m.client, m.opt.job, m.opt.layout, published);
  }
}

Publisher::~Publisher() {
  if (!impl_) return;
  // Requests and regions go before their transport, the client last.
  impl_->pipeline.reset();
  impl_->close_transport();
  try {
    if (impl_->client) impl_->client->leave();
  } catch (const Error&) {
  }
}

void Publisher::register_tensor(const std::string& name, const TensorView& tensor) {
  Impl& m = *impl_;
  if (m.ready)
    fail(Errc::invalid_argument, "trainer rank ", m.opt.rank, ": register_tensor('", name,
         "') after the first push");
  auto it = m.index.find(name);
  if (it == m.index.end()) {
    for (const LoadSpec& spec : m.opt.layout.params)
      if (spec.name == name && spec.stage)
        fail(Errc::not_found, "trainer rank ", m.opt.rank, ": param '", name, "' lives on stage ",
             spec.stage->index, " of axis '", spec.stage->axis, "', not on this rank's");
    fail(Errc::not_found, "trainer rank ", m.opt.rank, ": param '", name,
         "' is not in the trainer layout (", m.index.size(), " params on this rank)");
  }
  const LoadSpec& spec = m.opt.layout.params[it->second];
  pipeline::check_registered(cat("trainer rank ", m.opt.rank), name, tensor, spec.dtype,
                             local_shape(spec, m.opt.layout.mesh, m.opt.rank), "its LoadSpec says",
                             cat("rank ", m.opt.rank, "'s local shape is"), /*written=*/false);
  m.tensors[it->second] = tensor;
  m.registered[it->second] = true;
}

void Publisher::register_tensor(const std::string& name, void* data, DType dtype,
                                const Shape& shape, MemoryKind memory, int device) {
  register_tensor(name, tensor_view(data, dtype, shape, memory, device));
}

void Publisher::prepare() {
  std::lock_guard lock(impl_->push_mutex);
  impl_->ensure_ready();
}

PushResult Publisher::push(int64_t step) {
  return impl_->push(step);
}

std::future<PushResult> Publisher::push_async(int64_t step) {
  return std::async(std::launch::async, [this, step] { return impl_->push(step); });
}

const Plan& Publisher::plan() const {
  if (!impl_->plan) fail(Errc::invalid_argument, "publisher: no plan before the first push");
  return *impl_->plan;
}

int Publisher::rank() const {
  return impl_->opt.rank;
}

void Publisher::set_coordinator(const std::string& address) {
  impl_->client->set_address(address);
}

std::string Publisher::coordinator() const {
  return impl_->client->address();
}

std::size_t Publisher::staging_bytes() const {
  return impl_->pipeline ? impl_->pipeline->staging_bytes() : 0;
}

}  // namespace weightsync
