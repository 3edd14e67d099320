#include <weightsync/error.h>

namespace weightsync {

std::string_view errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::invalid_argument:
      return "invalid_argument";
    case Errc::invalid_layout:
      return "invalid_layout";
    case Errc::format:
      return "format";
    case Errc::io:
      return "io";
    case Errc::mismatch:
      return "mismatch";
    case Errc::not_found:
      return "not_found";
    case Errc::timeout:
      return "timeout";
    case Errc::peer_failure:
      return "peer_failure";
    case Errc::transport:
      return "transport";
    case Errc::protocol:
      return "protocol";
    case Errc::unsupported:
      return "unsupported";
    case Errc::cancelled:
      return "cancelled";
    case Errc::internal:
      return "internal";
  }
  return "unknown";
}

Error::Error(Errc code, const std::string& message) : std::runtime_error(message), code_(code) {}

std::string shape_str(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

}  // namespace weightsync
