// `weightsync worker`: one rank of a demo/bench job. Started by the parent
// (`weightsync demo`, `weightsync bench`, the e2e tests), not by hand.
#include "cli.h"
#include "demo_job.h"

#include <weightsync/error.h>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync worker --job FILE --role trainer|engine --rank R [--restarted]\n\n"
    "One rank of a job started by `weightsync demo` or `weightsync bench`: they\n"
    "re-execute this binary once per trainer rank and engine rank. FILE is the job\n"
    "description the parent wrote (checkpoint, layouts, coordinator address, steps);\n"
    "R is the trainer rank or the global engine rank. Writes its stats (and trace)\n"
    "next to FILE; exit code 0 when its part succeeded (engines: every committed\n"
    "step matched the reference bit for bit).\n";

int run_worker(const std::vector<std::string>& argv) {
  Args args(argv, {"restarted"}, {"job", "role", "rank"});
  auto job = demo::JobSpec::load(args.require("job"));
  if (args.flag("restarted")) {
    // A rank started again after the kill drill: it is not killed again and
    // joins the steps still to come.
    job.kill = demo::KillSpec{};
    job.raw_rounds = 0;
  }
  const std::string role = args.require("role");
  const int rank = static_cast<int>(args.get_int("rank", -1));
  if (rank < 0) fail(Errc::invalid_argument, "--rank must be >= 0");
  if (role == "trainer") return demo::run_trainer_worker(job, rank);
  if (role == "engine") return demo::run_engine_worker(job, rank);
  fail(Errc::invalid_argument, "--role must be trainer or engine, got '", role, "'");
}

const CommandRegistrar registrar{
    {"worker", "(internal) one rank of a demo/bench job", kUsage, run_worker}};

}  // namespace
}  // namespace weightsync::cli
