// weightsync: the command-line tool. Subcommands register themselves (cli.h).
#include "cli.h"

#include <weightsync/error.h>

#include <cstdio>
#include <iostream>

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
  try {
    return it->second.run(rest);
  } catch (const Error& e) {
    std::cerr << "weightsync " << name << ": error [" << errc_name(e.code()) << "]: " << e.what()
              << "\n";
    return e.code() == Errc::invalid_argument ? 2 : 1;
  } catch (const std::exception& e) {
    std::cerr << "weightsync " << name << ": error: " << e.what() << "\n";
    return 1;
  }
}
