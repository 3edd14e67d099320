#include <weightsync/control.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/subscriber.h>
#include <weightsync/topology.h>
#include <weightsync/trace.h>

#include "core/cuda/gpu.h"
#include "subscriber_fp8.h"
#include "subscriber_pipeline.h"
#include "weights_delivery.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <utility>

namespace weightsync {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

using pipeline::seconds_since;

using pipeline::left_until;

}  // namespace

struct Subscriber::Impl : pipeline::Endpoint {
  SubscriberOptions opt;
  EngineLayout engine;
  int global = 0;
  std::vector<TensorView> params;
  std::optional<TrainerLayout> trainer;
  std::unique_ptr<engine::ReceivePipeline> pipeline;
  // FP8 engines: the quantized weights' staging in the trainer's dtype.
  std::unique_ptr<engine::Fp8Staging> fp8;
  std::function<void(int64_t)> on_begin, on_end, on_loaded;
  // load_weights mode (on_weights set): the rank's HF tensors live in an
  // arena (weights_delivery.h) and go to the engine as buckets complete them.
  Subscriber::WeightsHook on_weights;
  bool weights_changed_only = false;  // on_weights(hook, changed_only)
  uint64_t weights_handed = 0;        // this step's, to on_weights
  engine::DeliveryPlan delivery;
  std::unique_ptr<char[]> arena_host;
  gpu::Memory arena_device;
  std::string weights_error;  // the step's first failure of on_weights
  // Delta sync in load_weights mode: the version the arena holds (-1 when
  // opened: nothing yet), which a delta must name as its base.
  int64_t arena_version = -1;
  std::string adopt_error;  // elastic: why the step's plan could not be made
  std::atomic<int64_t> version{-1};
  // Subscriber::torn(); `landing`: this step may have written the params
  // (or handed the engine tensors) already.
  std::atomic<bool> torn{false};
  bool landing = false;
  bool stopped = false;  // this step's receives failed and were cancelled (StepAck::stopped)
  std::atomic<bool> stopping{false};
  std::string abort_reason;
  // Coordinator connections lost before this step began: a step that sees
  // the count change lost its coordinator and is aborted here.
  uint64_t losses_at_begin = 0;
  // The member id of each trainer rank this rank's transport talks to; a
  // trainer that left (MemberLeft) and came back as a new process is
  // reconnected at the next step it begins (follow_trainers).
  std::vector<uint64_t> trainer_member;
  bool trainers_changed = false;
  // Trainer rank 0 is held by a new process since the last step: it may
  // have published other wire options (delta sync, checksums) under the
  // same plan, which the next step must use.
  bool leader_changed = false;

  const EngineRankLayout& rank_layout() const { return engine.rank_layout(global); }
  void ensure_ready();
  // ensure_ready's checks: every param registered, or none in load_weights
  // mode (which takes no FP8 config and no staging copy).
  void check_registered_all(const std::string& who) const;
  std::vector<int> likely_replicas();
  void build_receiver(const Plan& p);
  // The plan for `replicas` and a receive pipeline for it, unless the
  // current plan is for them already.
  void use_plan(const std::vector<int>& replicas);
  // A static job's step under a plan this rank does not have, or the first
  // step of a new process at trainer rank 0: the layout, plan options and
  // wire options trainer rank 0 publishes now (a new trainer process took
  // rank 0 with other options), adopted when the plan is the step's; else
  // adopt_error says why. Elastic jobs adopt them without a plan (the
  // step's membership makes it, use_plan).
  void follow_published_plan(const control::StepBegin& begin);
  // Wire options published by trainer rank 0, and the slots they call for
  // (checksums need slots the host reads).
  void adopt_wire(const WireOptions& now);
  pipeline::RankMemory weights_memory() const;
  void open_arena(const Plan& plan);
  void deliver(size_t k);
  void poll();
  // A MemberLeft event: a trainer that left is looked for at the next step.
  void note(const control::Event& ev);
  // Before a step: trainer ranks now held by a new process get a new
  // connection (the transport's reconnect), as publishers do for engines.
  void follow_trainers();
  StepOutcome run_one(const control::StepBegin& begin);
  // run_one's parts: the step's data received (nullopt: the step was
  // aborted meanwhile), the params given it before the ack, the ack (and
  // the outcome's counts), and the version taken at commit.
  std::optional<engine::ReceiveReport> receive(const control::StepBegin& begin,
                                               Clock::time_point deadline, StepOutcome& out);
  void apply(int64_t step, engine::ReceiveReport& report, StepOutcome& out);
  control::StepAck acked(int64_t step, const engine::ReceiveReport& report, StepOutcome& out) const;
  void commit(int64_t step, StepOutcome& out);
  // Runs a hook; "" when it returned, else the failure (naming the hook).
  std::string run_hook(const std::function<void(int64_t)>& hook, const char* name, int64_t step);
  void end_hook(StepOutcome& out);
  // After the decision (or the abort): whether the params hold a mix now.
  void settle_torn(StepOutcome& out);
  // Aborted while receiving, torn: a late ack tells the coordinator (status).
  void report_late_landing(const StepOutcome& out);
  bool wait_decision(int64_t step, Clock::time_point deadline, std::string& reason);
  void publish_staging();
  std::string quantize(StepOutcome& out);
};

void Subscriber::Impl::ensure_ready() {
  if (ready) return;
  const std::string who = cat("engine rank ", global);
  check_registered_all(who);
  pipeline::SetupSpec spec;
  spec.who = who;
  spec.trainer_side = false;
  spec.rank = global;
  spec.job = opt.job;
  spec.transport = opt.transport;
  spec.trainer = opt.trainer;
  spec.engine = engine;
  const auto& ps = rank_layout().params;
  spec.memory = on_weights ? weights_memory()
                           : pipeline::rank_memory(
                                 params, [&](size_t i) { return ps[i].name; }, spec.who);
  spec.connect_timeout = opt.connect_timeout;
  pipeline::DataPath dp = pipeline::open_data_path(*client, spec);
  trainer = std::move(dp.trainer);
  take(dp);
  if (elastic) {
    use_plan(likely_replicas());
  } else {
    build_receiver(*dp.plan);
    plan = std::move(dp.plan);
  }
  // Elastic: engines only ever talk with trainers, and other replicas come and go.
  pipeline::connect_peers(*transport, elastic ? static_cast<int>(trainer->mesh.world()) : 0);
  trainer_member.assign(static_cast<size_t>(trainer->mesh.world()), 0);
  for (const auto& mem : client->members())
    if (mem.role == control::Role::trainer && mem.rank >= 0 &&
        mem.rank < static_cast<int>(trainer_member.size()))
      trainer_member[static_cast<size_t>(mem.rank)] = mem.id;
  if (elastic) {
    // Ready for steps: trainer rank 0 may now include this rank's replica.
    const std::string id = std::to_string(client->member_id());
    client->set(pipeline::JobKeys{opt.job}.ready(global),
                std::vector<uint8_t>(id.begin(), id.end()));
  }
  // The options read above may be those of a process that held trainer
  // rank 0 just before the one recorded here: read them again at the first
  // step (one fetch; nothing is rebuilt when they are the same).
  leader_changed = true;
  ready = true;
}

void Subscriber::Impl::check_registered_all(const std::string& who) const {
  const auto& ps = rank_layout().params;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (on_weights && registered[i])
      fail(Errc::invalid_argument, who, ": param '", ps[i].name, "' was registered, but in ",
           "load_weights mode (on_weights) the rank registers no params");
    if (!on_weights && !registered[i])
      fail(Errc::invalid_argument, who, ": param '", ps[i].name,
           "' was not registered before the first step");
  }
  if (on_weights && engine::has_fp8(rank_layout()))
    fail(Errc::unsupported, who, ": load_weights mode (on_weights) with an FP8 engine config: ",
         "the HF tensors go to the engine's loader unquantized; drop \"quantization\" or ",
         "register the params");
  if (on_weights && opt.staging)
    fail(Errc::invalid_argument, who, ": load_weights mode (on_weights) takes no staging copy: ",
         "the engine's own loader writes its params");
}

// The membership the next step most likely serves: the replicas with a live
// engine, this one among them (a step that serves other ones makes its own plan).
std::vector<int> Subscriber::Impl::likely_replicas() {
  std::set<int> guess{opt.replica};
  for (const auto& m : client->members())
    if (m.role == control::Role::engine && m.replica >= 0 && m.replica < engine.num_replicas())
      guess.insert(m.replica);
  return {guess.begin(), guess.end()};
}

void Subscriber::Impl::build_receiver(const Plan& p) {
  pipeline.reset();  // its slots first
  fp8.reset();
  const std::string who = cat("engine rank ", global);
  if (on_weights) open_arena(p);
  std::unique_ptr<engine::Fp8Staging> quant;
  if (engine::has_fp8(rank_layout()))
    quant = std::make_unique<engine::Fp8Staging>(p, p.engine_template(global), rank_layout(),
                                                 params, *transport, who);
  auto receiver = std::make_unique<engine::ReceivePipeline>(
      p, global, quant ? quant->targets() : params, opt.staging, memory, wire, *transport);
  receiver->prepare(*transport, slots, slot_device);
  if (on_weights) receiver->on_bucket([this](size_t k) { deliver(k); });
  pipeline = std::move(receiver);
  fp8 = std::move(quant);
}

void Subscriber::Impl::use_plan(const std::vector<int>& replicas) {
  const std::vector<int32_t> want(replicas.begin(), replicas.end());
  if (plan && plan->options().replicas == want) return;
  PlanOptions o = plan_options;
  o.replicas = want;
  plan.reset();
  Plan p = make_plan(*trainer, engine, Topology{}, o);
  build_receiver(p);
  plan = std::move(p);
}

void Subscriber::Impl::follow_published_plan(const control::StepBegin& begin) {
  const bool new_leader = std::exchange(leader_changed, false);
  if (!trainer) return;
  if (!new_leader && (elastic || (plan && begin.plan_id == plan->plan_id_hex()))) return;
  const std::string who = cat("engine rank ", global);
  try {
    pipeline::PublishedPlan now =
        pipeline::fetch_published_plan(*client, opt.job, who, opt.connect_timeout);
    if (now.trainer.mesh.world() != trainer->mesh.world())
      fail(Errc::unsupported, "the trainers are now ", now.trainer.mesh.world(), " ranks, were ",
           trainer->mesh.world(), " (a job keeps its trainer world)");
    const bool same_wire = now.wire.to_json() == wire.to_json();
    const bool same =
        same_wire && now.options == plan_options && now.trainer.to_json() == trainer->to_json();
    // Nothing changed (the usual first step): no plan is made again.
    if (same && (elastic || (plan && begin.plan_id == plan->plan_id_hex()))) return;
    std::optional<Plan> p;
    if (!elastic) {
      p = make_plan(now.trainer, engine, Topology{}, now.options);
      if (p->plan_id_hex() != begin.plan_id)
        fail(Errc::mismatch, "trainer rank 0 publishes plan ", p->plan_id_hex(),
             ", not the step's");
      // The same plan and options: the receiver (and a load_weights arena's
      // version) stays.
      if (same_wire && plan && p->plan_id_hex() == plan->plan_id_hex()) return;
    }
    plan.reset();
    pipeline.reset();
    trainer = std::move(now.trainer);
    plan_options = now.options;
    adopt_wire(now.wire);
    if (!p) return;  // elastic: use_plan() makes the step's plan and receiver
    build_receiver(*p);
    plan = std::move(p);
  } catch (const Error& e) {
    leader_changed = new_leader;  // tried again at the next step
    adopt_error = cat(who, ": step ", begin.step, " uses plan ", begin.plan_id,
                      ", this engine has plan ", plan ? plan->plan_id_hex() : std::string("none"),
                      ", and taking the job's current one failed: ", e.what());
  }
}

void Subscriber::Impl::adopt_wire(const WireOptions& now) {
  pipeline::choose_slots(memory, transport->capabilities(), now, cat("engine rank ", global),
                         opt.transport, slots, slot_device);
  wire = now;
}

pipeline::RankMemory Subscriber::Impl::weights_memory() const {
  if (opt.weights_device < 0) return {MemoryKind::host, -1, true};
  return {MemoryKind::cuda, opt.weights_device, true};
}

// The arena and, in it, each HF key of the rank as the param it applies into.
void Subscriber::Impl::open_arena(const Plan& p) {
  // With delta sync every tensor keeps its own place from step to step: the
  // arena holds the version a delta applies to.
  delivery = engine::plan_delivery(p, global, rank_layout(), /*keep_version=*/wire.delta);
  arena_version = -1;
  const auto bytes = static_cast<size_t>(std::max<int64_t>(delivery.arena_bytes, 1));
  const pipeline::RankMemory memory = weights_memory();
  char* base = nullptr;
  if (memory.memory == MemoryKind::cuda) {
    arena_device = gpu::Memory(bytes, gpu::MemoryPlace::device, memory.device);
    base = arena_device.data();
  } else {
    // 4 KiB-aligned inside the allocation, like the transports' slots.
    arena_host.reset(new char[bytes + 4096]);
    base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(arena_host.get()) + 4095) &
                                   ~uintptr_t{4095});
  }
  const auto& ps = rank_layout().params;
  for (size_t i = 0; i < ps.size(); ++i)
    params[i] = tensor_view(base + delivery.offset[i], ps[i].dtype, ps[i].shape, memory.memory,
                            memory.device);
}

// Hands the tensors bucket k completed to the engine. A failure is kept for
// the ack; later buckets still land (the senders must not stall) but go to
// the engine no more.
void Subscriber::Impl::deliver(size_t k) {
  if (!weights_error.empty()) return;
  std::vector<std::pair<std::string, TensorView>> batch;
  for (uint32_t p : delivery.complete_after.at(k))
    if (!weights_changed_only || !wire.delta || pipeline->changed(p))
      batch.emplace_back(rank_layout().params[p].name, params[p]);
  if (batch.empty()) return;
  weights_handed += batch.size();
  try {
    on_weights(current_step, batch);
  } catch (const std::exception& e) {
    weights_error = cat("engine rank ", global, ": the on_weights hook of step ", current_step,
                        " failed: ", e.what());
  }
}

void Subscriber::Impl::note(const control::Event& ev) {
  if (const auto* left = std::get_if<control::MemberLeft>(&ev))
    trainers_changed = trainers_changed || left->member.role == control::Role::trainer;
}

void Subscriber::Impl::follow_trainers() {
  bool failed = false;
  for (size_t r = 0; r < trainer_member.size(); ++r)
    failed = failed || transport->peer_failed(static_cast<int>(r));
  if (!trainers_changed && !failed) return;
  trainers_changed = false;
  for (const auto& mem : client->members()) {
    if (mem.role != control::Role::trainer || mem.rank < 0 ||
        mem.rank >= static_cast<int>(trainer_member.size()))
      continue;
    uint64_t& known = trainer_member[static_cast<size_t>(mem.rank)];
    // The same process whose connection failed while it lives on (it gave
    // this rank up when a failed step's sends were cancelled; its
    // coordinator died; a link flapped): a new connection too.
    const bool same = known == mem.id;
    if (same && !transport->peer_failed(mem.rank)) continue;
    if (!same && known != 0 && mem.rank == 0) leader_changed = true;
    if (known != 0) {
      try {
        transport->reconnect(mem.rank);
      } catch (const Error& e) {
        if (e.code() != Errc::unsupported) throw;
        continue;  // this backend cannot take a new process in: the step fails naming it
      }
    }
    known = mem.id;
  }
}

void Subscriber::Impl::poll() {
  if (client->connection_losses() != losses_at_begin) {
    abort_reason = cat("lost the coordinator ", client->address(), " during the step");
    fail(Errc::cancelled, "engine rank ", global, ": step ", current_step,
         " aborted: ", abort_reason);
  }
  while (auto ev = client->poll_event()) {
    note(*ev);
    if (auto* abort = std::get_if<control::Abort>(&*ev); abort && abort->step == current_step) {
      abort_reason = abort->reason;
      fail(Errc::cancelled, "engine rank ", global, ": step ", current_step,
           " aborted: ", abort->reason);
    }
  }
}

bool Subscriber::Impl::wait_decision(int64_t step, Clock::time_point deadline,
                                     std::string& reason) {
  const auto began = Clock::now();
  while (true) {
    // A coordinator lost meanwhile never decides: a restarted one, reached
    // again, knows nothing of the step (run_step's caller ends it uncommitted).
    if (client->connection_losses() != losses_at_begin)
      fail(Errc::peer_failure, "the connection was lost while waiting for the decision");
    control::Event ev;
    try {
      ev = client->wait_event(std::min(Millis(100), left_until(deadline)));
    } catch (const Error& e) {
      if (e.code() == Errc::timeout && Clock::now() < deadline) continue;
      fail(e.code(), "engine rank ", global, ": step ", step, ": acked, then waited ",
           seconds_since(began), " s for the coordinator's decision: ", e.what());
    }
    note(ev);  // a trainer that left while the step was decided
    if (auto* c = std::get_if<control::Commit>(&ev); c && c->step == step) return true;
    if (auto* a = std::get_if<control::Abort>(&ev); a && a->step == step) {
      reason = a->reason;
      return false;
    }
  }
}

void Subscriber::Impl::publish_staging() {
  pipeline->publish_staging();
}

// FP8 engines: the step's weights, landed in their staging tensors, into the
// FP8 params and scales. "" or the failure.
std::string Subscriber::Impl::quantize(StepOutcome& out) {
  if (!fp8) return {};
  TraceSpan span(opt.tracer, "quantize fp8", "apply");
  const auto start = Clock::now();
  try {
    fp8->quantize();
  } catch (const std::exception& e) {
    return cat("engine rank ", global, ": quantizing the FP8 params of step ", out.step,
               " failed: ", e.what());
  }
  out.phases.apply += seconds_since(start);
  return {};
}

StepOutcome Subscriber::Impl::run_one(const control::StepBegin& begin) {
  const auto start = Clock::now();
  const auto deadline = start + opt.step_timeout;
  TraceSpan whole(opt.tracer, cat("step ", begin.step), "step");
  StepOutcome out;
  out.step = begin.step;
  current_step = begin.step;
  losses_at_begin = client->connection_losses();
  weights_handed = 0;
  landing = false;
  stopped = false;
  abort_reason.clear();
  // A hook that throws fails this step on this rank, never the process: the
  // step's data is still received (the senders must not stall) and the ack
  // says why.
  const std::string begin_error = run_hook(on_begin, "on_begin", begin.step);
  weights_error.clear();
  std::optional<engine::ReceiveReport> report = receive(begin, deadline, out);
  if (!report) {  // aborted while receiving: no ack, no decision to wait for
    out.reason = abort_reason;
    out.seconds = seconds_since(start);
    settle_torn(out);
    client->set_resume({version.load(), -1, torn.load()});
    if (out.torn) report_late_landing(out);
    end_hook(out);
    return out;
  }
  if (report->error.empty()) report->error = begin_error;
  if (report->error.empty()) report->error = weights_error;
  apply(begin.step, *report, out);
  const control::StepAck ack = acked(begin.step, *report, out);
  const auto commit_start = Clock::now();
  {
    TraceSpan span(opt.tracer, "ack+decision", "control");
    // At most what is left of the step (and a second): a coordinator that
    // cannot be reached must not hold the engine past the step's deadline.
    try {
      if (client->connection_losses() != losses_at_begin)
        fail(Errc::peer_failure, "the connection was lost during the step");
      client->ack(ack, std::max(Millis(1000), left_until(deadline)));
      out.committed = wait_decision(begin.step, deadline + control::kDecisionGrace, out.reason);
    } catch (const Error& e) {
      // No decision reaches this rank, so the step does not commit here;
      // the rank serves on (a step's failure never ends the engine):
      // - the coordinator died or the link broke (a restarted coordinator
      //   knows nothing of the step; an ack that reached it after a loss
      //   just past the check above, it refuses: "not open");
      // - the coordinator decided the step before the ack came ("not open")
      //   or not within the deadline (a step a restarted coordinator opened
      //   for some trainer ranks only).
      out.committed = false;
      const bool lost =
          e.code() == Errc::peer_failure || client->connection_losses() != losses_at_begin;
      out.reason = cat("engine rank ", global, ": step ", begin.step,
                       lost ? ": lost the coordinator before its decision ("
                            : ": no decision from the coordinator (",
                       e.what(), "); the step does not commit here");
    }
  }
  if (out.committed) commit(begin.step, out);
  out.phases.commit = seconds_since(commit_start);
  out.seconds = seconds_since(start);
  settle_torn(out);
  client->set_resume({version.load(), -1, torn.load()});
  end_hook(out);
  return out;
}

std::optional<engine::ReceiveReport> Subscriber::Impl::receive(const control::StepBegin& begin,
                                                               Clock::time_point deadline,
                                                               StepOutcome& out) {
  engine::ReceiveReport report;
  if (!adopt_error.empty() || !plan || !pipeline) {
    report.error = adopt_error.empty()
                       ? cat("engine rank ", global, ": no plan for step ", begin.step)
                       : adopt_error;
    return report;
  }
  if (begin.plan_id != plan->plan_id_hex()) {
    report.error = cat("engine rank ", global, ": step ", begin.step, " uses plan ", begin.plan_id,
                       " but this engine computed plan ", plan->plan_id_hex(),
                       " (layouts or plan options differ)");
    return report;
  }
  try {
    pipeline->set_version(on_weights ? arena_version : version.load());
    // Without staging, receives land in the params from now on.
    landing = !opt.staging && !on_weights;
    return pipeline->run(
        begin.step, *transport, [this] { poll(); }, deadline, out.phases, opt.tracer);
  } catch (const Error& e) {
    pipeline->cancel_all();
    if (!abort_reason.empty()) return std::nullopt;
    stopped = true;  // the trainers are told to stop sending to this rank
    report.error = e.what();
    return report;
  }
}

void Subscriber::Impl::apply(int64_t step, engine::ReceiveReport& report, StepOutcome& out) {
  // Without staging the params take the step now, before the ack; with it,
  // at commit, after the staging copy is published.
  if (report.error.empty() && !opt.staging) report.error = quantize(out);
  // load_weights mode: every tensor went to the engine; its post-load step
  // (process_weights_after_loading) belongs to the step, before the ack.
  if (report.error.empty() && on_weights) {
    report.error = run_hook(on_loaded, "on_loaded", step);
    // The engine's copies out of a CUDA arena (load_weights' param.copy_)
    // may still be queued on its streams: the next step rewrites the arena.
    if (weights_memory().memory == MemoryKind::cuda) gpu::synchronize_device(opt.weights_device);
  }
}

control::StepAck Subscriber::Impl::acked(int64_t step, const engine::ReceiveReport& report,
                                         StepOutcome& out) const {
  control::StepAck ack;
  ack.step = step;
  ack.ok = report.error.empty();
  ack.bytes = report.bytes;
  ack.checksum = report.checksum;
  ack.error = report.error;
  ack.landed = landing || weights_handed > 0;
  ack.stopped = stopped;
  ack.stats.phases = {
      {"receive", out.phases.receive}, {"verify", out.phases.verify}, {"apply", out.phases.apply}};
  ack.stats.bytes = report.bytes;
  ack.stats.staging_bytes = pipeline ? pipeline->staging_bytes() : 0;
  out.bytes = report.bytes;
  out.bytes_direct = report.bytes_direct;
  out.buckets_lent = report.buckets_lent;
  out.delta_buckets = report.delta_buckets;
  out.weights_handed = weights_handed;
  out.checksum = report.checksum;
  return ack;
}

void Subscriber::Impl::commit(int64_t step, StepOutcome& out) {
  TraceSpan span(opt.tracer, "publish", "apply");
  if (opt.staging) {
    publish_staging();
    const std::string error = quantize(out);
    if (!error.empty()) out.reason = error;
  }
  version = step;
  if (on_weights) arena_version = step;
}

std::string Subscriber::Impl::run_hook(const std::function<void(int64_t)>& hook, const char* name,
                                       int64_t step) {
  if (!hook) return {};
  try {
    hook(step);
    return {};
  } catch (const std::exception& e) {
    return cat("engine rank ", global, ": the ", name, " hook of step ", step,
               " failed: ", e.what());
  }
}

// A commit writes every element of the rank's params (exact cover), so it
// ends a mix; a step that did not commit but wrote some of them (or handed
// the engine some tensors) leaves one, which nothing restores: the rank
// says so until its next commit, and its version stays the last committed.
void Subscriber::Impl::settle_torn(StepOutcome& out) {
  if (out.committed)
    torn = false;
  else if (landing || weights_handed > 0)
    torn = true;
  out.torn = torn;
  if (out.torn && !out.committed) {
    out.torn_reason =
        cat("engine rank ", global, " is torn: step ", out.step,
            " may have written part of its params (no staging) and did not commit; version ",
            version.load(), " is no longer whole until the next commit");
    out.reason = (out.reason.empty() ? std::string() : out.reason + "; ") + out.torn_reason;
  }
}

void Subscriber::Impl::report_late_landing(const StepOutcome& out) {
  control::StepAck ack;
  ack.step = out.step;
  ack.ok = false;
  ack.error = out.reason;
  ack.landed = true;
  try {
    client->ack(ack, Millis(1000));
  } catch (const Error&) {
    // Only the coordinator's status misses it; torn() says it here.
  }
}

// on_end runs after the decision: a failure cannot undo a commit, so it is
// reported in the outcome's reason (committed stays as decided).
void Subscriber::Impl::end_hook(StepOutcome& out) {
  const std::string error = run_hook(on_end, "on_end", out.step);
  if (error.empty()) return;
  out.reason = out.reason.empty() ? error : out.reason + "; " + error;
}

Subscriber::Subscriber(SubscriberOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = std::move(options);
  m.engine = make_engine_layout(m.opt.engine);
  try {
    m.global = m.engine.global_rank(m.opt.replica, m.opt.rank);
  } catch (const Error& e) {
    fail(e.code(), "subscriber: ", e.what());
  }
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
  c.parity = m.opt.parity;
  c.connect_timeout = m.opt.connect_timeout;
  c.reconnect_timeout = m.opt.coordinator_reconnect;
  m.client = std::make_unique<control::Client>(c);
  if (m.global == 0) {
    const std::string config = m.opt.engine.to_json().dump();
    m.client->set(pipeline::JobKeys{m.opt.job}.engine_config(),
                  std::vector<uint8_t>(config.begin(), config.end()));
  }
}

Subscriber::~Subscriber() {
  if (!impl_) return;
  impl_->pipeline.reset();
  impl_->fp8.reset();
  // Leave first: the trainers stop counting on this rank at once (the next
  // step's membership), while the transport's teardown may take a while.
  try {
    if (impl_->client) impl_->client->leave();
  } catch (const Error&) {
  }
  impl_->close_transport();
}

void Subscriber::register_param(const std::string& name, const TensorView& param) {
  Impl& m = *impl_;
  if (m.ready)
    fail(Errc::invalid_argument, "engine rank ", m.global, ": register_param('", name,
         "') after the first step");
  auto it = m.index.find(name);
  if (it == m.index.end())
    fail(Errc::not_found, "engine rank ", m.global, ": param '", name,
         "' is not in this rank's engine layout (", m.index.size(), " params)");
  const EngineParam& spec = m.rank_layout().params[it->second];
  pipeline::check_registered(cat("engine rank ", m.global), name, param, spec.dtype, spec.shape,
                             "the engine layout says", "the engine layout says",
                             /*written=*/true);
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

void Subscriber::on_weights(WeightsHook hook, bool changed_only) {
  if (impl_->ready)
    fail(Errc::invalid_argument, "engine rank ", impl_->global,
         ": on_weights must be set before the first step");
  impl_->on_weights = std::move(hook);
  impl_->weights_changed_only = changed_only;
}

void Subscriber::on_loaded(std::function<void(int64_t)> hook) {
  impl_->on_loaded = std::move(hook);
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
      // The coordinator is gone, and the client is reaching it again: no
      // step now; the engine keeps serving its version meanwhile.
      if (e.code() == Errc::peer_failure && m.client->reconnecting()) return std::nullopt;
      throw;
    }
    m.note(*ev);
    if (auto* begin = std::get_if<control::StepBegin>(&*ev)) {
      m.adopt_error.clear();
      m.follow_trainers();
      m.follow_published_plan(*begin);
      if (begin->replicas) {
        // Elastic replicas: a step that does not serve this rank's replica
        // is not its business (it keeps its version); one that does brings
        // its membership's plan.
        if (!std::binary_search(begin->replicas->begin(), begin->replicas->end(), m.opt.replica))
          continue;
        try {
          m.use_plan(*begin->replicas);
        } catch (const Error& e) {
          m.adopt_error = cat("engine rank ", m.global, ": making the plan of step ", begin->step,
                              " failed: ", e.what());
        }
      }
      return m.run_one(*begin);
    }
    // Membership changes and decisions of steps already handled need nothing here.
  }
}

void Subscriber::serve() {
  while (!impl_->stopping) static_cast<void>(run_step(Millis(200)));  // outcomes go to the hooks
}

void Subscriber::stop() {
  impl_->stopping = true;
}
bool Subscriber::torn() const {
  return impl_->torn;
}

void Subscriber::restored(int64_t step) {
  impl_->torn = false;
  impl_->client->set_resume({impl_->version.load(), -1, false});
  impl_->client->restored(step);
}

bool Subscriber::applied(int64_t step, const std::map<std::string, int64_t>& requests,
                         std::chrono::milliseconds wait) {
  return impl_->client->applied(step, requests, wait);
}

void Subscriber::set_coordinator(const std::string& address) {
  impl_->client->set_address(address);
}

std::string Subscriber::coordinator() const {
  return impl_->client->address();
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
