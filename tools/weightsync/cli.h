// The `weightsync` command: a registry of subcommands and a small option parser.
// Each cmd_*.cpp registers one subcommand with a static CommandRegistrar.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace weightsync::cli {

// Parsed "--name value", "--flag" and positional arguments. Unknown options
// and missing values are errors (Errc::invalid_argument), never ignored.
class Args {
 public:
  // `flags`: options without a value; `options`: options that take one.
  Args(std::vector<std::string> argv, std::set<std::string> flags, std::set<std::string> options);

  bool flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::optional<std::string> get(const std::string& name) const;
  std::string require(const std::string& name) const;  // Errc::invalid_argument if absent
  std::string get_or(const std::string& name, const std::string& fallback) const;
  int64_t get_int(const std::string& name, int64_t fallback) const;  // checks it is an integer
  double get_double(const std::string& name, double fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }
  bool help() const { return help_; }

 private:
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

struct Command {
  std::string name;
  std::string summary;  // one line for `weightsync --help`
  std::string usage;    // full text for `weightsync NAME --help` ("": the command handles --help)
  std::function<int(const std::vector<std::string>& argv)> run;  // argv after the name
};

std::map<std::string, Command>& registry();

// A data file or folder shipped with weightsync, named as in the source tree
// ("tools/bench/peer_baseline.py", "configs/models/Kimi-K2/config.json"),
// found from the running executable, never from the working directory: in
// the source tree it was built in (<tree>/build*/bin/weightsync), or under
// share/weightsync beside an installed command (`cmake --install`:
// <prefix>/bin and <prefix>/share/weightsync; the Python package:
// weightsync/bin and weightsync/share/weightsync), and last in the source
// tree the build was configured from (a build folder anywhere, in or out of
// the tree). $WEIGHTSYNC_DATA_DIR, when set, is looked in first. "" when not
// found.
std::string find_data(const std::string& relative);

// The python that helper scripts (the benches' peer baselines) run under:
// $WEIGHTSYNC_PYTHON; else the virtual environment the command is installed
// in (the Python package's); else the .venv of the source tree it sits in, or
// else of the one it was configured from; else python3 on the PATH. "" when
// none is found.
std::string helper_python();

// The median of `repeats` timed runs of f, in seconds, after one untimed
// run (first touch of the memory); for benchmarks.
double median_seconds(const std::function<void()>& f, int repeats);

// The q-quantile (0 < q <= 1) of `v` by the nearest-rank method; 0 when empty.
double percentile(std::vector<double> v, double q);

struct CommandRegistrar {
  explicit CommandRegistrar(Command command);
};

}  // namespace weightsync::cli

namespace weightsync::cli {

// `weightsync bench NAME ...` runs a registered benchmark; `weightsync bench`
// without a name runs the sync-latency benchmark (registered as "sync").
struct Bench {
  std::string name;
  std::string summary;
  std::string usage;
  std::function<int(const std::vector<std::string>& argv)> run;
};

std::map<std::string, Bench>& bench_registry();

struct BenchRegistrar {
  explicit BenchRegistrar(Bench bench);
};

}  // namespace weightsync::cli
