// `weightsync bench [NAME] ...`: dispatches to the benchmarks that register
// themselves with BenchRegistrar (cli.h).
#include "cli.h"

#include <weightsync/error.h>

#include <iostream>

namespace weightsync::cli {
namespace {

std::string bench_usage() {
  std::string s =
      "usage: weightsync bench [NAME] [options]\n\n"
      "Benchmarks print numbers and ratios against a reference measured in the same run.\n"
      "Without NAME, runs the sync-latency benchmark ('sync').\n\nbenchmarks:\n";
  for (const auto& [name, b] : bench_registry()) s += "  " + name + ": " + b.summary + "\n";
  s += "\nweightsync bench NAME --help for each one's options.\n";
  return s;
}

int run_bench(const std::vector<std::string>& argv) {
  if (!argv.empty() && (argv[0] == "--help" || argv[0] == "-h")) {
    std::cout << bench_usage();
    return 0;
  }
  std::string name = "sync";
  std::vector<std::string> rest = argv;
  if (!argv.empty() && argv[0].rfind("--", 0) != 0) {
    name = argv[0];
    rest.erase(rest.begin());
  }
  auto it = bench_registry().find(name);
  if (it == bench_registry().end())
    fail(Errc::invalid_argument, "unknown benchmark '", name, "' (see weightsync bench --help)");
  for (const auto& a : rest) {
    if (a == "--help" || a == "-h") {
      std::cout << it->second.usage;
      return 0;
    }
  }
  return it->second.run(rest);
}

const CommandRegistrar registrar{
    {"bench", "run a benchmark (sync latency by default)", "", run_bench}};

}  // namespace
}  // namespace weightsync::cli
