// `weightsync bench control`: control-plane overhead of one step (begin,
// step_begin to every engine, acks, sent, commits, step_result) with no data
// moving, against the reference of one plain request round trip measured in
// the same run over the same coordinator.
#include "cli.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <thread>

namespace weightsync::cli {
namespace {

using control::Client;
using control::ClientOptions;
using control::Role;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kUsage =
    "usage: weightsync bench control [--engines N] [--steps K] [--json]\n\n"
    "In-process coordinator, one trainer and N engine clients over 127.0.0.1.\n"
    "Prints the median control-plane step latency and the median request round\n"
    "trip (the reference), and their ratio.\n";

double median_us(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double us_since(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

// Each engine: ack ok every step_begin, then wait for its commit.
void engine_loop(Client& engine, int steps) {
  for (int done = 0; done < steps;) {
    const control::Event e = engine.wait_event(60s);
    if (const auto* b = std::get_if<control::StepBegin>(&e)) engine.ack({b->step, true, 0, 0, ""});
    if (std::holds_alternative<control::Commit>(e)) ++done;
  }
}

int run(const std::vector<std::string>& argv) {
  const Args args(argv, {"json"}, {"engines", "steps"});
  const int engines = static_cast<int>(args.get_int("engines", 8));
  const int steps = static_cast<int>(args.get_int("steps", 200));
  if (engines < 1 || steps < 1) fail(Errc::invalid_argument, "--engines and --steps must be >= 1");
  control::Coordinator coord(control::CoordinatorOptions{});
  auto options = [&](Role role, int rank, int world) {
    ClientOptions o;
    o.address = coord.address();
    o.role = role;
    o.rank = rank;
    o.world = world;
    return o;
  };
  Client trainer(options(Role::trainer, 0, 1));
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < engines; ++r)
    clients.push_back(std::make_unique<Client>(options(Role::engine, r, engines)));
  std::vector<std::thread> threads;
  for (auto& c : clients) threads.emplace_back([&c, steps] { engine_loop(*c, steps); });

  std::vector<double> round_trips, step_times;
  for (int i = 0; i < steps; ++i) {
    const auto t = Clock::now();
    trainer.committed_version(0);
    round_trips.push_back(us_since(t));
  }
  for (int step = 1; step <= steps; ++step) {
    const auto t = Clock::now();
    trainer.begin_step(step, "bench");
    trainer.sent(step, true);
    const auto result = trainer.wait_step_result(step, 60s);
    step_times.push_back(us_since(t));
    if (static_cast<int>(result.committed.size()) != engines)
      fail(Errc::internal, "bench step ", step, " committed ", result.committed.size(), " of ",
           engines, " engines");
  }
  for (auto& th : threads) th.join();
  const double rtt = median_us(round_trips), step = median_us(step_times);
  if (args.flag("json")) {
    std::cout << nlohmann::json{{"engines", engines},
                                {"steps", steps},
                                {"request_round_trip_us", rtt},
                                {"step_control_us", step},
                                {"ratio", step / rtt}}
                     .dump()
              << "\n";
  } else {
    std::printf("control plane, 1 trainer + %d engines, %d steps (medians)\n", engines, steps);
    std::printf("  reference: request round trip  %10.1f us\n", rtt);
    std::printf("  step (begin..step_result)      %10.1f us  = %.1f x reference\n", step,
                step / rtt);
  }
  return 0;
}

const BenchRegistrar registrar{
    {"control", "control-plane step overhead vs one request round trip", kUsage, run}};

}  // namespace
}  // namespace weightsync::cli
