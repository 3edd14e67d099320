// Syncs on a busy host: processes that keep every core busy run beside a
// multi-process sync (the real `weightsync bench` binary: trainer and engine
// processes, the coordinator, the raw-transport rounds), over UCX's
// shared-memory transports and over tcp, several runs of many steps each.
// Every run must finish with every step committed, or fail with a reason: a
// rank that blocks (for a decision, a barrier, a store key) without
// progressing its UCX worker leaves its peers' rendezvous sends hanging
// until the step timeout, which under contention happened in most runs.
// This tests behaviour, not speed: the bound is the step timeout.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace weightsync::e2e {
namespace {

// One busy-looping child process per core, killed when this goes.
class BusyCores {
 public:
  BusyCores() {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < n; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        volatile unsigned long x = 0;
        for (;;) x = x + 1;
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  ~BusyCores() {
    for (pid_t pid : pids_) ::kill(pid, SIGKILL);
    for (pid_t pid : pids_) ::waitpid(pid, nullptr, 0);
  }
  BusyCores(const BusyCores&) = delete;
  BusyCores& operator=(const BusyCores&) = delete;
  size_t count() const { return pids_.size(); }

 private:
  std::vector<pid_t> pids_;
};

struct BenchRun {
  int exit_code = -1;
  nlohmann::json result;  // stdout's one JSON object (discarded if none)
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// `weightsync bench ... --json`, stdout and stderr apart.
BenchRun run_bench(const std::vector<std::string>& args) {
  const std::string dir = temp_dir("contention");
  std::string cmd = "timeout -s KILL 600 '" WEIGHTSYNC_CLI "' bench";
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " >'" + dir + "/out' 2>'" + dir + "/err'";
  const int status = std::system(cmd.c_str());
  BenchRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(dir + "/out");
  r.err = slurp(dir + "/err");
  r.result = nlohmann::json::parse(r.out, nullptr, false);
  std::filesystem::remove_all(dir);
  return r;
}

// `runs` benches of `steps` steps over `transport`, every core kept busy.
void expect_every_run_commits(const std::string& transport, int runs, int steps) {
  BusyCores busy;
  ASSERT_GT(busy.count(), 0u);
  for (int run = 0; run < runs; ++run) {
    const BenchRun r =
        run_bench({"--transport", transport, "--steps", std::to_string(steps), "--size-gb", "0.03",
                   "--bucket-bytes", "1048576", "--no-peer", "--json", "--timeout", "60"});
    const nlohmann::json& json = r.result;
    SCOPED_TRACE(cat("run ", run + 1, " of ", runs, " over ", transport));
    ASSERT_TRUE(json.is_object()) << r.out << "\nstderr:\n" << r.err;
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(json.value("ok", false)) << json.dump(1);
    ASSERT_EQ(json["sync_s"].size(), static_cast<size_t>(steps)) << json.dump(1);
    for (const auto& s : json["sync_s"]) EXPECT_GT(s.get<double>(), 0.0) << json.dump(1);
    EXPECT_GT(json["engine_rank_bytes"].get<int64_t>(), 0) << json.dump(1);
  }
}

TEST(Contention, SharedMemorySyncsCommitWithEveryCoreBusy) {
  REQUIRE_UCX();
  expect_every_run_commits("ucx?tls=posix,sysv,cma,self", 4, 8);
}

TEST(Contention, TcpSyncsCommitWithEveryCoreBusy) {
  REQUIRE_UCX();
  expect_every_run_commits("ucx?tls=tcp,self", 2, 8);
}

TEST(Contention, DefaultTransportSyncsCommitWithEveryCoreBusy) {
  REQUIRE_UCX();
  expect_every_run_commits("ucx", 2, 8);
}

}  // namespace
}  // namespace weightsync::e2e
