// Publisher's state, shared by its files: publisher.cpp (the sync) and
// publisher_checkpoint.cpp (save_hf, load_hf). Not installed.
#pragma once

#include <weightsync/control.h>
#include <weightsync/publisher.h>

#include "checkpoint_save.h"
#include "pipeline/setup.h"
#include "publisher_pipeline.h"

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace weightsync {

struct Publisher::Impl : pipeline::Endpoint {
  PublisherOptions opt;
  std::vector<TensorView> tensors;
  std::optional<EngineLayout> engine;
  std::unique_ptr<trainer::SendPipeline> pipeline;
  std::map<int, uint64_t> ready_member;  // engine rank -> member id seen ready (rank 0)
  std::vector<bool> dead;                // engine ranks dropped (died or failed)
  std::vector<uint64_t> engine_member;   // member id of each engine rank's process (0: none yet)
  // Delta sync: the version each engine rank holds from this rank's sends,
  // as the last step's result says (committed: that step; else -1, unknown).
  std::vector<int64_t> held;
  std::optional<control::StepResult> early_result;
  // Coordinator connections lost before this push began: a push that sees
  // the count change lost its coordinator and fails at once.
  uint64_t losses_at_begin = 0;
  int64_t saves = 0;  // save_hf calls so far: every rank counts alike (a collective)
  trainer::SaveArenaCache save_arena;  // kept for the next save_hf
  std::mutex push_mutex;

  int trainer_world() const { return static_cast<int>(opt.layout.mesh.world()); }

  void ensure_ready();
  // The plan for `replicas` and a send pipeline for it, unless the current
  // plan is for them already.
  void use_plan(const std::vector<int>& replicas);
  // Rank 0, elastic: the replicas whose every rank is ready, once at least
  // min_replicas are (Errc::timeout at `deadline`).
  std::vector<int> choose_replicas(int64_t step, std::chrono::steady_clock::time_point deadline);
  void build_sender(const Plan& p);
  // Begins `step`: static, elastic leader, or elastic follower; then adopt
  // takes the leader's plan (elastic).
  control::StepStart begin(int64_t step, std::chrono::steady_clock::time_point deadline);
  void adopt(int64_t step, const control::StepStart& start);
  void poll();
  // A send to `engine_rank` failed in the current step: tells the coordinator.
  void report_send_failure(int engine_rank, const std::string& why);
  void admit(const std::vector<control::Member>& step_engines);
  PushResult push(int64_t step);
  // push's parts: the step's data sent and reported to the coordinator; a
  // failed send's cleanup (the coordinator told, briefly); the decision
  // taken into `out` and the engines' held versions.
  void send(int64_t step, const control::StepStart& begun,
            std::chrono::steady_clock::time_point deadline, PushResult& out);
  void give_up(int64_t step, const Error& e, std::chrono::steady_clock::time_point deadline);
  void settle(int64_t step, const control::StepResult& result, PushResult& out);
  control::StepResult decide(int64_t step, std::chrono::steady_clock::time_point deadline);
  // `e` with "step N:" after this rank's name, unless it names the step already.
  Error with_step(const Error& e, int64_t step) const;
  // Registration complete, else Errc::invalid_argument naming a param and `what`.
  void require_registered(const char* what) const;
};

}  // namespace weightsync
