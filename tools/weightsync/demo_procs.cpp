#include "demo_procs.h"

#include <weightsync/error.h>

#include "transport/staging.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace weightsync::demo {

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) fail(Errc::io, "cannot read /proc/self/exe: ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

std::string ChildResult::status() const {
  if (exited) return cat("exit ", exit_code);
  if (signal) return cat("killed by signal ", signal, " (", strsignal(signal), ")");
  return "not reaped";
}

ProcessGroup::ProcessGroup(std::string log_dir) : log_dir_(std::move(log_dir)) {}

ProcessGroup::~ProcessGroup() {
  kill_all();
  // Bounded: SIGKILL cannot be ignored, so the reaps finish promptly.
  for (int i = 0; i < 500 && std::count(running_.begin(), running_.end(), true) > 0; ++i) {
    reap(false);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

pid_t ProcessGroup::spawn(const std::string& label, const std::vector<std::string>& args,
                          bool may_fail, bool kill_when_stopped) {
  std::string file = label;
  std::replace(file.begin(), file.end(), ' ', '-');
  ChildResult child;
  child.label = label;
  child.may_fail = may_fail;
  child.kill_when_stopped = kill_when_stopped;
  child.log_path = log_dir_ + "/" + file + ".log";
  const std::string exe = self_exe();
  std::vector<std::string> argv_s{exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  const int log = ::open(child.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0) fail(Errc::io, "cannot create log ", child.log_path, ": ", std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log);
    fail(Errc::io, "fork for ", label, ": ", std::strerror(errno));
  }
  if (pid == 0) {
    // Child: die with the parent, so that a killed demo leaves no orphan.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(log);
  child.pid = pid;
  children_.push_back(std::move(child));
  running_.push_back(true);
  return pid;
}

bool ProcessGroup::running(pid_t pid) {
  reap(false);
  for (size_t i = 0; i < children_.size(); ++i)
    if (children_[i].pid == pid) return running_[i];
  return false;
}

const ChildResult* ProcessGroup::result(pid_t pid) const {
  for (const auto& c : children_)
    if (c.pid == pid) return &c;
  return nullptr;
}

void ProcessGroup::reap(bool block) {
  for (size_t i = 0; i < children_.size(); ++i) {
    if (!running_[i]) continue;
    int status = 0;
    const pid_t r = ::waitpid(children_[i].pid, &status, (block ? 0 : WNOHANG) | WUNTRACED);
    if (r != children_[i].pid) continue;
    if (WIFSTOPPED(status)) {
      // A drill's victim froze where the drill wanted it dead: kill it from
      // here (reaped as killed by SIGKILL on a later look). Anyone else
      // stopped is left as it is.
      if (children_[i].kill_when_stopped) ::kill(children_[i].pid, SIGKILL);
      continue;
    }
    running_[i] = false;
    if (WIFEXITED(status)) {
      children_[i].exited = true;
      children_[i].exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      children_[i].signal = WTERMSIG(status);
    }
  }
}

void ProcessGroup::kill_all() {
  for (size_t i = 0; i < children_.size(); ++i)
    if (running_[i]) ::kill(children_[i].pid, SIGKILL);
}

std::vector<ChildResult> ProcessGroup::wait_all(
    std::chrono::milliseconds timeout, std::chrono::milliseconds grace,
    const std::function<void(const ChildResult&)>& on_exit, const std::function<void()>& on_tick) {
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + timeout;
  bool failed = false;
  std::vector<bool> reported;
  while (std::count(running_.begin(), running_.end(), true) > 0) {
    reap(false);
    if (on_tick) on_tick();
    reported.resize(children_.size(), false);
    for (size_t i = 0; on_exit && i < children_.size(); ++i) {
      if (running_[i] || reported[i]) continue;
      reported[i] = true;
      const ChildResult ended = children_[i];  // on_exit may grow children_
      on_exit(ended);
      reported.resize(children_.size(), false);
    }
    if (!failed) {
      for (size_t i = 0; i < children_.size(); ++i) {
        const auto& c = children_[i];
        if (!running_[i] && !c.ok() && !c.may_fail) {
          failed = true;
          deadline = std::min(deadline, Clock::now() + grace);
        }
      }
    }
    if (Clock::now() >= deadline) {
      timed_out_ = !failed;
      kill_all();
      for (int k = 0; k < 500 && std::count(running_.begin(), running_.end(), true) > 0; ++k) {
        reap(false);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return children_;
}

std::string tail_of_file(const std::string& path, std::size_t max_bytes) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const auto size = static_cast<std::size_t>(in.tellg());
  const std::size_t start = size > max_bytes ? size - max_bytes : 0;
  in.seekg(static_cast<std::streamoff>(start));
  std::string out(size - start, '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  return out;
}

std::string reason_in_log(const std::string& log) {
  const std::string tail = tail_of_file(log, 4000);
  std::string last, last_error;
  size_t begin = 0;
  while (begin < tail.size()) {
    size_t end = tail.find('\n', begin);
    if (end == std::string::npos) end = tail.size();
    const std::string line = tail.substr(begin, end - begin);
    if (!line.empty()) {
      last = line;
      if (line.find("error") != std::string::npos) last_error = line;
    }
    begin = end + 1;
  }
  return last_error.empty() ? last : last_error;
}

}  // namespace weightsync::demo
