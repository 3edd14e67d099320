#include "loan_writer.h"

#include <weightsync/error.h>

#include "pipeline/item_copies.h"

#include <algorithm>
#include <map>

namespace weightsync::trainer {

void LoanWriter::compile(const Plan& plan, std::vector<SendAction>& actions,
                         const std::vector<TensorView>& tensors, const EngineLayout* engine,
                         MemoryKind memory) {
  active_ = true;
  memory_ = memory;
  tensors_ = tensors;
  std::map<int, std::vector<int32_t>> lendable;  // by engine rank
  for (SendAction& a : actions) {
    if (a.kind != SendAction::Kind::p2p || !lendable_bucket(plan, a.bucket)) continue;
    a.lendable = true;
    for (const PlanItem& item : plan.items(a.bucket)) a.lend_items.push_back(plan.resolve(item));
    lendable[a.dst_engine].push_back(a.bucket);
  }
  for (const auto& [g, buckets] : lendable) {
    Loan l;
    l.engine = g;
    l.params = lent_params(plan, buckets);
    // Without the engine's layout the loans are declined: no views.
    if (engine) {
      // What the engine rank lends: the tensors it receives into (an FP8
      // weight it quantizes itself: its staging of the trainer's dtype).
      const EngineRankLayout& rl = engine->rank_layout(g);
      const std::vector<DType> dtypes = received_dtypes(plan, plan.engine_template(g), rl);
      for (int p : l.params)
        l.targets.push_back(tensor_view(nullptr, dtypes.at(static_cast<size_t>(p)),
                                        rl.params.at(static_cast<size_t>(p)).shape, memory_, -1));
    }
    loans_.push_back(std::move(l));
  }
}

void LoanWriter::begin(int64_t step, int rank, int trainer_world, std::vector<SendAction>& actions,
                       const pipeline::RankMemory& memory, pipeline::Loop& loop,
                       std::vector<bool>& dead) {
  map(step, trainer_world, memory, loop.transport(), dead);
  bool changed = false;
  for (Loan& l : loans_)
    if (l.map) l.lent = settle(l, step, rank, actions, loop, dead, changed);
  if (!changed) return;
  std::vector<const CopyProgram*> programs;
  for (const SendAction& a : actions) programs.push_back(&a.lent);
  copier_.prepare(programs, memory, 2);
}

void LoanWriter::map(int64_t step, int trainer_world, const pipeline::RankMemory& memory,
                     Transport& t, std::vector<bool>& dead) {
  // The loans are used only where this rank's copies can write the lent
  // memory: its tensors are in the transport's memory.
  const bool usable = memory.any && memory.memory == memory_;
  for (Loan& l : loans_) {
    l.lent = false;
    l.map.reset();
    if (dead[static_cast<size_t>(l.engine)]) continue;
    const bool take = usable && l.targets.size() == l.params.size();
    try {
      l.map =
          t.map_exposed(trainer_world + l.engine, lend_tag(step), take ? &l.addresses : nullptr);
    } catch (const Error&) {
      dead[static_cast<size_t>(l.engine)] = true;  // refused at posting, as a send would be
    }
  }
}

bool LoanWriter::settle(Loan& l, int64_t step, int rank, std::vector<SendAction>& actions,
                        pipeline::Loop& loop, std::vector<bool>& dead, bool& changed) {
  const std::optional<Error> failure = loop.settle(*l.map, [&] {
    return cat("the loan of engine rank ", l.engine, " (", l.map->describe(), ")");
  });
  l.map.reset();
  if (failure) {
    // Gone: dropped as a failed send drops it. Not mapped (an import
    // failed): the engine rank learned it too, and takes fragments.
    if (failure->code() == Errc::peer_failure) dead[static_cast<size_t>(l.engine)] = true;
    return false;
  }
  // Declined (no addresses asked for) or lent nothing: fragments.
  if (l.addresses.empty()) return false;
  if (l.addresses.size() != l.params.size())
    fail(Errc::mismatch, "trainer rank ", rank, ": step ", step, ": engine rank ", l.engine,
         " lent ", l.addresses.size(), " params, where the plan has ", l.params.size(),
         " (do both sides use the same plan?)");
  if (l.addresses != l.compiled_for) {
    compile_loan(l, actions);
    changed = true;
  }
  return true;
}

void LoanWriter::compile_loan(Loan& l, std::vector<SendAction>& actions) {
  for (size_t i = 0; i < l.params.size(); ++i) l.targets[i].data = l.addresses[i];
  for (SendAction& a : actions) {
    if (!a.lendable || a.dst_engine != l.engine) continue;
    a.lent = CopyProgram();
    for (const Copy& c : a.lend_items) {
      const auto at = std::lower_bound(l.params.begin(), l.params.end(), c.dst_param);
      pipeline::add_pack_apply(a.lent, c, tensors_.at(static_cast<size_t>(c.src_param)),
                               l.targets[static_cast<size_t>(at - l.params.begin())]);
    }
  }
  l.compiled_for = l.addresses;
}

bool LoanWriter::lent(const SendAction& a) const {
  return a.lendable && std::any_of(loans_.begin(), loans_.end(), [&](const Loan& l) {
           return l.lent && l.engine == a.dst_engine;
         });
}

std::optional<LentCopy> LoanWriter::launch(size_t index, const SendAction& a, int slot) {
  event_ ^= 1;
  copier_.run(index, a.lent, 0, 0, event_);
  std::optional<LentCopy> before = take_launched();
  launched_ = LentCopy{index, slot, event_};
  return before;
}

std::optional<LentCopy> LoanWriter::take_launched() {
  std::optional<LentCopy> out = launched_;
  launched_.reset();
  return out;
}

void LoanWriter::wait(const LentCopy& copy, pipeline::Loop& loop) {
  copier_.wait(copy.event, loop, "writing a bucket into lent params");
}

void LoanWriter::cancel() {
  launched_.reset();  // its copy wrote into the engine's params; the step is abandoned
  for (Loan& l : loans_) l.map.reset();
}

}  // namespace weightsync::trainer
