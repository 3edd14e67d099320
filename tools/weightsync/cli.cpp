#include "cli.h"

#include <weightsync/error.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

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

namespace {

namespace fs = std::filesystem;

// The running executable's folder and `levels` - 1 of its ancestors: few,
// so that unrelated files far up the file system are not found.
std::vector<fs::path> exe_ancestors(int levels) {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> out;
  if (ec) return out;
  fs::path p = exe.parent_path();
  for (int i = 0; i < levels && !p.empty(); ++i, p = p.parent_path()) {
    out.push_back(p);
    if (p == p.root_path()) break;
  }
  return out;
}

bool path_exists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

std::string on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && path_exists(fs::path(dir) / name)) return (fs::path(dir) / name).string();
  return "";
}

}  // namespace

std::string find_data(const std::string& relative) {
  if (const char* dir = std::getenv("WEIGHTSYNC_DATA_DIR"); dir && *dir)
    if (path_exists(fs::path(dir) / relative)) return (fs::path(dir) / relative).string();
  // Three levels reach a source tree from <tree>/build/bin, and share/ from
  // <prefix>/bin or the package's weightsync/bin.
  for (const fs::path& p : exe_ancestors(3)) {
    // share/ first: an installed tree may sit inside a source tree's prefix.
    for (const fs::path& candidate : {p / "share" / "weightsync" / relative, p / relative})
      if (path_exists(candidate)) return fs::weakly_canonical(candidate).string();
  }
  // Last, the source tree this command was configured from: a build folder
  // anywhere (out of the tree, or deeper in it) still finds its data.
  if (const fs::path source = WEIGHTSYNC_CONFIGURED_SOURCE_DIR; path_exists(source / relative))
    return fs::weakly_canonical(source / relative).string();
  return "";
}

std::string helper_python() {
  if (const char* py = std::getenv("WEIGHTSYNC_PYTHON"); py && *py) return py;
  // Six levels reach <venv> from <venv>/lib/pythonX.Y/site-packages/weightsync/bin.
  for (const fs::path& p : exe_ancestors(6)) {
    if (path_exists(p / "pyvenv.cfg") && path_exists(p / "bin" / "python"))
      return (p / "bin/python").string();
    if (path_exists(p / "tools" / "bench") && path_exists(p / ".venv" / "bin" / "python"))
      return (p / ".venv/bin/python").string();
  }
  // The .venv of the source tree this command was configured from.
  if (const fs::path venv_python = fs::path(WEIGHTSYNC_CONFIGURED_SOURCE_DIR) / ".venv/bin/python";
      path_exists(venv_python))
    return venv_python.string();
  return on_path("python3");
}

double median_seconds(const std::function<void()>& f, int repeats) {
  std::vector<double> t;
  f();  // warm-up: first touch
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
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
