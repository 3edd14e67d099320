#include "checkpoint_writer.h"

#include <weightsync/error.h>

#include "core/first_fit.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

namespace weightsync::trainer {
namespace {

// Places start on 256-byte boundaries (vectorised copies, registration).
constexpr int64_t kAlign = 256;

int64_t aligned(int64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

}  // namespace

ArenaPlan plan_arena(const WriterLayout& wl, int rank,
                     const std::vector<std::vector<int>>& keys_of_receive,
                     const std::vector<bool>& direct) {
  ArenaPlan out;
  out.stream = wl.stream_of(rank);
  const size_t n = out.stream.size();
  std::vector<int64_t> pos_of(wl.files.keys.size(), -1);
  for (size_t i = 0; i < n; ++i)
    pos_of[static_cast<size_t>(out.stream[i])] = static_cast<int64_t>(i);
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> first(n, kNone), complete(n, -1);
  for (size_t k = 0; k < keys_of_receive.size(); ++k)
    for (int key : keys_of_receive[k]) {
      const int64_t i = pos_of[static_cast<size_t>(key)];
      if (i < 0)
        fail(Errc::internal, "save_hf: receive ", k, " of trainer rank ", rank, " carries key '",
             wl.files.keys[static_cast<size_t>(key)].name, "', which another rank writes");
      first[static_cast<size_t>(i)] =
          std::min(first[static_cast<size_t>(i)], static_cast<int64_t>(k));
      complete[static_cast<size_t>(i)] = static_cast<int64_t>(k);
    }
  out.handoff.assign(n, -1);
  out.offset.assign(n, -1);
  out.handed_at.assign(keys_of_receive.size() + 1, {});
  std::vector<detail::LiveSpan> spans;
  for (size_t i = 0; i < n; ++i) {
    const int64_t handoff = complete[i];
    out.handoff[i] = handoff;
    out.handed_at[static_cast<size_t>(handoff + 1)].push_back(i);
    const int64_t bytes = wl.files.keys[static_cast<size_t>(out.stream[i])].bytes;
    if (direct[i] || bytes == 0) continue;
    // Bytes land from two receives before the first carrying the key (or, for
    // a key this rank holds whole, at its hand-off); the disk reads them
    // until kWriterLag receives after the hand-off.
    const int64_t start = first[i] == kNone ? handoff : std::max<int64_t>(-1, first[i] - 2);
    spans.push_back({i, start, handoff + kWriterLag, aligned(bytes)});
  }
  out.arena_bytes = detail::place_first_fit(std::move(spans), out.offset);
  for (const auto& at : out.handed_at) out.order.insert(out.order.end(), at.begin(), at.end());
  return out;
}

size_t written_before(const ArenaPlan& plan, int64_t t) {
  // Hand-off times grow along `order`: the keys are a prefix of it.
  size_t i = 0;
  while (i < plan.order.size() && plan.handoff[plan.order[i]] + kWriterLag < t) ++i;
  return i;
}

double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) fail(Errc::io, "cannot open ", path, " to flush it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail(Errc::io, "flushing ", path, " to the device failed: ", std::strerror(err));
}

FileWriter::FileWriter(const WriterLayout& wl, int rank, std::vector<size_t> order, std::string dir,
                       bool sync, bool direct_io)
    : wl_(wl),
      dir_(std::move(dir)),
      sync_(sync),
      direct_io_(direct_io),
      stream_(wl.stream_of(rank)),
      order_(std::move(order)) {
  if (order_.size() != stream_.size())
    fail(Errc::internal, "save_hf: the disk order of trainer rank ", rank, " has ", order_.size(),
         " keys, its files ", stream_.size());
  tasks_.resize(stream_.size());
  ready_.assign(stream_.size(), false);
  open_.resize(wl.files.files.size());
  keys_left_.assign(wl.files.files.size(), 0);
  key_offset_.assign(wl.files.keys.size(), 0);
  for (int f : wl.files.files_of(rank)) {
    const HfFile& file = wl.files.files[static_cast<size_t>(f)];
    keys_left_[static_cast<size_t>(f)] = file.num_keys;
    uint64_t at = 0;  // keys lie in a file in layout order, as SafetensorsWriter declares them
    for (int k = file.first_key; k < file.first_key + file.num_keys; ++k) {
      key_offset_[static_cast<size_t>(k)] = at;
      at += static_cast<uint64_t>(wl.files.keys[static_cast<size_t>(k)].bytes);
    }
  }
  // A file of no keys (an empty model) is written at once.
  for (int f : wl.files.files_of(rank)) {
    const HfFile& file = wl.files.files[static_cast<size_t>(f)];
    if (file.num_keys > 0) continue;
    SafetensorsWriter empty(dir_ + "/" + file.name, {});
    empty.finish();
    if (sync_) fsync_path(dir_ + "/" + file.name);
    finished_.push_back(dir_ + "/" + file.name);
  }
  thread_ = std::thread([this] { run(); });
}

FileWriter::~FileWriter() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void FileWriter::push(size_t i, std::vector<Run> runs) {
  {
    std::lock_guard lock(mu_);
    tasks_.at(i) = std::move(runs);
    ready_.at(i) = true;
  }
  cv_.notify_all();
}

void FileWriter::check() const {
  std::lock_guard lock(mu_);
  if (error_) std::rethrow_exception(error_);
}

std::vector<std::string> FileWriter::written_files() const {
  std::lock_guard lock(mu_);
  return finished_;
}

void FileWriter::run() {
  for (size_t n = 0; n < order_.size(); ++n) {
    const size_t i = order_[n];
    std::vector<Run> runs;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || ready_[i]; });
      if (stop_) return;
      runs = std::move(tasks_[i]);
    }
    try {
      const auto t = std::chrono::steady_clock::now();
      write_one(i, runs);
      busy_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    } catch (...) {
      std::lock_guard lock(mu_);
      error_ = std::current_exception();
      return;
    }
    cpu_s_ = thread_cpu_seconds();
    done_.store(n + 1, std::memory_order_release);
  }
}

void FileWriter::write_one(size_t i, const std::vector<Run>& runs) {
  const HfKey& key = wl_.files.keys[static_cast<size_t>(stream_[i])];
  const auto f = static_cast<size_t>(key.file);
  const HfFile& file = wl_.files.files[f];
  const std::string path = dir_ + "/" + file.name;
  std::unique_ptr<SafetensorsWriter>& out = open_[f];
  if (!out) {
    std::vector<SafetensorsWriter::Entry> entries;
    for (int k = file.first_key; k < file.first_key + file.num_keys; ++k) {
      const HfKey& e = wl_.files.keys[static_cast<size_t>(k)];
      entries.push_back({e.name, e.dtype, e.shape});
    }
    out = std::make_unique<SafetensorsWriter>(path, std::move(entries));
    if (direct_io_) out->use_direct_io();
  }
  uint64_t at = key_offset_[static_cast<size_t>(stream_[i])], bytes = 0;
  for (const Run& r : runs) {
    out->write_at(at, r.data, r.bytes);
    at += r.bytes;
    bytes += r.bytes;
  }
  if (bytes != static_cast<uint64_t>(key.bytes))
    fail(Errc::internal, "save_hf: key '", key.name, "' handed to the disk with ", bytes,
         " bytes, expected ", key.bytes);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (--keys_left_[f] == 0) {
    out->finish();
    out.reset();
    if (sync_) fsync_path(path);
    std::lock_guard lock(mu_);
    finished_.push_back(path);
  }
}

}  // namespace weightsync::trainer
