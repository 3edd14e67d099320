// `--json` mode of the `weightsync` command: stdout carries exactly one JSON
// object, whatever the command, the libraries it calls or its child
// processes print.
//
// Scripts pipe `weightsync ... --json` into a JSON parser, so anything else
// on stdout breaks them: UCX prints its warnings to stdout, a child process
// inherits the descriptor, a human line slips through. While a JsonStdout
// lives, file descriptor 1 is a duplicate of stderr (so printf, UCX and
// children write there), and std::cout writes into a buffer. finish() then
// writes that buffer to the real stdout if it is one JSON object; otherwise
// (a bug) it shows the text on stderr and writes an error object instead. A
// command that fails before printing its object gets an error object too:
//   {"error": {"code": "invalid_argument", "message": "..."}, "command": "plan"}
// A command that reports as it goes (`status --watch --json`) writes JSON
// lines instead, each object as it comes (emit_json_line); a failure after
// them is one more line, the error object.
#pragma once

#include <optional>
#include <sstream>
#include <streambuf>
#include <string>
#include <vector>

namespace weightsync::cli {

class JsonStdout {
 public:
  explicit JsonStdout(std::string command);
  ~JsonStdout();  // restores std::cout and fd 1 (finish() first, to emit)
  JsonStdout(const JsonStdout&) = delete;
  JsonStdout& operator=(const JsonStdout&) = delete;

  // Emits the one object and returns the exit code to use: `rc`, or 1 when
  // the command printed something other than one JSON object. `error_code`
  // and `error_message`, when given, describe why the command failed; they
  // are used when it printed nothing.
  int finish(int rc, const std::optional<std::string>& error_code = std::nullopt,
             const std::string& error_message = {});
  // One object of a JSON-lines report, written to the real stdout at once.
  void emit_line(const std::string& object);
  // The one that lives in this process, or null.
  static JsonStdout* current() noexcept;

 private:
  void restore();

  std::string command_;
  int real_stdout_ = -1;
  std::ostringstream captured_;
  std::streambuf* saved_ = nullptr;
  bool finished_ = false;
  int lines_ = 0;  // emitted by emit_line
};

// One object of a command's JSON-lines report (e.g. each refresh of `status
// --watch --json`), on stdout at once: through the living JsonStdout, else
// std::cout.
void emit_json_line(const std::string& object);

// True when `args` (after the command name) ask for --json output and not for help.
bool wants_json(const std::vector<std::string>& args);

}  // namespace weightsync::cli
