#include "export_job.h"
#include "progress.h"

#include <nlohmann/json.hpp>

#include "demo_job.h"
#include "demo_procs.h"
#include "demo_run.h"

#include <weightsync/control.h>
#include <weightsync/error.h>
#include <weightsync/hf_checkpoint.h>
#include <weightsync/load_spec.h>
#include <weightsync/publisher.h>
#include <weightsync/safetensors.h>

#include "pipeline/loop.h"
#include "transport/staging.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

namespace weightsync::exporter {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

using pipeline::seconds_since;

nlohmann::json read_json_or_null(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  auto j = nlohmann::json::parse(in, nullptr, false);
  return j.is_discarded() ? nlohmann::json(nullptr) : j;
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2);
  if (!out) fail(Errc::io, "cannot write ", path);
}

// The rank's shards, filled from the checkpoint as `weightsync shard` cuts them:
// those of layout.rank_params(rank) (a pipeline stage holds its own).
struct Shards {
  std::vector<std::unique_ptr<char[]>> storage;
  std::vector<TensorView> views;
  std::vector<size_t> params;  // layout.params index of each view
};

Shards load_shards(const Checkpoint& ckpt, const TrainerLayout& layout, int rank) {
  Shards s;
  s.params = layout.rank_params(rank);
  for (size_t p : s.params) {
    const LoadSpec& spec = layout.params[p];
    const Shape shape = local_shape(spec, layout.mesh, rank);
    const size_t bytes = static_cast<size_t>(numel(shape)) * itemsize(spec.dtype);
    s.storage.emplace_back(new char[std::max<size_t>(bytes, 1)]);
    s.views.push_back(host_view(s.storage.back().get(), spec.dtype, shape));
    fill_local_tensor(ckpt, spec, layout.mesh, rank, s.views.back());
  }
  return s;
}

// fsync, as save_hf does with SaveHfOptions::sync.
void flush_to_device(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0 || ::fsync(fd) != 0) fail(Errc::io, "cannot flush ", path);
  ::close(fd);
}

// The bench's ceiling: this rank's files, the same keys from the same
// writer, written from memory that already holds their bytes (gathered from
// the checkpoint before the clock starts, each key at its own place, as
// cold in the caches as a save's), nothing moving between ranks.
class PlainWrite {
 public:
  PlainWrite(const Checkpoint& ckpt, const TrainerLayout& layout, const ExportJob& job, int rank)
      : files_(make_hf_file_layout(layout, job.max_file_bytes)),
        rank_(rank),
        dir_(job.plain_dir),
        sync_(job.sync) {
    int64_t total = 0;
    for (int f : files_.files_of(rank)) total += files_.files[static_cast<size_t>(f)].bytes;
    bytes_.resize(static_cast<size_t>(std::max<int64_t>(total, 1)));
    char* at = bytes_.data();
    for (int f : files_.files_of(rank)) {
      const HfFile& file = files_.files[static_cast<size_t>(f)];
      for (int k = file.first_key; k < file.first_key + file.num_keys; ++k) {
        const HfKey& key = files_.keys[static_cast<size_t>(k)];
        std::memcpy(at, ckpt.view(key.name).data, static_cast<size_t>(key.bytes));
        at += key.bytes;
      }
    }
  }

  // This rank's files in `dir` (rank 0: the index too).
  void remove_outputs(const std::string& dir) const {
    std::error_code ec;
    for (int f : files_.files_of(rank_))
      std::filesystem::remove(dir + "/" + files_.files[static_cast<size_t>(f)].name, ec);
    if (rank_ == 0) std::filesystem::remove(dir + "/" + std::string(kHfIndexName), ec);
  }

  // With `direct_io`, as a save with SaveHfOptions::direct_io writes.
  double run(bool direct_io) const {
    const auto start = Clock::now();
    const char* at = bytes_.data();
    for (int f : files_.files_of(rank_)) {
      const HfFile& file = files_.files[static_cast<size_t>(f)];
      std::vector<SafetensorsWriter::Entry> entries;
      for (int k = file.first_key; k < file.first_key + file.num_keys; ++k) {
        const HfKey& key = files_.keys[static_cast<size_t>(k)];
        entries.push_back({key.name, key.dtype, key.shape});
      }
      SafetensorsWriter writer(dir_ + "/" + file.name, entries);
      if (direct_io) writer.use_direct_io();
      for (const auto& e : entries) {
        const auto bytes = static_cast<size_t>(numel(e.shape)) * itemsize(e.dtype);
        writer.write_tensor(e.name, at, bytes);
        at += bytes;
      }
      writer.finish();
      if (sync_) flush_to_device(dir_ + "/" + file.name, false);
    }
    if (sync_) flush_to_device(dir_, true);
    return seconds_since(start);
  }

 private:
  HfFileLayout files_;
  int rank_;
  std::string dir_;
  bool sync_;
  std::vector<char> bytes_;
};

std::string worker_transport(const ExportJob& job, int rank) {
  if (rank != job.kill_rank) return job.transport;
  return demo::with_freeze(job.transport, "send", job.kill_after);
}

nlohmann::json save_json(const SaveHfResult& r) {
  return {{"seconds", r.seconds},
          {"files", r.files},
          {"total_bytes", r.total_bytes},
          {"files_written", r.files_written},
          {"bytes_written", r.bytes_written},
          {"bytes_local", r.bytes_local},
          {"bytes_sent", r.bytes_sent},
          {"bytes_received", r.bytes_received},
          {"arena_bytes", r.arena_bytes},
          {"staging_bytes", r.staging_bytes},
          {"disk_wait_s", r.disk_wait_s},
          {"disk_s", r.disk_s},
          {"disk_cpu_s", r.disk_cpu_s},
          {"data_cpu_s", r.data_cpu_s},
          {"setup_s", r.setup_s},
          {"data_s", r.data_s},
          {"finish_s", r.finish_s}};
}

// CPU time of this process (every thread, user and system).
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

std::string random_token() {
  std::random_device rd;
  return cat(std::hex, rd(), rd());
}

}  // namespace

nlohmann::json ExportJob::to_json() const {
  return {{"checkpoint", checkpoint},
          {"trainer", trainer},
          {"out", out},
          {"hf_config", hf_config},
          {"max_file_bytes", max_file_bytes},
          {"bucket_bytes", bucket_bytes},
          {"transport", transport},
          {"timeout_ms", timeout_ms},
          {"kill_rank", kill_rank},
          {"kill_after", kill_after},
          {"rounds", rounds},
          {"plain_dir", plain_dir},
          {"work_dir", work_dir},
          {"coordinator", coordinator},
          {"token", token},
          {"sync", sync},
          {"direct_io", direct_io}};
}

ExportJob ExportJob::from_json(const nlohmann::json& j) {
  ExportJob e;
  try {
    j.at("checkpoint").get_to(e.checkpoint);
    j.at("trainer").get_to(e.trainer);
    j.at("out").get_to(e.out);
    j.at("hf_config").get_to(e.hf_config);
    j.at("max_file_bytes").get_to(e.max_file_bytes);
    j.at("bucket_bytes").get_to(e.bucket_bytes);
    j.at("transport").get_to(e.transport);
    j.at("timeout_ms").get_to(e.timeout_ms);
    j.at("kill_rank").get_to(e.kill_rank);
    j.at("kill_after").get_to(e.kill_after);
    j.at("rounds").get_to(e.rounds);
    j.at("plain_dir").get_to(e.plain_dir);
    j.at("work_dir").get_to(e.work_dir);
    j.at("coordinator").get_to(e.coordinator);
    j.at("token").get_to(e.token);
    j.at("sync").get_to(e.sync);
    j.at("direct_io").get_to(e.direct_io);
  } catch (const nlohmann::json::exception& x) {
    fail(Errc::format, "export job file: ", x.what());
  }
  return e;
}

std::string ExportJob::stats_path(int rank) const {
  return cat(work_dir, "/export-rank", rank, ".json");
}

namespace {

// The rounds of one worker: each a plain write (bench) and a save, every
// phase started together from a barrier.
nlohmann::json run_rounds(const ExportJob& job, int rank, const Checkpoint& ckpt,
                          const TrainerLayout& layout, Publisher& pub) {
  const Millis timeout(job.timeout_ms);
  control::ClientOptions c;
  c.address = job.coordinator;
  c.token = job.token;
  c.connect_timeout = timeout;
  control::Client observer(c);
  const int ranks = static_cast<int>(layout.mesh.world());
  SaveHfOptions save;
  save.max_file_bytes = job.max_file_bytes;
  save.config = job.hf_config;
  save.bucket_bytes = job.bucket_bytes;
  save.sync = job.sync;
  save.direct_io = job.direct_io;
  std::optional<PlainWrite> plain;
  if (!job.plain_dir.empty()) plain.emplace(ckpt, layout, job, rank);
  // Each timed phase starts alike: its files gone (no page cache to reclaim,
  // no rename over a file), no dirty pages of another (the kernel's
  // writeback would throttle whichever runs next), from a barrier.
  auto phase = [&](const std::string& name, const std::string& dir, auto&& body) {
    if (plain) plain->remove_outputs(dir);
    ::sync();
    observer.barrier(name, ranks, timeout);
    const double cpu = cpu_seconds();
    nlohmann::json out = body();
    out["cpu_s"] = cpu_seconds() - cpu;
    ::sync();
    return out;
  };
  nlohmann::json rounds = nlohmann::json::array();
  for (int r = 0; r < job.rounds; ++r) {
    nlohmann::json row;
    if (plain) {
      // The plain write both ways: through the page cache, and bypassing it
      // as the save does by default; the bench compares with the faster.
      for (const bool direct : {false, true}) {
        const auto p = phase(cat("export plain ", direct ? "direct " : "", r), job.plain_dir, [&] {
          return nlohmann::json{{"s", plain->run(direct)}};
        });
        row[direct ? "plain_direct_seconds" : "plain_seconds"] = p["s"];
        row[direct ? "plain_direct_cpu_s" : "plain_cpu_s"] = p["cpu_s"];
      }
    }
    row["save"] = phase(cat("export save ", r), job.out,
                        [&] { return save_json(pub.save_hf(job.out, save)); });
    rounds.push_back(row);
  }
  return rounds;
}

}  // namespace

int run_export_worker(const ExportJob& job, int rank) {
  nlohmann::json stats = {{"rank", rank}, {"ok", false}};
  try {
    const Millis timeout(job.timeout_ms);
    const Checkpoint ckpt = Checkpoint::open(job.checkpoint);
    const TrainerLayout layout = TrainerLayout::load(job.trainer);
    check_checkpoint(ckpt, layout);
    Shards shards = load_shards(ckpt, layout, rank);
    PublisherOptions opt;
    opt.coordinator = job.coordinator;
    opt.token = job.token;
    opt.rank = rank;
    opt.layout = layout;
    opt.transport = worker_transport(job, rank);
    opt.connect_timeout = timeout;
    opt.step_timeout = timeout;
    Publisher pub(opt);
    for (size_t i = 0; i < shards.views.size(); ++i)
      pub.register_tensor(layout.params[shards.params[i]].name, shards.views[i]);
    stats["rounds"] = run_rounds(job, rank, ckpt, layout, pub);
    stats["ok"] = true;
  } catch (const Error& e) {
    std::cerr << "export rank " << rank << ": error [" << errc_name(e.code()) << "]: " << e.what()
              << "\n";
    stats["error"] = cat("[", errc_name(e.code()), "] ", e.what());
  }
  stats["peak_rss_mb"] = demo::peak_rss_mb();
  write_json(job.stats_path(rank), stats);
  return stats["ok"].get<bool>() ? 0 : 1;
}

nlohmann::json run_export(ExportJob job) {
  const TrainerLayout layout = TrainerLayout::load(job.trainer);
  const int ranks = static_cast<int>(layout.mesh.world());
  control::CoordinatorOptions co;
  co.token = random_token();
  co.step_timeout = Millis(job.timeout_ms);
  co.expect_trainers = ranks;
  control::Coordinator coordinator(co);
  job.coordinator = coordinator.address();
  job.token = co.token;
  const std::string job_path = job.work_dir + "/export-job.json";
  write_json(job_path, job.to_json());
  demo::ProcessGroup group(job.work_dir);
  // A rank killed before it writes its stats must not leave an older run's.
  for (int r = 0; r < ranks; ++r) std::filesystem::remove(job.stats_path(r));
  for (int r = 0; r < ranks; ++r)
    group.spawn(cat("export ", r), {"export", "--job", job_path, "--rank", std::to_string(r)},
                r == job.kill_rank, /*kill_when_stopped=*/r == job.kill_rank);
  // The save's bytes as they reach the disk, against the checkpoint's bytes
  // (each round rewrites them; a plain write goes elsewhere).
  double total = 0;
  if (job.progress) {
    const Checkpoint ckpt = Checkpoint::open(job.checkpoint);
    for (const auto& key : ckpt.keys())
      total += static_cast<double>(numel(ckpt.info(key).shape) * itemsize(ckpt.info(key).dtype));
  }
  cli::ProgressLine progress("export", total, "MB", 1e6, job.progress);
  auto on_tick = [&] {
    if (progress.active()) progress.update(cli::safetensors_bytes_on_disk(job.out));
  };
  // Loading the shards, each round's phases and the teardown: a timeout each.
  const auto children = group.wait_all(Millis(job.timeout_ms) * (3 * job.rounds + 3),
                                       std::chrono::seconds(10), nullptr, on_tick);
  on_tick();  // the last report: what the save left on disk
  nlohmann::json out = {{"ranks", ranks},
                        {"transport", job.transport},
                        {"direct_io", job.direct_io},
                        {"dir", job.out}};
  bool ok = !group.timed_out();
  nlohmann::json per_rank = nlohmann::json::array();
  std::vector<nlohmann::json> stats;
  for (int r = 0; r < ranks; ++r) {
    const auto& child = children[static_cast<size_t>(r)];
    stats.push_back(read_json_or_null(job.stats_path(r)));
    ok = ok && child.ok() && stats.back().is_object() && stats.back().value("ok", false);
    nlohmann::json row = {{"rank", r}, {"status", child.status()}, {"log", child.log_path}};
    if (stats.back().is_object()) row["stats"] = stats.back();
    per_rank.push_back(row);
  }
  out["ok"] = ok;
  out["per_rank"] = per_rank;
  // Not ok: which rank, and why (its own word, else how its process ended).
  for (int r = 0; !ok && r < ranks && !out.contains("error"); ++r) {
    const auto& child = children[static_cast<size_t>(r)];
    const auto& s = stats[static_cast<size_t>(r)];
    if (s.is_object() && s.contains("error"))
      out["error"] = cat("rank ", r, ": ", s["error"].get<std::string>());
    else if (!child.ok())
      out["error"] =
          cat("rank ", r, ": ", child.status(), ": ", demo::reason_in_log(child.log_path));
  }
  if (!ok && !out.contains("error"))
    out["error"] = group.timed_out() ? "the export ran past its time budget; its ranks were killed"
                                     : "a rank did not report success";
  nlohmann::json rounds = nlohmann::json::array();
  for (int i = 0; ok && i < job.rounds; ++i) {
    double save_s = 0, plain_s = 0, plain_direct_s = 0;
    nlohmann::json first;
    for (const auto& s : stats) {
      const auto& row = s["rounds"][static_cast<size_t>(i)];
      save_s = std::max(save_s, row["save"]["seconds"].get<double>());
      if (row.contains("plain_seconds")) {
        plain_s = std::max(plain_s, row["plain_seconds"].get<double>());
        plain_direct_s = std::max(plain_direct_s, row["plain_direct_seconds"].get<double>());
      }
      first = row["save"];
    }
    const double bytes = first["total_bytes"].get<double>();
    nlohmann::json r = {{"seconds", save_s},
                        {"bytes", first["total_bytes"]},
                        {"files", first["files"]},
                        {"gbps", bytes / save_s / 1e9}};
    if (plain_s > 0) {
      r["plain_seconds"] = plain_s, r["plain_gbps"] = bytes / plain_s / 1e9;
      r["plain_direct_seconds"] = plain_direct_s;
      r["plain_direct_gbps"] = bytes / plain_direct_s / 1e9;
    }
    rounds.push_back(r);
  }
  out["rounds"] = rounds;
  return out;
}

}  // namespace weightsync::exporter
