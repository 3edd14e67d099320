// The `weightsync coordinator` command's Prometheus endpoint, scraped as an
// operator's Prometheus would: repeatedly, gzip and plain, by scrapers that
// hang up mid-response or mid-request, and while a job runs steps against
// the coordinator; each scrape parsed with prometheus_client's parser. The
// coordinator must stay alive and serving (`weightsync status` answers) and
// exit 0 on SIGTERM.
//
// The first scrape used to kill the command (SIGSEGV in a civetweb worker):
// civetweb, as Debian builds it, runs its workers on 100 KiB stacks, and
// glibc places a thread's static TLS inside its stack; the command carried
// 72 KiB of it (a 64 KiB thread_local buffer of the FP8 quantizer), which
// left the worker too little stack. The Python extension, loaded with
// dlopen, keeps its TLS off the threads' stacks, so in-process coordinators
// never showed it. CommandBinary.StaticTlsLeavesRoomInSmallThreadStacks
// keeps that budget.
#include "control/coordinator_process.h"
#include "e2e/e2e_helpers.h"

#include <weightsync/control.h>
#include <weightsync/layouts.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <elf.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::CoordinatorProcess;

int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    throw std::runtime_error("connect to the metrics port failed");
  }
  return fd;
}

void send_all(int fd, const std::string& bytes) {
  for (size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return;
    at += static_cast<size_t>(n);
  }
}

// Closes with a reset (SO_LINGER 0): the peer's next write fails at once.
void reset(int fd) {
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  ::close(fd);
}

std::string request(bool gzip) {
  return std::string("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n") +
         (gzip ? "Accept-Encoding: gzip\r\n" : "") + "\r\n";
}

struct Response {
  std::string head, body;
};

// One whole scrape: the response read to the end (Connection: close).
Response scrape(uint16_t port, bool gzip = false) {
  const int fd = connect_to(port);
  send_all(fd, request(gzip));
  std::string all;
  char buf[4096];
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    all.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  Response r;
  const auto end = all.find("\r\n\r\n");
  r.head = all.substr(0, end);
  if (end != std::string::npos) r.body = all.substr(end + 4);
  return r;
}

// A scraper that goes away: after `read` bytes of the response (0: right
// after its request), or halfway through its request.
void hang_up(uint16_t port, size_t read, bool mid_request = false) {
  const int fd = connect_to(port);
  const std::string req = request(read % 2 == 1);
  if (mid_request) {
    send_all(fd, req.substr(0, req.size() / 2));
    return reset(fd);
  }
  send_all(fd, req);
  std::string got;
  char buf[64];
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (got.size() < read && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, std::min(sizeof buf, read - got.size()), 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  reset(fd);
}

// The samples of an exposition as prometheus_client's parser reads it:
// "name{labels} value" lines, sorted; throws when it does not parse.
std::string parse_with_prometheus_client(const std::string& exposition) {
  const std::string dir = e2e::temp_dir("metrics-parse");
  const std::string in = dir + "/metrics.txt", script = dir + "/parse.py";
  std::ofstream(in, std::ios::binary) << exposition;
  std::ofstream(script)
      << "import sys\n"
         "from prometheus_client.parser import text_string_to_metric_families\n"
         "text = open(sys.argv[1]).read()\n"
         "lines = []\n"
         "for family in text_string_to_metric_families(text):\n"
         "    for s in family.samples:\n"
         "        labels = ','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))\n"
         "        lines.append(f'{s.name}{{{labels}}} {s.value}')\n"
         "print('\\n'.join(sorted(lines)))\n";
  const std::string cmd =
      std::string("'") + WEIGHTSYNC_TEST_PYTHON + "' '" + script + "' '" + in + "' 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = ::pclose(p);
  std::filesystem::remove_all(dir);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("prometheus_client's parser refused the exposition: " + out);
  return out;
}

double sample(const std::string& samples, const std::string& series) {
  std::istringstream in(samples);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

uint16_t metrics_port(CoordinatorProcess& proc) {
  // The second line: "metrics on http://127.0.0.1:PORT/metrics".
  const std::string line = proc.next_line(20s);
  const auto colon = line.rfind(':'), slash = line.rfind('/');
  if (line.rfind("metrics on http://", 0) != 0 || colon == std::string::npos || slash < colon)
    throw std::runtime_error("no metrics line, got '" + line + "'");
  return static_cast<uint16_t>(std::stoi(line.substr(colon + 1, slash - colon - 1)));
}

// A trainer rank and an engine rank of tiny-llama (fsdp=1 into tp=1), as
// threads of this process, pushing `steps` versions (each flips every
// byte of the trainer's tensors) through the coordinator at `address`.
struct Job {
  std::vector<int64_t> committed;  // the steps the engine committed
  std::string error;
};

Job run_job(const std::string& address, int steps) {
  const e2e::Model m = e2e::make_model("tiny-llama", "fsdp=1", 1, 1);
  const Checkpoint ckpt = Checkpoint::open(m.checkpoint);
  const TrainerLayout layout = TrainerLayout::load(m.trainer);
  const EngineConfig config = load_engine_config(m.engine);
  const EngineLayout engine_layout = make_engine_layout(config);
  const EngineRankLayout& rl = engine_layout.rank_layout(0);
  // ipc_host, its own memory usable in its own process: every machine has it.
  const std::string transport = "ipc_host?local=1";
  Job job;
  std::vector<e2e::Storage> params;
  for (const EngineParam& p : rl.params)
    params.push_back(e2e::make_storage(p.dtype, p.shape, false));
  std::thread engine([&] {
    try {
      SubscriberOptions so;
      so.coordinator = address;
      so.engine = config;
      so.transport = transport;
      Subscriber sub(so);
      for (size_t i = 0; i < rl.params.size(); ++i)
        sub.register_param(rl.params[i].name, params[i].view);
      for (int i = 0; i < 600 && sub.version() < steps; ++i)
        if (auto o = sub.run_step(100ms); o && o->committed) job.committed.push_back(o->step);
    } catch (const std::exception& e) {
      job.error = e.what();
    }
  });
  try {
    std::vector<e2e::Storage> shards;
    PublisherOptions po;
    po.coordinator = address;
    po.layout = layout;
    po.engine = config;
    po.transport = transport;
    po.plan.bucket_bytes = 16384;
    Publisher pub(po);
    for (size_t p : layout.rank_params(0)) {
      const LoadSpec& spec = layout.params[p];
      shards.push_back(e2e::make_storage(spec.dtype, local_shape(spec, layout.mesh, 0), false));
      fill_local_tensor(ckpt, spec, layout.mesh, 0, shards.back().view);
      pub.register_tensor(spec.name, shards.back().view);
    }
    for (int step = 1; step <= steps; ++step) {
      for (e2e::Storage& s : shards) {
        auto* bytes = static_cast<uint8_t*>(s.view.data);
        for (size_t i = 0; i < s.view.nbytes(); ++i) bytes[i] ^= 0x5A;
      }
      pub.push(step);
    }
  } catch (const std::exception& e) {
    job.error = e.what();
  }
  engine.join();
  return job;
}

TEST(CoordinatorMetrics, ScrapesLeaveTheCommandAliveAndServing) {
#ifndef WEIGHTSYNC_WITH_PROMETHEUS
  GTEST_SKIP() << "weightsync was built without prometheus-cpp: the coordinator serves no metrics";
#endif
  CoordinatorProcess proc({});
  ASSERT_NE(proc.port(), 0) << proc.first_line();
  const uint16_t port = metrics_port(proc);
  const std::string address = "127.0.0.1:" + std::to_string(proc.port());

  // Repeated scrapes, plain and gzip (as Prometheus asks).
  for (int i = 0; i < 10; ++i) {
    const Response r = scrape(port, i % 2 == 1);
    ASSERT_EQ(r.head.rfind("HTTP/1.1 200", 0), 0u) << "scrape " << i << ": " << r.head;
    ASSERT_TRUE(proc.alive()) << "the coordinator died at scrape " << i;
  }
  const std::string first = parse_with_prometheus_client(scrape(port).body);
  EXPECT_EQ(sample(first, "exposer_scrapes_total{}"), 10) << first;
  // An idle coordinator exports its series at 0 (sample() answers -1 for an
  // absent one), so that alerts on absent series stay quiet.
  for (const char* series :
       {"weightsync_steps_begun_total{}", "weightsync_steps_committed_total{}",
        "weightsync_steps_aborted_total{reason=timeout}",
        "weightsync_steps_aborted_total{reason=trainer_lost}", "weightsync_step_seconds_count{}",
        "weightsync_step_bytes{}", "weightsync_bytes_total{}", "weightsync_plan_changes_total{}",
        "weightsync_members{role=trainer}", "weightsync_members{role=engine}",
        "weightsync_replicas_active{}"})
    EXPECT_EQ(sample(first, series), 0) << series << " in\n" << first;

  // Scrapers that hang up: mid-request, right after it, mid-response.
  for (size_t read : {0, 1, 7, 64, 200}) hang_up(port, read);
  for (int i = 0; i < 5; ++i) hang_up(port, 0, /*mid_request=*/true);
  ASSERT_TRUE(proc.alive()) << "the coordinator died under scrapers that hang up";

  // Scrapes (and scrapers that hang up) while a job runs steps against it.
  constexpr int kSteps = 4;
  std::atomic<bool> done{false};
  std::atomic<int> scrapes{0};
  std::string scrape_error;
  std::thread scraper([&] {
    while (!done) {
      try {
        const Response r = scrape(port, scrapes % 2 == 1);
        if (r.head.rfind("HTTP/1.1 200", 0) != 0) throw std::runtime_error("status: " + r.head);
        if (scrapes % 3 == 0) parse_with_prometheus_client(scrape(port).body);
        hang_up(port, 32);
        ++scrapes;
      } catch (const std::exception& e) {
        if (scrape_error.empty()) scrape_error = e.what();
      }
    }
  });
  Job job;
  try {
    job = run_job(address, kSteps);
  } catch (const std::exception& e) {
    job.error = e.what();
  }
  done = true;
  scraper.join();
  EXPECT_EQ(job.error, "");
  EXPECT_EQ(job.committed, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(scrape_error, "");
  EXPECT_GT(scrapes.load(), 0);
  ASSERT_TRUE(proc.alive()) << "the coordinator died while scraped during steps";

  // What the job did, as Prometheus reads it.
  const std::string after = parse_with_prometheus_client(scrape(port).body);
  EXPECT_EQ(sample(after, "weightsync_steps_begun_total{}"), kSteps) << after;
  EXPECT_EQ(sample(after, "weightsync_steps_committed_total{}"), kSteps) << after;
  EXPECT_EQ(sample(after, "weightsync_engine_version{engine_rank=0}"), kSteps) << after;

  // `weightsync status`, once and watching, answers after all that.
  const auto once = e2e::run_cli({"status", "--coordinator", address, "--json"}, 60);
  ASSERT_EQ(once.exit_code, 0) << once.output;
  const auto status = nlohmann::json::parse(once.output);
  EXPECT_EQ(status["newest"].get<int64_t>(), kSteps) << once.output;
  const auto watch = e2e::run_cli({"status", "--coordinator", address, "--json", "--watch",
                                   "--interval", "0.2", "--count", "3"},
                                  60);
  ASSERT_EQ(watch.exit_code, 0) << watch.output;
  std::istringstream lines(watch.output);
  int objects = 0;
  for (std::string line; std::getline(lines, line);)
    if (!line.empty()) {
      EXPECT_EQ(nlohmann::json::parse(line)["newest"].get<int64_t>(), kSteps) << line;
      ++objects;
    }
  EXPECT_EQ(objects, 3) << watch.output;

  ASSERT_TRUE(proc.alive());
  EXPECT_EQ(proc.terminate(), 0) << "the coordinator did not stop cleanly on SIGTERM";
}

// The cause of the crash above, kept from coming back: the command's static
// TLS, which glibc carves out of every thread's stack (civetweb's are 100
// KiB), stays small.
TEST(CommandBinary, StaticTlsLeavesRoomInSmallThreadStacks) {
  std::ifstream in(WEIGHTSYNC_CLI, std::ios::binary);
  ASSERT_TRUE(in) << WEIGHTSYNC_CLI;
  Elf64_Ehdr eh{};
  in.read(reinterpret_cast<char*>(&eh), sizeof eh);
  ASSERT_EQ(std::string(reinterpret_cast<const char*>(eh.e_ident), 4), std::string(ELFMAG, 4));
  uint64_t tls = 0;
  for (int i = 0; i < eh.e_phnum; ++i) {
    Elf64_Phdr ph{};
    in.seekg(static_cast<std::streamoff>(eh.e_phoff + static_cast<uint64_t>(i) * eh.e_phentsize));
    in.read(reinterpret_cast<char*>(&ph), sizeof ph);
    if (ph.p_type == PT_TLS) tls = ph.p_memsz;
  }
  // CUDA's static runtime brings 4 KiB of its own, page-aligned.
  EXPECT_LE(tls, 16u << 10) << WEIGHTSYNC_CLI << " has " << tls
                            << " bytes of static TLS (readelf -sW: the TLS symbols): every "
                               "thread's stack gives that up, 100 KiB civetweb workers too";
}

}  // namespace
}  // namespace weightsync::control
