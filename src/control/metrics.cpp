#include "metrics.h"

#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#ifdef WEIGHTSYNC_WITH_PROMETHEUS
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#endif

#include <string>

namespace weightsync::control {

#ifdef WEIGHTSYNC_WITH_PROMETHEUS

namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using Labels = std::map<std::string, std::string>;

Labels rank_labels(Role role, int rank) {
  return {{"role", std::string(role_name(role))}, {"rank", std::to_string(rank)}};
}

const prometheus::Histogram::BucketBoundaries& step_buckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets{
      0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
  return kBuckets;
}

// The step-abort classes of step_decided (coordinator_status.cpp).
constexpr const char* kAbortReasons[] = {"trainer_failed", "trainer_lost", "timeout",
                                         "no_engine_committed"};

}  // namespace

struct Metrics::Impl {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *registry;
  prometheus::Family<prometheus::Counter>& begun =
      BuildCounter().Name("weightsync_steps_begun_total").Help("Steps begun").Register(r);
  prometheus::Family<prometheus::Counter>& committed =
      BuildCounter()
          .Name("weightsync_steps_committed_total")
          .Help("Steps decided with the trainers' data sent and at least one engine rank committed")
          .Register(r);
  prometheus::Family<prometheus::Counter>& aborted =
      BuildCounter()
          .Name("weightsync_steps_aborted_total")
          .Help("Steps that no engine rank committed, by reason")
          .Register(r);
  prometheus::Family<prometheus::Histogram>& step_seconds =
      BuildHistogram()
          .Name("weightsync_step_seconds")
          .Help("Time from a step's begin to its decision")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& step_bytes =
      BuildGauge()
          .Name("weightsync_step_bytes")
          .Help("Bytes the engine ranks acked in the last decided step")
          .Register(r);
  prometheus::Family<prometheus::Counter>& bytes =
      BuildCounter()
          .Name("weightsync_bytes_total")
          .Help("Bytes the engine ranks acked, over all steps")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& members =
      BuildGauge().Name("weightsync_members").Help("Live members by role").Register(r);
  prometheus::Family<prometheus::Gauge>& replicas =
      BuildGauge()
          .Name("weightsync_replicas_active")
          .Help("Engine replicas with at least one live rank")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& version =
      BuildGauge()
          .Name("weightsync_engine_version")
          .Help("Each engine rank's committed weight version (step)")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& lag =
      BuildGauge()
          .Name("weightsync_engine_version_lag")
          .Help("Steps an engine rank's committed version is behind the newest committed one")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& torn =
      BuildGauge()
          .Name("weightsync_engine_torn")
          .Help("1 while an engine rank's params hold part of a step that did not commit")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& applied =
      BuildGauge()
          .Name("weightsync_engine_applied_step")
          .Help(
              "The committed step each engine rank serves, from the end of its apply (staged "
              "ranks serve a committed step only once applied)")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& applied_at =
      BuildGauge()
          .Name("weightsync_engine_applied_timestamp_seconds")
          .Help(
              "When each engine rank's apply of weightsync_engine_applied_step ended (seconds "
              "since the epoch, the coordinator's clock)")
          .Register(r);
  prometheus::Family<prometheus::Counter>& plan_changes =
      BuildCounter()
          .Name("weightsync_plan_changes_total")
          .Help("Steps that began with another plan than the step before")
          .Register(r);
  prometheus::Family<prometheus::Counter>& lost =
      BuildCounter()
          .Name("weightsync_member_failures_total")
          .Help("Members that were dropped without leaving, by role, rank and reason")
          .Register(r);
  prometheus::Family<prometheus::Counter>& engine_failures =
      BuildCounter()
          .Name("weightsync_engine_step_failures_total")
          .Help("Steps an engine rank did not commit, by reason")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& phase =
      BuildGauge()
          .Name("weightsync_rank_phase_seconds")
          .Help("Seconds of each phase of a rank's last step, as the rank reported them")
          .Register(r);
  prometheus::Family<prometheus::Gauge>& staging = BuildGauge()
                                                       .Name("weightsync_rank_staging_bytes")
                                                       .Help("Staging memory of a rank's data path")
                                                       .Register(r);
  prometheus::Family<prometheus::Counter>& rank_bytes =
      BuildCounter()
          .Name("weightsync_rank_bytes_total")
          .Help("Bytes a rank sent (trainer) or received (engine), as it reported them")
          .Register(r);
  std::string last_plan;
  // Last: destroyed first, so that no scrape runs while the metrics go.
  std::unique_ptr<prometheus::Exposer> exposer;
};

Metrics::Metrics(const std::string& host, int port) : impl_(std::make_unique<Impl>()) {
  if (port < 0 || port > 65535)
    fail(Errc::invalid_argument, "metrics port ", port, " is outside 0..65535");
  try {
    impl_->exposer = std::make_unique<prometheus::Exposer>(cat(host, ":", port));
  } catch (const std::exception& e) {
    fail(Errc::io, "cannot serve metrics on ", host, ":", port, ": ", e.what());
  }
  export_zeros();
  impl_->exposer->RegisterCollectable(impl_->registry);
}

// Every series that has no per-rank label exists from the start, at 0: an
// alert on an absent series must not fire on a healthy coordinator that has
// no job yet.
void Metrics::export_zeros() {
  Impl& m = *impl_;
  m.begun.Add({});
  m.committed.Add({});
  for (const char* reason : kAbortReasons) m.aborted.Add({{"reason", reason}});
  m.step_seconds.Add({}, step_buckets());
  m.step_bytes.Add({});
  m.bytes.Add({});
  m.plan_changes.Add({});
  membership(0, 0, 0, 0);
}

Metrics::~Metrics() = default;

uint16_t Metrics::port() const {
  const auto ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : static_cast<uint16_t>(ports.front());
}

void Metrics::membership(int trainers, int engines, int observers, int replicas) {
  impl_->members.Add({{"role", "trainer"}}).Set(trainers);
  impl_->members.Add({{"role", "engine"}}).Set(engines);
  impl_->members.Add({{"role", "observer"}}).Set(observers);
  impl_->replicas.Add({}).Set(replicas);
}

void Metrics::member_lost(Role role, int rank, const std::string& reason) {
  Labels l = rank_labels(role, rank);
  l["reason"] = reason;
  impl_->lost.Add(l).Increment();
}

void Metrics::step_begun(const std::string& plan_id) {
  impl_->begun.Add({}).Increment();
  if (!impl_->last_plan.empty() && plan_id != impl_->last_plan)
    impl_->plan_changes.Add({}).Increment();
  impl_->last_plan = plan_id;
}

void Metrics::step_decided(double seconds, uint64_t bytes, bool committed,
                           const std::string& abort_reason) {
  impl_->step_seconds.Add({}, step_buckets()).Observe(seconds);
  impl_->step_bytes.Add({}).Set(static_cast<double>(bytes));
  impl_->bytes.Add({}).Increment(static_cast<double>(bytes));
  if (committed)
    impl_->committed.Add({}).Increment();
  else
    impl_->aborted.Add({{"reason", abort_reason}}).Increment();
}

void Metrics::engine_step_failed(int rank, const std::string& reason) {
  impl_->engine_failures.Add({{"engine_rank", std::to_string(rank)}, {"reason", reason}})
      .Increment();
}

void Metrics::engine_version(int rank, int64_t version, int64_t newest) {
  const Labels l{{"engine_rank", std::to_string(rank)}};
  impl_->version.Add(l).Set(static_cast<double>(version));
  impl_->lag.Add(l).Set(static_cast<double>(newest - version));
}

void Metrics::engine_torn(int rank, bool torn) {
  impl_->torn.Add({{"engine_rank", std::to_string(rank)}}).Set(torn ? 1.0 : 0.0);
}

void Metrics::engine_applied(int rank, int64_t step, double at) {
  const Labels l{{"engine_rank", std::to_string(rank)}};
  impl_->applied.Add(l).Set(static_cast<double>(step));
  impl_->applied_at.Add(l).Set(at);
}

void Metrics::rank_stats(Role role, int rank, const nlohmann::json& stats) {
  if (!stats.is_object()) return;
  const Labels who = rank_labels(role, rank);
  if (const auto p = stats.find("phases"); p != stats.end() && p->is_object())
    for (const auto& [name, seconds] : p->items()) {
      if (!seconds.is_number()) continue;
      Labels l = who;
      l["phase"] = name;
      impl_->phase.Add(l).Set(seconds.get<double>());
    }
  if (const auto s = stats.find("staging_bytes"); s != stats.end() && s->is_number())
    impl_->staging.Add(who).Set(s->get<double>());
  if (const auto b = stats.find("bytes"); b != stats.end() && b->is_number())
    impl_->rank_bytes.Add(who).Increment(b->get<double>());
}

#else  // no prometheus-cpp: the coordinator refuses a metrics port

struct Metrics::Impl {};

Metrics::Metrics(const std::string& host, int port) {
  fail(Errc::unsupported, "metrics on ", host, ":", port,
       ": weightsync was built without prometheus-cpp (Debian: prometheus-cpp-dev)");
}
Metrics::~Metrics() = default;
uint16_t Metrics::port() const {
  return 0;
}
void Metrics::membership(int, int, int, int) {}
void Metrics::member_lost(Role, int, const std::string&) {}
void Metrics::step_begun(const std::string&) {}
void Metrics::step_decided(double, uint64_t, bool, const std::string&) {}
void Metrics::engine_step_failed(int, const std::string&) {}
void Metrics::engine_version(int, int64_t, int64_t) {}
void Metrics::engine_torn(int, bool) {}
void Metrics::engine_applied(int, int64_t, double) {}
void Metrics::rank_stats(Role, int, const nlohmann::json&) {}

#endif

}  // namespace weightsync::control
