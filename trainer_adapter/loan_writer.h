// Lent buckets on a trainer rank (pipeline/wire.h): each step, the engine
// ranks this rank serves lendable buckets lend it their params; it maps
// them, compiles each lendable bucket's copy straight into them (again only
// when the addresses changed) and runs those copies on a copier of its own.
// The SendPipeline posts the zero-byte message that says a copy is done.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/engine_layout.h>
#include "send_action.h"

#include "pipeline/copier.h"
#include "pipeline/loop.h"
#include "pipeline/setup.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace weightsync::trainer {

// An engine rank this trainer rank serves lendable buckets: the params it
// lends, as views at the addresses the loan mapped them to.
struct Loan {
  int engine = -1;                  // global engine rank
  std::vector<int> params;          // pipeline::lent_params, ascending
  std::vector<TensorView> targets;  // by params' order: shape, dtype, mapped address
  std::vector<void*> addresses;     // this step's mapping
  std::vector<void*> compiled_for;  // the addresses the `lent` programs write to
  std::unique_ptr<Request> map;
  bool lent = false;  // this step: its lendable buckets are lent
};

// A lent bucket's copy, launched and not yet said to be done.
struct LentCopy {
  size_t index = 0;  // the action
  int slot = 0;      // the SendPipeline's slot that carries its message
  int event = 0;     // the copier's
};

class LoanWriter {
 public:
  // The loans each engine rank makes this rank, as the plan lays them out
  // (the engine rank derives the same), and the lendable actions' items.
  // `engine` (its params' shapes and dtypes) lets the engine ranks lend;
  // without it every loan is declined. `memory`: the transport's.
  void compile(const Plan& plan, std::vector<SendAction>& actions,
               const std::vector<TensorView>& tensors, const EngineLayout* engine,
               MemoryKind memory);
  bool active() const { return active_; }
  MemoryKind memory() const { return memory_; }

  // Maps this step's loans (an engine rank whose map fails with
  // peer_failure is marked dead; any other failure, a decline or an empty
  // loan sends its buckets as fragments) and recompiles the programs of
  // those whose addresses changed. `memory`: this rank's tensors'.
  void begin(int64_t step, int rank, int trainer_world, std::vector<SendAction>& actions,
             const pipeline::RankMemory& memory, pipeline::Loop& loop, std::vector<bool>& dead);
  // Whether `a` is lent this step.
  bool lent(const SendAction& a) const;
  // Launches action `index`'s copy into the lent params; returns the copy
  // launched before it, not yet settled.
  std::optional<LentCopy> launch(size_t index, const SendAction& a, int slot);
  // The launched copy not yet settled, now taken (nothing when none).
  std::optional<LentCopy> take_launched();
  // Waits for `copy` to complete.
  void wait(const LentCopy& copy, pipeline::Loop& loop);
  // After a failure: forgets the launched copy and the maps.
  void cancel();

 private:
  void map(int64_t step, int trainer_world, const pipeline::RankMemory& memory, Transport& t,
           std::vector<bool>& dead);
  // Whether `l`, mapped, was lent (and compiled for its addresses);
  // `changed` once a program was compiled again.
  bool settle(Loan& l, int64_t step, int rank, std::vector<SendAction>& actions,
              pipeline::Loop& loop, std::vector<bool>& dead, bool& changed);
  void compile_loan(Loan& loan, std::vector<SendAction>& actions);

  bool active_ = false;
  MemoryKind memory_ = MemoryKind::cuda;
  std::vector<TensorView> tensors_;
  std::vector<Loan> loans_;
  pipeline::Copier copier_;
  int event_ = 0;
  std::optional<LentCopy> launched_;
};

}  // namespace weightsync::trainer
