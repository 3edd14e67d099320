// The UCX transport tunes UCX through its own context's configuration
// (ucp_config_modify), never through the process environment: creating one
// leaves `environ` as it was, and a child process started afterwards sees
// none of weightsync's settings. (That no UCX warning about unused settings
// reaches the output is checked on the command line, cli_json_test.cpp.)
#include "harness.h"
#include "transport/ucx/ucx_worker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace weightsync::transport_test {
namespace {

std::vector<std::string> environment() {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  std::sort(env.begin(), env.end());
  return env;
}

// The UCX_* lines of the environment a child process started now receives
// (as /usr/bin/env prints them).
std::vector<std::string> child_ucx_environment() {
  int fds[2];
  if (::pipe(fds) != 0) fail(Errc::io, "pipe: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  char arg0[] = "env";
  char* argv[] = {arg0, nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/usr/bin/env", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    fail(Errc::io, "cannot spawn /usr/bin/env: ", std::strerror(rc));
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, std::size_t(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::vector<std::string> lines;
  for (std::size_t start = 0; start < out.size();) {
    std::size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    const std::string line = out.substr(start, end - start);
    if (line.rfind("UCX_", 0) == 0) lines.push_back(line);
    start = end + 1;
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

std::vector<std::string> ucx_only(const std::vector<std::string>& env) {
  std::vector<std::string> out;
  for (const auto& e : env)
    if (e.rfind("UCX_", 0) == 0) out.push_back(e);
  return out;
}

class UcxEnvironment : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxEnvironment, CreatingATransportLeavesTheProcessEnvironmentAlone) {
  if (auto why = not_built_reason("ucx"); !why.empty()) GTEST_SKIP() << why;
  const auto before = environment();
  const auto child_before = child_ucx_environment();
  TempDir dir;
  {
    auto t = make_test_transport(GetParam(), dir.path, 0, 1);
    // The transport works (a message to itself), so its context is set up.
    TestBuffer src(4096, MemoryKind::host), dst(4096, MemoryKind::host);
    src.fill(7);
    dst.zero();
    auto recv = t->recv(0, 5, dst.buffer());
    auto send = t->send(0, 5, src.buffer());
    EXPECT_EQ(recv->wait(30s), 4096u) << "self transfer over " << GetParam();
    send->wait(30s);
    EXPECT_TRUE(dst.holds(7, 4096));
    EXPECT_EQ(environment(), before) << "creating " << GetParam() << " changed the environment";
    EXPECT_EQ(child_ucx_environment(), child_before)
        << "a child process sees UCX settings after creating " << GetParam();
  }
  EXPECT_EQ(environment(), before);
  EXPECT_EQ(ucx_only(environment()), ucx_only(before));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxEnvironment,
                         ::testing::Values("ucx", "ucx?tls=tcp,self", "ucx?tls=posix,self",
                                           "ucx?tls=self"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

// Where weightsync's TCP tuning applies: only where UCX may open tcp, since
// UCX warns about settings no opened transport used.
TEST(UcxTcpTuning, AppliesOnlyWhereTcpCanBeSelected) {
  using transport::ucx::selects_tcp;
  EXPECT_TRUE(selects_tcp(""));  // UCX's default: every transport
  EXPECT_TRUE(selects_tcp("all"));
  EXPECT_TRUE(selects_tcp("tcp"));
  EXPECT_TRUE(selects_tcp("self,tcp"));
  EXPECT_TRUE(selects_tcp("tcp:aux,sm"));
  EXPECT_TRUE(selects_tcp("^shm"));
  EXPECT_FALSE(selects_tcp("^tcp"));
  EXPECT_FALSE(selects_tcp("^shm,tcp"));
  EXPECT_FALSE(selects_tcp("shm"));
  EXPECT_FALSE(selects_tcp("posix,self"));
  EXPECT_FALSE(selects_tcp("tcpx"));
  // The tuning names carry no UCX_ or TCP_ prefix (UCX 1.13 takes them so).
  for (const auto& [name, value] : transport::ucx::tcp_tuning()) {
    EXPECT_NE(name.rfind("UCX_", 0), 0u) << name;
    EXPECT_NE(name.rfind("TCP_", 0), 0u) << name;
    EXPECT_FALSE(value.empty()) << name;
  }
}

}  // namespace
}  // namespace weightsync::transport_test
