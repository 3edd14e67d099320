// Publisher::save_hf and load_hf: the control around the save's data path
// (checkpoint_save.h). Per save, under "<job>/save/<n>/" in the store:
// - "options": rank 0's (max_file_bytes, bucket_bytes); the others check theirs.
// - "transport/...": the save's own transport world of the trainer ranks.
// - "done/<r>": rank r wrote its files.
// - "end": "ok" once rank 0 wrote the index, or "abort: <why>" from the first
//   rank that failed (or saw another die). Every rank watches it on a thread
//   of its own, so a failure anywhere stops every rank within a millisecond
//   of its data loop, and no rank returns before the checkpoint is complete.
#include "checkpoint_save.h"
#include "publisher_impl.h"

#include <weightsync/error.h>
#include <weightsync/safetensors.h>
#include <weightsync/topology.h>

#include "core/writer_layout.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

namespace weightsync {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

using pipeline::left_until;

std::vector<uint8_t> bytes_of(const std::string& s) {
  return {s.begin(), s.end()};
}

std::string text_of(const std::vector<uint8_t>& b) {
  return {b.begin(), b.end()};
}

// Writes `text` to `path` through a temporary file renamed into place
// (flushed to the device first with `sync`).
void write_file_atomically(const fs::path& path, const std::string& text, bool sync) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) fail(Errc::io, "cannot write ", tmp.string());
  }
  if (sync) trainer::fsync_path(tmp.string());
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail(Errc::io, "cannot rename ", tmp.string(), " to ", path.string(), ": ", ec.message());
}

// Watches "<prefix>end" on a thread of its own (see the top of this file).
class EndWatch {
 public:
  EndWatch(control::Client& client, std::string key, Clock::time_point deadline)
      : thread_([this, &client, key = std::move(key), deadline] {
          // The save's transport is driven by the rank's own thread; this
          // wait must not progress it too (two threads in one UCX worker
          // abort the process: seen as a bench export rank killed by SIGABRT).
          control::Client::QuietWaits quiet;
          std::string value;
          try {
            value = text_of(client.get(key, left_until(deadline) + Millis(1000)));
          } catch (const Error& e) {
            value = cat("abort: watching the save's end: ", e.what());
          }
          {
            std::lock_guard lock(mu_);
            value_ = std::move(value);
          }
          set_.store(true, std::memory_order_release);
        }) {}
  ~EndWatch() { thread_.join(); }
  bool set() const { return set_.load(std::memory_order_acquire); }
  std::string value() const {
    std::lock_guard lock(mu_);
    return value_;
  }

 private:
  mutable std::mutex mu_;
  std::string value_;
  std::atomic<bool> set_{false};
  std::thread thread_;
};

}  // namespace

struct Publisher::SaveRun {
  SaveRun(Impl& impl, std::string d, SaveHfOptions o)
      : m(impl), dir(std::move(d)), opt(std::move(o)) {}

  Impl& m;
  std::string dir;
  SaveHfOptions opt;
  int64_t seq = 0;
  std::string prefix, who;
  Clock::time_point deadline;
  std::unique_ptr<EndWatch> watch;
  // Destroyed in reverse: the data path, its plan, the layout, the transport.
  pipeline::TransportEnd net;  // the transport, kept progressing in the client's waits
  std::optional<WriterLayout> wl;
  std::optional<Plan> plan;
  std::unique_ptr<trainer::SavePipeline> pipe;
  bool aborted_by_others = false;
  Clock::time_point start = Clock::now();
  double setup_s = 0;

  int rank() const { return m.opt.rank; }
  int world() const { return m.trainer_world(); }
  std::string key(const std::string& what) const { return prefix + what; }

  void poll();
  bool complete_now();
  Error explain(const Error& e);
  Error abort(Error e);
  void agree_options();
  trainer::SaveStats transfer();
  std::vector<uint8_t> wait_key(const std::string& what, const std::string& waiting_for);
  void finish_checkpoint(const WriterLayout& wl);
  void wait_end();
};

// Rank 0 sets "end" before it returns and leaves, and the coordinator keeps
// each connection's order: once a rank that left is seen, an "ok" it (or
// rank 0) set is already in the store.
bool Publisher::SaveRun::complete_now() {
  try {
    return text_of(m.client->get(key("end"), Millis(0))) == "ok";
  } catch (const Error&) {
    return false;
  }
}

// The error a save fails with: it names this rank and the save, and when a
// transfer failed because a trainer rank died (the transport only knows a
// peer failed), the rank that left, as the coordinator saw it.
Error Publisher::SaveRun::explain(const Error& e) {
  const std::string what = e.what();
  if (what.rfind(who, 0) == 0) return e;
  const bool peer = e.code() == Errc::peer_failure || e.code() == Errc::transport ||
                    e.code() == Errc::timeout || e.code() == Errc::cancelled;
  const auto until = Clock::now() + Millis(peer ? 1000 : 0);
  do {
    try {
      while (auto ev = m.client->poll_event()) {
        auto* left = std::get_if<control::MemberLeft>(&*ev);
        if (left && left->member.role == control::Role::trainer)
          return Error(Errc::peer_failure, cat(who, ": trainer rank ", left->member.rank, " left (",
                                               left->reason, ") during the save; ", what));
      }
    } catch (const Error&) {
      break;  // the coordinator is gone too: report the first failure
    }
    std::this_thread::sleep_for(Millis(5));
  } while (Clock::now() < until);
  return Error(e.code(), cat(who, ": ", what));
}

// The first failure tells every rank; one that only relays an abort does not.
Error Publisher::SaveRun::abort(Error e) {
  if (!aborted_by_others) {
    try {
      m.client->set(key("end"), bytes_of(cat("abort: ", e.what())));
    } catch (const Error&) {
    }
  }
  return e;
}

// Stops the save when it was aborted or another trainer rank left.
void Publisher::SaveRun::poll() {
  if (watch && watch->set()) {
    const std::string v = watch->value();
    // Complete: ranks that return now and leave are no failure.
    if (v == "ok") return;
    {
      aborted_by_others = true;
      fail(Errc::peer_failure, who, ": the save was aborted: ", v.substr(v.find(':') + 2));
    }
  }
  while (auto ev = m.client->poll_event()) {
    auto* left = std::get_if<control::MemberLeft>(&*ev);
    if (!left) continue;  // no push runs now: step news are stale
    const control::Member& who_left = left->member;
    if (who_left.role == control::Role::engine) {
      if (who_left.rank >= 0 && who_left.rank < static_cast<int>(m.dead.size()))
        m.dead[static_cast<size_t>(who_left.rank)] = true;
    } else if (who_left.role == control::Role::trainer && !complete_now()) {
      fail(Errc::peer_failure, who, ": trainer rank ", who_left.rank, " left (", left->reason,
           ") during the save");
    }
  }
}

void Publisher::SaveRun::agree_options() {
  const nlohmann::json mine = {{"max_file_bytes", opt.max_file_bytes},
                               {"bucket_bytes", opt.bucket_bytes},
                               {"sync", opt.sync},
                               {"direct_io", opt.direct_io},
                               {"world", world()}};
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(Errc::io, who, ": cannot create the directory: ", ec.message());
  if (rank() == 0) {
    // Before any file of this save exists: a crash from here on never
    // leaves an index beside files it does not describe.
    fs::remove(fs::path(dir) / kHfIndexName, ec);
    if (ec) fail(Errc::io, who, ": cannot remove the old ", kHfIndexName, ": ", ec.message());
    m.client->set(key("options"), bytes_of(mine.dump()));
    return;
  }
  const auto blob = wait_key("options", "rank 0 to start the save");
  const auto theirs = nlohmann::json::parse(blob.begin(), blob.end(), nullptr, false);
  if (theirs != mine)
    fail(Errc::invalid_argument, who, ": its options ", mine.dump(), " differ from rank 0's ",
         theirs.dump(), " (every rank must save with the same options)");
}

// Sets up the save's transport, plan and data path and runs it. They stay
// alive (in the SaveRun) until the save ends everywhere: a rank that is done
// must not take its endpoints down while others still connect to it.
trainer::SaveStats Publisher::SaveRun::transfer() {
  const pipeline::RankMemory memory = pipeline::rank_memory(
      m.tensors, [&](size_t i) { return m.opt.layout.params[i].name; }, who);
  Capabilities caps;
  caps.host_memory = true;
  if (!wl->windows.empty()) {
    net = pipeline::open_transport(*m.client, opt.transport, key("transport"), rank(), world(),
                                   world(), memory, left_until(deadline));
    caps = net.transport->capabilities();
    // Every rank's address is in the store before anyone connects: a rank
    // that died or failed before it got here aborts this wait (poll) instead
    // of a connect waiting out the bootstrap timeout.
    m.client->set(key(cat("ready/", rank())), bytes_of("ok"));
    for (int r = 0; r < world(); ++r)
      if (r != rank()) wait_key(cat("ready/", r), cat("trainer rank ", r, " to join the save"));
    plan = make_plan(m.opt.layout, wl->engine, Topology{}, {PlanMode::p2p, opt.bucket_bytes});
  }
  pipe = std::make_unique<trainer::SavePipeline>(*wl, plan ? &*plan : nullptr, rank(), m.tensors,
                                                 memory, caps, m.opt.wire.direct_min_bytes);
  Transport* transport = net.transport.get();
  pipe->prepare(transport, who, &m.save_arena);
  // Endpoints now, to the ranks this one exchanges buckets with only.
  if (transport)
    for (int peer : pipe->peers()) transport->connect(peer);
  setup_s = std::chrono::duration<double>(Clock::now() - start).count();
  return pipe->run(
      dir, opt.sync, opt.sync && opt.direct_io, seq, transport, [this] { poll(); }, deadline);
}

// The value of `what` in the save's store, watching for aborts meanwhile.
std::vector<uint8_t> Publisher::SaveRun::wait_key(const std::string& what,
                                                  const std::string& waiting_for) {
  while (true) {
    poll();
    try {
      return m.client->get(key(what), std::min(left_until(deadline), Millis(50)));
    } catch (const Error& e) {
      if (e.code() != Errc::timeout) throw;
    }
    if (Clock::now() >= deadline) fail(Errc::timeout, who, ": waited in vain for ", waiting_for);
  }
}

// Rank 0, once every rank wrote its files: config.json, then the index, then
// stale shards of an earlier save with another file count go.
void Publisher::SaveRun::finish_checkpoint(const WriterLayout& wl) {
  for (int r = 1; r < world(); ++r)
    wait_key(cat("done/", r), cat("trainer rank ", r, " to finish its files"));
  const fs::path root(dir);
  if (!opt.config.empty()) {
    std::ifstream in(opt.config, std::ios::binary);
    if (!in) fail(Errc::io, who, ": cannot read the config ", opt.config);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    write_file_atomically(root / "config.json", text, opt.sync);
  }
  write_file_atomically(root / kHfIndexName, wl.files.index_json().dump(2) + "\n", opt.sync);
  if (opt.sync) trainer::fsync_path(dir, true);
  const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::set<std::string> ours;
  for (const HfFile& f : wl.files.files) ours.insert(f.name);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, shard) && !ours.count(name)) fs::remove(entry.path(), ec);
  }
}

// Every rank returns only once the checkpoint is complete (or aborted).
void Publisher::SaveRun::wait_end() {
  while (!watch->set()) {
    poll();
    if (Clock::now() >= deadline + Millis(1000))
      fail(Errc::timeout, who, ": rank 0 did not write the index in time");
    std::this_thread::sleep_for(Millis(1));
  }
  poll();
}

// Windows small enough that each writer's disk starts early and keeps busy
// (about 32 per writer: a writer's first keys complete once its first window
// arrived), at least 1 MiB (messages stay large), at most a quarter of the
// publisher's bucket (the memory bound of SaveHfOptions::bucket_bytes).
int64_t default_save_bucket_bytes(const TrainerLayout& layout, int64_t publisher_bucket) {
  int64_t total = 0;
  for (const LoadSpec& p : layout.params)
    for (const Shape& shape : p.key_shapes())
      total += numel(shape) * static_cast<int64_t>(itemsize(p.dtype));
  const int64_t mib = int64_t{1} << 20;
  const int64_t cap = std::max(mib, publisher_bucket / 4);
  return std::clamp(total / (32 * layout.mesh.world()) / mib * mib, mib, cap);
}

SaveHfResult Publisher::save_hf(const std::string& dir, const SaveHfOptions& options) {
  Impl& m = *impl_;
  std::lock_guard lock(m.push_mutex);
  const auto start = Clock::now();
  SaveRun run(m, dir, options);
  run.start = start;
  run.seq = ++m.saves;
  run.prefix = cat(m.opt.job, "/save/", run.seq, "/");
  run.who = cat("trainer rank ", m.opt.rank, ": save_hf to '", dir, "'");
  if (run.opt.bucket_bytes == 0)
    run.opt.bucket_bytes = default_save_bucket_bytes(m.opt.layout, m.opt.plan.bucket_bytes);
  if (run.opt.transport.empty()) run.opt.transport = m.opt.transport;
  run.deadline = start + (run.opt.timeout.count() > 0 ? run.opt.timeout : m.opt.step_timeout);
  SaveHfResult result;
  try {
    m.require_registered("save_hf");
    if (run.opt.max_file_bytes <= 0 || run.opt.bucket_bytes < 1024)
      fail(Errc::invalid_argument, run.who, ": max_file_bytes (", run.opt.max_file_bytes,
           ") must be positive and bucket_bytes (", run.opt.bucket_bytes, ") at least 1024");
    // Watching first: a rank 0 that fails before it starts stops everyone.
    run.watch = std::make_unique<EndWatch>(*m.client, run.key("end"), run.deadline);
    run.agree_options();
    run.wl = make_writer_layout(m.opt.layout, run.opt.max_file_bytes, run.opt.bucket_bytes);
    const WriterLayout& wl = *run.wl;
    const trainer::SaveStats stats = run.transfer();
    const auto data_end = Clock::now();
    m.client->set(run.key(cat("done/", m.opt.rank)), bytes_of("ok"));
    if (m.opt.rank == 0) {
      run.finish_checkpoint(wl);
      m.client->set(run.key("end"), bytes_of("ok"));
    }
    run.wait_end();
    result.setup_s = run.setup_s;
    result.data_s = std::chrono::duration<double>(data_end - start).count() - run.setup_s;
    result.finish_s = std::chrono::duration<double>(Clock::now() - data_end).count();
    result.files = static_cast<int>(wl.files.files.size());
    result.total_bytes = static_cast<uint64_t>(wl.files.total_bytes());
    result.files_written = stats.files;
    result.bytes_written = stats.bytes_written;
    result.bytes_local = stats.bytes_local;
    result.bytes_sent = stats.bytes_sent;
    result.bytes_received = stats.bytes_received;
    result.arena_bytes = stats.arena_bytes;
    result.staging_bytes = stats.staging_bytes;
    result.disk_wait_s = stats.disk_wait_s;
    result.disk_s = stats.disk_s;
    result.disk_cpu_s = stats.disk_cpu_s;
    result.data_cpu_s = stats.data_cpu_s;
  } catch (const Error& e) {
    throw run.abort(run.explain(e));
  } catch (const std::exception& e) {
    throw run.abort(Error(Errc::internal, cat(run.who, ": ", e.what())));
  }
  result.dir = dir;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

LoadReport Publisher::load_hf(const std::string& dir) {
  Impl& m = *impl_;
  std::lock_guard lock(m.push_mutex);
  m.require_registered("load_hf");
  return load_local_tensors(Checkpoint::open(dir), m.opt.layout, m.opt.rank, m.tensors);
}

}  // namespace weightsync
