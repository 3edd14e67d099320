// `weightsync bench transport`: the UCX transport's bandwidth between two
// processes, beside ucx_perftest's tag_bw measured in the same invocation with
// the same UCX transports (UCX_TLS), message sizes and iteration counts.
// With --device cuda: GPU buffers over UCX with CUDA memory and over cuda_ipc,
// beside a device-to-device copy of the same bytes.
#include "cli.h"
#include "demo_device.h"

#include <weightsync/backend/transport.h>
#include <weightsync/error.h>
#include <weightsync/store.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <thread>

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace weightsync::cli {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kSizes[] = {1 * kMiB, 16 * kMiB, 64 * kMiB, 256 * kMiB};
constexpr Tag kAckTag = Tag{1} << 40;
constexpr auto kWait = std::chrono::seconds(300);

struct Settings {
  // Two processes of one host: UCX's shared-memory transports are what a
  // same-host job uses. Over tcp our rendezvous path is known to trail
  // perftest (see the issue note); --tls tcp measures it.
  std::string tls = "shm";
  int64_t iters = 0;  // 0: about 1 GiB per size
  int64_t window = 8;
  bool json = false;
  std::string device = "cpu";
  std::string transport;  // --device cuda: the transport measured (empty: each default)
};

// --device cuda, without --transport: UCX moving CUDA memory itself (it
// fails, saying why, where the UCX loaded cannot) and cuda_ipc.
const std::vector<std::string>& cuda_transports() {
  static const std::vector<std::string> names = {"ucx?cuda=require", "cuda_ipc"};
  return names;
}

bool on_gpu(const Settings& s) {
  return s.device == "cuda";
}

// A buffer of `bytes` where the messages live: host memory, or the GPU's.
struct BenchBuffer {
  std::vector<uint8_t> host;
  gpu::Memory device;
  BenchBuffer(const Settings& s, std::size_t bytes, uint8_t fill) {
    if (on_gpu(s))
      device = gpu::Memory(bytes, gpu::MemoryPlace::device, 0);
    else
      host.assign(bytes, fill);
  }
  Buffer buffer() {
    if (!host.empty()) return host_buffer(host.data(), host.size());
    return Buffer{device.data(), device.bytes(), MemoryKind::cuda, 0, nullptr};
  }
};

int64_t iters_for(const Settings& s, std::size_t bytes) {
  if (s.iters > 0) return s.iters;
  return std::max<int64_t>(8, static_cast<int64_t>((std::size_t{1} << 30) / bytes));
}
int64_t warmup_for(int64_t iters) {
  return std::max<int64_t>(2, iters / 8);
}

// ---- the two sides of one size: `count` messages, `window` in flight -------

void stream(Transport& t, bool sending, const Buffer& buffer, Tag tag, int64_t count,
            int64_t window) {
  std::deque<std::unique_ptr<Request>> in_flight;
  int64_t posted = 0;
  while (posted < count || !in_flight.empty()) {
    while (posted < count && static_cast<int64_t>(in_flight.size()) < window) {
      in_flight.push_back(sending ? t.send(1, tag, buffer) : t.recv(0, tag, buffer));
      ++posted;
    }
    in_flight.front()->wait(kWait);
    in_flight.pop_front();
  }
}

// Seconds for `iters` messages, from the first send to the receiver's ack.
double run_size(Transport& t, const Settings& s, std::size_t bytes, Tag tag) {
  BenchBuffer data(s, bytes, static_cast<uint8_t>(tag));
  Buffer buffer = data.buffer();
  auto region = t.register_memory(buffer);  // registered once, reused by every message
  buffer.region = region.get();
  const bool sender = t.rank() == 0;
  BenchBuffer ack(s, 1, 0);  // GPU memory too: cuda_ipc moves nothing else
  const Buffer ack_buffer = ack.buffer();
  const int64_t iters = iters_for(s, bytes);
  double seconds = 0;
  for (int phase = 0; phase < 2; ++phase) {  // 0: warm-up, 1: timed
    const int64_t count = phase == 0 ? warmup_for(iters) : iters;
    const auto start = Clock::now();
    stream(t, sender, buffer, tag * 2 + phase, count, s.window);
    if (sender)
      t.recv(1, kAckTag + tag, ack_buffer)->wait(kWait);
    else
      t.send(0, kAckTag + tag, ack_buffer)->wait(kWait);
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return seconds;
}

std::unique_ptr<Transport> bench_transport(Store& store, const Settings& s, int rank) {
  TransportOptions o;
  o.name = on_gpu(s) ? s.transport : "ucx";
  o.store = &store;
  o.prefix = "bench";
  o.rank = rank;
  o.world = 2;
  if (on_gpu(s))
    o.device = 0;  // both processes on GPU 0: the colocated case
  else
    o.params["tls"] = s.tls;
  return make_transport(o);
}

// ---- processes -------------------------------------------------------------

struct Child {
  pid_t pid = 0;
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // Waits up to `timeout` for a clean exit.
  void join(const std::string& what, std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    int status = 0;
    pid_t r = 0;
    while ((r = ::waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (r == 0) fail(Errc::timeout, what, " did not finish within ", timeout.count(), " s");
    pid = 0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      fail(Errc::peer_failure, what, " failed (status ", status, ")");
  }
};

// Spawns `argv` with extra environment entries; stdout to `out_fd` and
// stderr to `err_fd` when they are >= 0.
pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
            int out_fd = -1, int err_fd = -1) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp, args;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (out_fd >= 0) posix_spawn_file_actions_adddup2(&actions, out_fd, STDOUT_FILENO);
  if (err_fd >= 0) posix_spawn_file_actions_adddup2(&actions, err_fd, STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) fail(Errc::io, "cannot start ", argv[0], ": ", std::strerror(rc));
  return pid;
}

std::string find_in_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const auto candidate = std::filesystem::path(dir) / program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

// A TCP port free right now on 127.0.0.1 (bind port 0, read it back).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    fail(Errc::io, "cannot find a free TCP port: ", std::strerror(errno));
  ::close(fd);
  return ntohs(addr.sin_port);
}

// ---- ucx_perftest ----------------------------------------------------------

// Overall bandwidth in GB/s (1e9 bytes/s) from `ucx_perftest -f -v` CSV output
// ("iterations,...,avg_bw,overall_bw,..." in MB/s of 2^20 bytes).
double parse_perftest(const std::string& output) {
  std::stringstream lines(output);
  std::vector<std::string> header, values;
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> cells;
    std::stringstream cs(line);
    for (std::string cell; std::getline(cs, cell, ',');) cells.push_back(cell);
    if (!cells.empty() && cells[0] == "iterations")
      header = cells;
    else if (!header.empty() && cells.size() == header.size())
      values = cells;
  }
  for (std::size_t i = 0; i < header.size() && !values.empty(); ++i)
    if (header[i] == "overall_bw") return std::stod(values[i]) * double(kMiB) / 1e9;
  fail(Errc::format, "cannot find overall_bw in ucx_perftest output:\n", output);
}

std::string read_all(FILE* f) {
  std::string text;
  std::rewind(f);
  for (int c; (c = std::fgetc(f)) != EOF;) text += static_cast<char>(c);
  return text;
}

// Whether something listens on TCP `port` (IPv4 or IPv6), from /proc/net:
// looking does not take the server's one accept the way a probe connect would.
bool listening_on(int port) {
  char hex[8];
  std::snprintf(hex, sizeof hex, ":%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    FILE* f = std::fopen(table, "r");
    if (!f) continue;
    char line[512];
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f)) {
      std::istringstream cells(line);
      std::string slot, local, remote, state;
      cells >> slot >> local >> remote >> state;
      found = state == "0A" && local.size() > 5 && local.ends_with(hex);
    }
    std::fclose(f);
    if (found) return true;
  }
  return false;
}

// One ucx_perftest server and client pair on a fresh port. The client starts
// once the server listens; a failure carries both sides' messages.
double perftest_once(const std::string& exe, const Settings& s, std::size_t bytes) {
  const int port = free_port();
  const int64_t iters = iters_for(s, bytes);
  std::vector<std::string> args{exe,
                                "-t",
                                "tag_bw",
                                "-s",
                                std::to_string(bytes),
                                "-n",
                                std::to_string(iters),
                                "-w",
                                std::to_string(warmup_for(iters)),
                                "-p",
                                std::to_string(port),
                                "-O",
                                std::to_string(s.window),
                                "-f",
                                "-v"};
  const std::vector<std::string> env{"UCX_TLS=" + s.tls};
  struct Files {
    FILE* sink = std::tmpfile();
    FILE* server_err = std::tmpfile();
    FILE* out = std::tmpfile();
    FILE* client_err = std::tmpfile();
    ~Files() {
      for (FILE* f : {sink, server_err, out, client_err})
        if (f) std::fclose(f);
    }
  } files;
  if (!files.sink || !files.server_err || !files.out || !files.client_err)
    fail(Errc::io, "cannot create temporary files for ucx_perftest: ", std::strerror(errno));
  Child server{spawn(args, env, fileno(files.sink), fileno(files.server_err))};
  const auto listen_deadline = Clock::now() + std::chrono::seconds(60);
  while (!listening_on(port)) {
    int status = 0;
    if (::waitpid(server.pid, &status, WNOHANG) == server.pid) {
      server.pid = 0;
      fail(Errc::peer_failure, "ucx_perftest server on port ", port, " ended (status ", status,
           ") before it listened:\n", read_all(files.server_err));
    }
    if (Clock::now() > listen_deadline)
      fail(Errc::timeout, "ucx_perftest server did not listen on port ", port, " within 60 s:\n",
           read_all(files.server_err));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  args.insert(args.begin() + 1, "127.0.0.1");
  Child client{spawn(args, env, fileno(files.out), fileno(files.client_err))};
  try {
    // Well within the 300 s a caller may give the whole command, so that a
    // hung pair is repeated and its output shown.
    client.join("ucx_perftest client", std::chrono::seconds(90));
    server.join("ucx_perftest server", std::chrono::seconds(60));
  } catch (const Error& e) {
    fail(e.code(), e.what(), "\nclient:\n", read_all(files.client_err), "server:\n",
         read_all(files.server_err));
  }
  return parse_perftest(read_all(files.out));
}

// The reference is another program; on a busy machine a run of it can fail
// (seen once in CI: the client's UCX connection to the server refused). Such
// a run is repeated on a fresh port; three failures in a row are reported.
double perftest_gbps(const std::string& exe, const Settings& s, std::size_t bytes) {
  constexpr int kRounds = 3;
  for (int round = 1;; ++round) {
    try {
      return perftest_once(exe, s, bytes);
    } catch (const Error& e) {
      if (round == kRounds || e.code() == Errc::format) throw;
      const std::string what = e.what();  // its first line; the rest is the programs' output
      std::fprintf(stderr, "weightsync bench: ucx_perftest run %d of %d failed, repeating: %s\n",
                   round, kRounds, what.substr(0, what.find('\n')).c_str());
    }
  }
}

// ---- the two roles ---------------------------------------------------------

int run_receiver(const Settings& s, const std::string& store_dir) {
  auto store = make_file_store(store_dir);
  auto t = bench_transport(*store, s, 1);
  Tag tag = 1;
  for (std::size_t bytes : kSizes) run_size(*t, s, bytes, tag++);
  return 0;
}

std::vector<std::string> child_args(const Settings& s, const std::string& store_dir) {
  std::vector<std::string> args = {std::filesystem::read_symlink("/proc/self/exe").string(),
                                   "bench",
                                   "transport",
                                   "--role",
                                   "receiver",
                                   "--store",
                                   store_dir,
                                   "--tls",
                                   s.tls,
                                   "--iters",
                                   std::to_string(s.iters),
                                   "--window",
                                   std::to_string(s.window),
                                   "--device",
                                   s.device};
  if (on_gpu(s)) args.insert(args.end(), {"--transport", s.transport});
  return args;
}

std::vector<double> measure_weightsync(const Settings& s) {
  std::string dir = (std::filesystem::temp_directory_path() / "ws-bench-XXXXXX").string();
  if (!::mkdtemp(dir.data())) fail(Errc::io, "mkdtemp: ", std::strerror(errno));
  std::vector<double> gbps;
  {
    Child receiver{spawn(child_args(s, dir), {})};
    auto store = make_file_store(dir);
    auto t = bench_transport(*store, s, 0);
    Tag tag = 1;
    for (std::size_t bytes : kSizes) {
      const double seconds = run_size(*t, s, bytes, tag++);
      gbps.push_back(double(bytes) * double(iters_for(s, bytes)) / seconds / 1e9);
    }
    // Our endpoints close before the receiver exits: a UCX tcp endpoint
    // whose peer went first tries to reconnect and logs refusals.
    t.reset();
    receiver.join("the receiving process", kWait);
  }
  std::filesystem::remove_all(dir);
  return gbps;
}

// --json: `head` with the window, the unit and the results, on one line.
void print_json(const Settings& s, nlohmann::json head, const nlohmann::json& results) {
  head["window"] = s.window;
  head["unit"] = "GB/s = 1e9 bytes/s";
  head["results"] = results;
  std::cout << head.dump() << "\n";
}

void report(const Settings& s, const std::vector<double>& ours, const std::vector<double>& ref) {
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t i = 0; i < ours.size(); ++i)
    results.push_back({{"bytes", kSizes[i]},
                       {"iters", iters_for(s, kSizes[i])},
                       {"gbps", ours[i]},
                       {"perftest_gbps", ref[i]},
                       {"ratio", ref[i] > 0 ? ours[i] / ref[i] : 0.0}});
  if (s.json) return print_json(s, {{"tls", s.tls}}, results);
  std::printf("UCX transport vs ucx_perftest tag_bw, UCX_TLS=%s, window %lld, 2 processes\n",
              s.tls.c_str(), static_cast<long long>(s.window));
  std::printf("%12s %7s %16s %16s %7s   (GB/s = 1e9 bytes/s)\n", "bytes", "iters",
              "weightsync GB/s", "perftest GB/s", "ratio");
  for (const auto& r : results)
    std::printf("%12zu %7lld %16.3f %16.3f %7.3f\n", r["bytes"].get<std::size_t>(),
                static_cast<long long>(r["iters"].get<int64_t>()), r["gbps"].get<double>(),
                r["perftest_gbps"].get<double>(), r["ratio"].get<double>());
}

// --device cuda: each transport's GB/s per size against a device-to-device
// copy of the same bytes on GPU 0, timed in this process after the transfers.
void report_gpu(const Settings& s, const std::vector<std::string>& names,
                const std::vector<std::vector<double>>& gbps) {
  nlohmann::json results = nlohmann::json::array();
  for (std::size_t i = 0; i < std::size(kSizes); ++i) {
    const std::size_t bytes = kSizes[i];
    gpu::Memory src(bytes, gpu::MemoryPlace::device, 0), dst(bytes, gpu::MemoryPlace::device, 0);
    const double d2d_s = gpu::time_gpu(
        [&](const gpu::Stream& st) { gpu::copy_async(dst.data(), src.data(), bytes, st); }, 0, 10);
    const double d2d = static_cast<double>(bytes) / d2d_s / 1e9;
    nlohmann::json row = {{"bytes", bytes}, {"iters", iters_for(s, bytes)}, {"d2d_gbps", d2d}};
    for (std::size_t t = 0; t < names.size(); ++t)
      row["transports"][names[t]] = {{"gbps", gbps[t][i]}, {"ratio_to_d2d", gbps[t][i] / d2d}};
    results.push_back(row);
  }
  if (s.json) return print_json(s, {{"device", "cuda"}}, results);
  std::printf("GPU buffers between 2 processes on GPU 0, window %lld, vs a device-to-device copy\n",
              static_cast<long long>(s.window));
  std::printf("%12s %7s %12s", "bytes", "iters", "D2D GB/s");
  for (const auto& n : names) std::printf(" %22s", (n + " GB/s (x D2D)").c_str());
  std::printf("\n");
  for (const auto& r : results) {
    std::printf("%12zu %7lld %12.1f", r["bytes"].get<std::size_t>(),
                static_cast<long long>(r["iters"].get<int64_t>()), r["d2d_gbps"].get<double>());
    for (const auto& n : names)
      std::printf(" %14.1f (%5.2f)", r["transports"][n]["gbps"].get<double>(),
                  r["transports"][n]["ratio_to_d2d"].get<double>());
    std::printf("\n");
  }
}

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"tls", "iters", "window", "role", "store", "device", "transport"});
  Settings s;
  s.tls = args.get_or("tls", s.tls);
  s.iters = args.get_int("iters", 0);
  s.window = args.get_int("window", s.window);
  s.json = args.flag("json");
  if (s.iters < 0 || s.window < 1)
    fail(Errc::invalid_argument, "--iters must be >= 0 and --window >= 1");
  s.device = args.get_or("device", "cpu");
  demo::check_device(s.device, "--device");
  s.transport = args.get_or("transport", "");
  if (!on_gpu(s) && !s.transport.empty())
    fail(Errc::invalid_argument,
         "--transport is for --device cuda; on the host this benchmark measures ucx "
         "(choose its transports with --tls)");
  if (args.get("role") == std::optional<std::string>("receiver"))
    return run_receiver(s, args.require("store"));
  if (on_gpu(s)) {
    const std::vector<std::string> names =
        s.transport.empty() ? cuda_transports() : std::vector<std::string>{s.transport};
    std::vector<std::vector<double>> gbps;
    for (const auto& name : names) {
      Settings one = s;
      one.transport = name;
      gbps.push_back(measure_weightsync(one));
    }
    report_gpu(s, names, gbps);
    return 0;
  }
  const std::string perftest = find_in_path("ucx_perftest");
  if (perftest.empty())
    fail(Errc::not_found,
         "ucx_perftest not found in PATH; it is the reference of this benchmark (Debian: "
         "apt-get install ucx-utils)");
  const auto ours = measure_weightsync(s);
  std::vector<double> ref;
  for (std::size_t bytes : kSizes) ref.push_back(perftest_gbps(perftest, s, bytes));
  report(s, ours, ref);
  return 0;
}

const BenchRegistrar registrar{
    {"transport", "UCX transport bandwidth between two processes vs ucx_perftest tag_bw",
     "usage: weightsync bench transport [--json] [--tls TLS] [--iters N] [--window W]\n"
     "                                  [--device cpu|cuda [--transport T]]\n\n"
     "Sends 1, 16, 64 and 256 MiB messages from one process to a second one over the UCX\n"
     "transport (buffers registered once, W messages in flight, warm-up first), then runs\n"
     "ucx_perftest -t tag_bw (server and client on 127.0.0.1) with the same sizes,\n"
     "iterations, UCX_TLS and sends in flight (-O W), and prints both bandwidths and\n"
     "their ratio (weightsync / perftest).\n"
     "GB/s means 1e9 bytes per second.\n\n"
     "  --tls TLS     UCX transports for both (UCX_TLS syntax: shm, tcp, ...); default shm\n"
     "  --iters N     timed messages per size (default: about 1 GiB per size, at least 8)\n"
     "  --window W    messages in flight (default 8)\n"
     "  --json        one JSON object: {\"results\": [{\"bytes\", \"gbps\",\n"
     "                \"perftest_gbps\", \"ratio\"}], ...}\n"
     "  --device cuda the messages in GPU memory, both processes on GPU 0 (the\n"
     "                colocated case), over UCX moving CUDA memory (ucx?cuda=require:\n"
     "                a UCX built with CUDA, docs/transports.md) and over cuda_ipc,\n"
     "                each against a device-to-device copy of the same bytes timed\n"
     "                in the same run (results[].d2d_gbps, .transports[name].gbps,\n"
     "                .ratio_to_d2d); no ucx_perftest\n"
     "  --transport T with --device cuda: only T\n",
     run}};

}  // namespace
}  // namespace weightsync::cli
