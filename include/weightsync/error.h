// The one error model of weightsync: exceptions of type weightsync::Error
// carrying a typed code. Messages say what failed and where (the tensor, key,
// file, rank or peer) and what was expected.
//
// Recoverable conditions a caller may act on (a timeout, a dead peer, a bad
// file) are Errors; broken internal invariants are Errc::internal.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync {

enum class Errc {
  invalid_argument,  // a caller passed something unusable (bad option, unknown name)
  invalid_layout,    // a trainer layout, engine config or plan is inconsistent
  format,            // a file or message is malformed (safetensors, JSON, frame)
  io,                // the OS refused (open, read, write, mmap, socket)
  mismatch,          // shapes, dtypes, sizes or checksums disagree
  not_found,         // a key, tensor, file or peer that should exist does not
  timeout,           // a bounded wait ran out
  peer_failure,      // a peer died, left, or sent garbage
  transport,         // the transport library reported an error
  protocol,          // the control-plane protocol was violated
  unsupported,       // a feature not built in or not available here (e.g. no GPU)
  cancelled,         // an operation was aborted on purpose
  internal,          // a broken invariant: a bug in weightsync
};

std::string_view errc_name(Errc code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message);
  Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

// cat(a, b, c): streams every argument into one string.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// fail(code, a, b, c): throws Error(code, cat(a, b, c)).
template <class... Args>
[[noreturn]] void fail(Errc code, const Args&... args) {
  throw Error(code, cat(args...));
}

// "[2, 3, 4]"
std::string shape_str(const std::vector<int64_t>& dims);

}  // namespace weightsync
