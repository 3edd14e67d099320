// The real `weightsync coordinator` process: garbage in, still alive and
// serving; tokens from a file; clean exit on SIGTERM.
#include "control/coordinator_process.h"
#include "control/raw_peer.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::CoordinatorProcess;
using testing::frame_of;
using testing::RawPeer;

ClientOptions client_to(uint16_t port, const std::string& token = "") {
  ClientOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  o.role = Role::trainer;
  o.token = token;
  o.heartbeat_interval = 200ms;
  return o;
}

TEST(CoordinatorProcess, SurvivesGarbageAndKeepsAccepting) {
  CoordinatorProcess proc({"--max-frame-bytes", "65536"});
  ASSERT_NE(proc.first_line().find("coordinator listening on 127.0.0.1:"), std::string::npos)
      << "first line: '" << proc.first_line() << "'";
  ASSERT_NE(proc.port(), 0);
  std::mt19937 rng(1234);
  std::vector<std::string> garbage = {
      std::string("\xff\xff\xff\xff", 4),
      frame_of("not json"),
      frame_of("[]"),
      frame_of(R"({"v":1,"kind":"hello"})"),
      frame_of(std::string(100000, '{')),
      std::string("\x00\x00\x00\x10{\"v\":1", 10),  // truncated, then closed
  };
  for (int i = 0; i < 20; ++i) {
    std::string random(1 + rng() % 5000, '\0');
    for (auto& ch : random) ch = static_cast<char>(rng());
    garbage.push_back(random);
  }
  for (const auto& bytes : garbage) {
    RawPeer p(proc.port());
    p.send_bytes(bytes);
    p.wait_closed(5s);  // closed by the coordinator, or by us when it waits for more
  }
  ASSERT_TRUE(proc.alive());
  Client c(client_to(proc.port()));
  c.set("still", {1, 2, 3});
  EXPECT_EQ(c.get("still", 10s), (std::vector<uint8_t>{1, 2, 3}));
  c.leave();
  EXPECT_EQ(proc.terminate(), 0);
}

TEST(CoordinatorProcess, RequiresTheTokenFromItsTokenFile) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("ws_cp_token_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto path = (dir / "token").string();
  std::ofstream(path) << "tok-123\n";
  CoordinatorProcess proc({"--token-file", path});
  ASSERT_NE(proc.port(), 0) << proc.first_line();
  try {
    Client bad(client_to(proc.port(), "tok-124"));
    FAIL() << "wrong token accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol);
    EXPECT_NE(std::string(e.what()).find("token"), std::string::npos) << e.what();
  }
  Client good(client_to(proc.port(), "tok-123"));
  EXPECT_EQ(good.members().size(), 1u);
  std::filesystem::remove_all(dir);
}

TEST(CoordinatorProcess, BadOptionsFailWithUsageErrors) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--listen", "nonsense"},
        std::vector<std::string>{"--listen", "127.0.0.1:99999"},
        std::vector<std::string>{"--token-file", "/nonexistent/token"},
        std::vector<std::string>{"--heartbeat-timeout-ms", "0"}}) {
    std::string cmd = std::string(WEIGHTSYNC_CLI) + " coordinator";
    for (const auto& a : args) cmd += " '" + a + "'";
    cmd += " >/dev/null 2>&1";
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status)) << cmd;
    EXPECT_NE(WEXITSTATUS(status), 0) << cmd;
  }
}

}  // namespace
}  // namespace weightsync::control
