#include "cli.h"

#include <weightsync/error.h>

#include <charconv>

namespace weightsync::cli {

Args::Args(std::vector<std::string> argv, std::set<std::string> flags,
           std::set<std::string> options) {
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
    } else if (a.rfind("--", 0) == 0 && a.size() > 2) {
      std::string name = a.substr(2);
      std::optional<std::string> inline_value;
      if (auto eq = name.find('='); eq != std::string::npos) {
        inline_value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      if (flags.count(name)) {
        if (inline_value) fail(Errc::invalid_argument, "--", name, " takes no value");
        flags_.insert(name);
      } else if (options.count(name)) {
        if (inline_value) {
          values_[name] = *inline_value;
        } else {
          if (i + 1 >= argv.size()) fail(Errc::invalid_argument, "--", name, " needs a value");
          values_[name] = argv[++i];
        }
      } else {
        fail(Errc::invalid_argument, "unknown option --", name, " (see --help)");
      }
    } else {
      positional_.push_back(a);
    }
  }
}

std::optional<std::string> Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string Args::require(const std::string& name) const {
  auto v = get(name);
  if (!v) fail(Errc::invalid_argument, "missing required option --", name, " (see --help)");
  return *v;
}

std::string Args::get_or(const std::string& name, const std::string& fallback) const {
  return get(name).value_or(fallback);
}

int64_t Args::get_int(const std::string& name, int64_t fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  int64_t out = 0;
  auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  if (ec != std::errc() || p != v->data() + v->size())
    fail(Errc::invalid_argument, "--", name, " expects an integer, got '", *v, "'");
  return out;
}

double Args::get_double(const std::string& name, double fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  try {
    size_t used = 0;
    double d = std::stod(*v, &used);
    if (used == v->size()) return d;
  } catch (const std::exception&) {
  }
  fail(Errc::invalid_argument, "--", name, " expects a number, got '", *v, "'");
}

std::map<std::string, Command>& registry() {
  static std::map<std::string, Command> commands;
  return commands;
}

CommandRegistrar::CommandRegistrar(Command command) {
  registry().emplace(command.name, std::move(command));
}

}  // namespace weightsync::cli

namespace weightsync::cli {

std::map<std::string, Bench>& bench_registry() {
  static std::map<std::string, Bench> benches;
  return benches;
}

BenchRegistrar::BenchRegistrar(Bench bench) {
  bench_registry().emplace(bench.name, std::move(bench));
}

}  // namespace weightsync::cli
