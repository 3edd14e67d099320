#include "json_stdout.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdio>
#include <iostream>
#include <vector>

#include <unistd.h>

namespace weightsync::cli {
namespace {

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;  // stdout closed: nothing better to do
    done += static_cast<size_t>(n);
  }
}

JsonStdout* living = nullptr;

}  // namespace

bool wants_json(const std::vector<std::string>& args) {
  bool json = false;
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") return false;
    json |= a == "--json";
  }
  return json;
}

JsonStdout::JsonStdout(std::string command) : command_(std::move(command)) {
  std::cout.flush();
  std::fflush(stdout);
  real_stdout_ = ::dup(STDOUT_FILENO);
  if (real_stdout_ >= 0) ::dup2(STDERR_FILENO, STDOUT_FILENO);
  saved_ = std::cout.rdbuf(captured_.rdbuf());
  living = this;
}

JsonStdout::~JsonStdout() {
  restore();
  if (living == this) living = nullptr;
}

JsonStdout* JsonStdout::current() noexcept {
  return living;
}

void JsonStdout::emit_line(const std::string& object) {
  ++lines_;
  write_all(real_stdout_ >= 0 ? real_stdout_ : STDOUT_FILENO, object + "\n");
}

void emit_json_line(const std::string& object) {
  if (JsonStdout* out = JsonStdout::current())
    out->emit_line(object);
  else
    std::cout << object << std::endl;
}

void JsonStdout::restore() {
  if (!saved_) return;
  std::cout.rdbuf(saved_);
  saved_ = nullptr;
  std::fflush(stdout);
  if (real_stdout_ >= 0) {
    ::dup2(real_stdout_, STDOUT_FILENO);
    ::close(real_stdout_);
    real_stdout_ = -1;
  }
}

int JsonStdout::finish(int rc, const std::optional<std::string>& error_code,
                       const std::string& error_message) {
  if (finished_) return rc;
  finished_ = true;
  const std::string text = captured_.str();
  const bool blank = text.find_first_not_of(" \t\r\n") == std::string::npos;
  // JSON lines went out as they came: only a failure adds one.
  if (lines_ > 0 && blank && rc == 0) {
    restore();
    return rc;
  }
  nlohmann::json out;
  if (!blank) {
    auto parsed = nlohmann::json::parse(text, nullptr, false);
    if (!parsed.is_discarded() && parsed.is_object()) {
      out = std::move(parsed);
    } else {
      // A command broke the contract: keep what it printed where a person
      // sees it, and tell scripts plainly.
      std::cerr << text;
      out = {{"error",
              {{"code", "internal"},
               {"message", "weightsync " + command_ +
                               " printed something other than one JSON object on stdout "
                               "(shown on stderr)"}}}};
      rc = rc == 0 ? 1 : rc;
    }
  } else {
    out = {{"error",
            {{"code", error_code.value_or(rc == 0 ? "internal" : "failed")},
             {"message", error_message.empty()
                             ? "weightsync " + command_ + " printed no JSON object (exit code " +
                                   std::to_string(rc) + ")"
                             : error_message}}}};
    if (rc == 0) rc = 1;
  }
  const bool rewritten = out.contains("error") && !out.contains("command");
  if (rewritten) out["command"] = command_;
  std::string line = rewritten ? out.dump() : text;
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  restore();  // fd 1 is the real stdout again, std::cout writes there
  write_all(STDOUT_FILENO, line + "\n");
  return rc;
}

}  // namespace weightsync::cli
