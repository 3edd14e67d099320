// `weightsync coordinator`: runs the control-plane coordinator standalone
// until SIGINT or SIGTERM. Its first stdout line names the bound address,
// so a parent that asked for port 0 can read the real one.
#include "cli.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <csignal>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync coordinator [--listen HOST:PORT] [--token-file F]\n"
    "                              [--expect-trainers N --expect-engines M] [limits]\n\n"
    "Serves membership, the key/value store, plans and the step protocol until\n"
    "SIGINT/SIGTERM. Prints 'coordinator listening on HOST:PORT' as its first line.\n\n"
    "  --listen HOST:PORT         default 127.0.0.1:0 (0: any free port)\n"
    "  --metrics-port P           Prometheus metrics on http://HOST:P/metrics (HOST as\n"
    "                             --listen); default 0: any free port, printed as the\n"
    "                             second line; -1: off (docs/metrics.md)\n"
    "  --token-file F             every client must present the token in F\n"
    "  --expect-trainers N        print a line once N trainers and M engines are live\n"
    "  --expect-engines M\n"
    "  --hello-timeout-ms T       default 5000\n"
    "  --heartbeat-timeout-ms T   default 10000\n"
    "  --step-timeout-ms T        default 300000\n"
    "  --max-frame-bytes B        default 16 MiB\n"
    "  --max-connections N        default 4096\n"
    "  --max-store-bytes B        default 256 MiB\n";

std::string read_token(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(Errc::io, "cannot read the token file ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) fail(Errc::invalid_argument, "token file ", path, " is empty");
  return token;
}

int64_t positive(const Args& args, const std::string& name, int64_t fallback) {
  const int64_t v = args.get_int(name, fallback);
  if (v <= 0) fail(Errc::invalid_argument, "--", name, " must be positive, got ", v);
  return v;
}

control::CoordinatorOptions options_from(const Args& args) {
  control::CoordinatorOptions o;
  const std::string listen = args.get_or("listen", "127.0.0.1:0");
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0)
    fail(Errc::invalid_argument, "--listen expects HOST:PORT, got '", listen, "'");
  o.host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
    fail(Errc::invalid_argument, "--listen: bad port '", port, "'");
  o.port = static_cast<uint16_t>(std::stoi(port));
  if (auto f = args.get("token-file")) o.token = read_token(*f);
  o.expect_trainers = static_cast<int>(args.get_int("expect-trainers", 0));
  o.expect_engines = static_cast<int>(args.get_int("expect-engines", 0));
  o.hello_timeout = control::Millis(positive(args, "hello-timeout-ms", 5000));
  o.heartbeat_timeout = control::Millis(positive(args, "heartbeat-timeout-ms", 10000));
  o.step_timeout = control::Millis(positive(args, "step-timeout-ms", 300000));
  o.max_frame_bytes = static_cast<size_t>(positive(args, "max-frame-bytes", 16 << 20));
  o.max_connections = static_cast<size_t>(positive(args, "max-connections", 4096));
  o.max_store_bytes = static_cast<size_t>(positive(args, "max-store-bytes", int64_t{256} << 20));
  o.metrics_port = static_cast<int>(args.get_int("metrics-port", 0));
  if (o.metrics_port < -1 || o.metrics_port > 65535)
    fail(Errc::invalid_argument, "--metrics-port must be -1 (off) or a port, got ", o.metrics_port);
  o.metrics_host = o.host;
  return o;
}

int run_coordinator(const std::vector<std::string>& argv) {
  const Args args(argv, {},
                  {"listen", "token-file", "expect-trainers", "expect-engines", "hello-timeout-ms",
                   "heartbeat-timeout-ms", "step-timeout-ms", "max-frame-bytes", "max-connections",
                   "max-store-bytes", "metrics-port"});
  auto options = options_from(args);
  // Block the stop signals before the coordinator starts its thread, so
  // that thread inherits the mask and only sigtimedwait below sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  std::unique_ptr<control::Coordinator> made;
  try {
    made = std::make_unique<control::Coordinator>(options);
  } catch (const Error& e) {
    // Metrics are on by default here, but not where weightsync was built
    // without prometheus-cpp: say so and serve without them.
    if (e.code() != Errc::unsupported || args.has("metrics-port")) throw;
    std::cerr << "weightsync coordinator: " << e.what() << "; serving without metrics\n";
    options.metrics_port = -1;
    made = std::make_unique<control::Coordinator>(options);
  }
  control::Coordinator& coord = *made;
  std::cout << "coordinator listening on " << coord.address() << std::endl;
  if (coord.metrics_port() > 0)
    std::cout << "metrics on http://" << options.metrics_host << ":" << coord.metrics_port()
              << "/metrics" << std::endl;
  const bool expecting = options.expect_trainers > 0 || options.expect_engines > 0;
  bool announced = false;
  const timespec poll{0, 200 * 1000 * 1000};
  int signal = -1;
  while (signal < 0) {
    signal = sigtimedwait(&stop_signals, nullptr, &poll);
    if (signal >= 0 || !expecting || announced) continue;
    int trainers = 0, engines = 0;
    for (const auto& m : coord.members()) {
      trainers += m.role == control::Role::trainer;
      engines += m.role == control::Role::engine;
    }
    if (trainers >= options.expect_trainers && engines >= options.expect_engines) {
      std::cout << "all expected members registered: " << trainers << " trainers, " << engines
                << " engines" << std::endl;
      announced = true;
    }
  }
  std::cout << "coordinator stopping (signal " << signal << ")" << std::endl;
  coord.stop();
  return 0;
}

const CommandRegistrar registrar{{"coordinator",
                                  "run the control-plane coordinator until SIGINT/SIGTERM", kUsage,
                                  run_coordinator}};

}  // namespace
}  // namespace weightsync::cli
