// A child `weightsync coordinator` process (the command itself, not the
// library in-process), its stdout on a pipe, for tests that drive it as an
// operator would.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace weightsync::control::testing {

class CoordinatorProcess {
 public:
  // `listen`: HOST:PORT (port 0: any; a restarted coordinator takes its
  // predecessor's port).
  explicit CoordinatorProcess(std::vector<std::string> extra,
                              const std::string& listen = "127.0.0.1:0") {
    int out[2];
    if (::pipe(out) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], 1);
      ::close(out[0]);
      ::close(out[1]);
      std::vector<std::string> args = {WEIGHTSYNC_CLI, "coordinator",        "--listen",
                                       listen,         "--hello-timeout-ms", "500"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    out_ = out[0];
    first_line_ = read_line(std::chrono::seconds(20));
  }
  ~CoordinatorProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
  }

  const std::string& first_line() const { return first_line_; }
  uint16_t port() const {
    const auto colon = first_line_.rfind(':');
    return colon == std::string::npos
               ? 0
               : static_cast<uint16_t>(std::stoi(first_line_.substr(colon + 1)));
  }
  bool alive() const { return pid_ > 0 && ::waitpid(pid_, nullptr, WNOHANG) == 0; }
  // SIGKILL, as a crash: nothing is flushed or said to the clients.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // The next line it prints ("" when none came within `timeout`).
  std::string next_line(std::chrono::milliseconds timeout) { return read_line(timeout); }

  // Sends SIGTERM and returns the exit status, or -1 if it did not exit in time.
  int terminate() {
    ::kill(pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 private:
  std::string read_line(std::chrono::milliseconds timeout) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char c;
      if (::read(out_, &c, 1) != 1) break;
      if (c == '\n') return line;
      line += c;
    }
    return line;
  }
  pid_t pid_ = -1;
  int out_ = -1;
  std::string first_line_;
};

}  // namespace weightsync::control::testing
