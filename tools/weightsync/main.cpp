// weightsync: the command-line tool. Subcommands register themselves (cli.h).
#include "cli.h"
#include "json_stdout.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>

#include <cstdio>
#include <iostream>
#include <optional>

namespace {

void print_overview() {
  std::cout << "weightsync: move a trainer's updated weights into running inference engines.\n\n"
               "usage: weightsync COMMAND [options]   (weightsync COMMAND --help for details)\n\n"
               "commands:\n";
  for (const auto& [name, cmd] : weightsync::cli::registry())
    std::printf("  %-15s %s\n", name.c_str(), cmd.summary.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  using namespace weightsync;
  if (argc < 2) {
    print_overview();
    return 2;
  }
  std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_overview();
    return 0;
  }
  auto& commands = cli::registry();
  auto it = commands.find(name);
  if (it == commands.end()) {
    std::cerr << "weightsync: unknown command '" << name << "' (see weightsync --help)\n";
    return 2;
  }
  std::vector<std::string> rest(argv + 2, argv + argc);
  // A command with an empty usage handles --help itself (e.g. bench's sub-benchmarks).
  for (const auto& a : rest) {
    if (!it->second.usage.empty() && (a == "--help" || a == "-h")) {
      std::cout << it->second.usage;
      return 0;
    }
  }
  std::optional<cli::JsonStdout> json;
  if (cli::wants_json(rest)) json.emplace(name);
  int rc = 0;
  std::optional<std::string> code;
  std::string message;
  try {
    rc = it->second.run(rest);
  } catch (const Error& e) {
    code = errc_name(e.code());
    message = e.what();
    std::cerr << "weightsync " << name << ": error [" << *code << "]: " << message << "\n";
    rc = e.code() == Errc::invalid_argument ? 2 : 1;
  } catch (const std::exception& e) {
    code = "internal";
    message = e.what();
    std::cerr << "weightsync " << name << ": error: " << message << "\n";
    rc = 1;
  }
  return json ? json->finish(rc, code, message) : rc;
}
