// The writer side of Publisher::save_hf on one rank: where each key it writes
// is assembled (the arena), when it is complete, and the thread that streams
// the rank's files to disk while the next buckets arrive.
//
// A rank's keys (WriterLayout::stream_of: its files' keys in file order)
// arrive in buckets (receive k of the rank's receive order), so key i is
// complete once the last bucket carrying it is applied (time -1: before the
// first bucket, for keys the rank holds itself), and it is handed to the disk
// thread then, whatever the keys before it: the thread writes each key at its
// place in its file (SafetensorsWriter::write_at, tmp + rename once the
// file's last key is written), so the disk starts at once with what the rank
// holds and never waits for a key that is still on its way while later ones
// are ready. Hand-offs (and the disk thread) go in `ArenaPlan::order`: by
// hand-off time, then writing order. A key's bytes may land from two
// receives before the first bucket carrying it (receives are posted two
// ahead) and are read by the disk thread for up to kWriterLag receives after
// its hand-off; the data path waits for the disk when it falls further
// behind. Keys whose lives (those spans) do not meet share memory, so the
// arena holds a few windows of keys plus the largest tensor, never the
// rank's files.
#pragma once

#include "core/writer_layout.h"

#include <weightsync/safetensors.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace weightsync::trainer {

// Receives the disk thread may trail behind the one being applied.
inline constexpr int64_t kWriterLag = 2;

struct ArenaPlan {
  std::vector<int> stream;       // the rank's keys in writing order
  std::vector<int64_t> handoff;  // per stream position: hand-off time (-1: at the start)
  std::vector<size_t> order;     // stream positions in hand-off order (time, then position)
  std::vector<int64_t> offset;   // per stream position: bytes into the arena; -1: not in it
  int64_t arena_bytes = 0;
  // Per time t (index t + 1, t = -1 .. receives - 1): the stream positions
  // handed off at t.
  std::vector<std::vector<size_t>> handed_at;
};

// `keys_of_receive[k]`: the keys (HfFileLayout indices) receive k carries;
// `direct[i]`: stream position i is written straight from the rank's shard
// (no arena). Keys of zero bytes take no arena either.
ArenaPlan plan_arena(const WriterLayout& wl, int rank,
                     const std::vector<std::vector<int>>& keys_of_receive,
                     const std::vector<bool>& direct);

// Stream positions that must be on disk before anything lands at time t.
size_t written_before(const ArenaPlan& plan, int64_t t);

// CPU time of the calling thread, in seconds.
double thread_cpu_seconds();

// Flushes a file's (or a directory's entries') data to the device:
// Errc::io naming the path when the OS refuses.
void fsync_path(const std::string& path, bool directory = false);

// Writes one rank's files on a thread of its own, key by key in `order`
// (stream positions; ArenaPlan::order), each at its place in its file; a
// file is renamed into place once its last key is written and, with `sync`,
// flushed to the device (fsync_path) before that key counts as done.
// With `direct_io`, files bypass the page cache where the filesystem allows.
// Unfinished files are removed (their .tmp) when it is destroyed.
class FileWriter {
 public:
  FileWriter(const WriterLayout& wl, int rank, std::vector<size_t> order, std::string dir,
             bool sync, bool direct_io);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // A key's bytes in file order: runs of host memory.
  struct Run {
    const char* data = nullptr;
    std::size_t bytes = 0;
  };
  // Hands stream position i over (in `order`): the memory of its runs stays
  // valid and unchanged until done() passes i's place in `order`.
  void push(size_t i, std::vector<Run> runs);
  // Keys written so far: a prefix of `order`.
  std::size_t done() const noexcept { return done_.load(std::memory_order_acquire); }
  std::size_t size() const noexcept { return stream_.size(); }
  // Rethrows the disk thread's error, if it failed.
  void check() const;
  std::vector<std::string> written_files() const;  // finished so far, full paths
  uint64_t bytes_written() const noexcept { return bytes_.load(std::memory_order_relaxed); }
  // Seconds the thread spent writing, and its CPU time (after done() == size()).
  double busy_seconds() const noexcept { return busy_s_; }
  double cpu_seconds() const noexcept { return cpu_s_; }

 private:
  void run();
  void write_one(size_t i, const std::vector<Run>& runs);

  const WriterLayout& wl_;
  std::string dir_;
  bool sync_ = false;
  bool direct_io_ = false;  // SafetensorsWriter::use_direct_io for every file
  std::vector<int> stream_;
  std::vector<size_t> order_;
  std::vector<std::vector<Run>> tasks_;
  std::vector<bool> ready_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::atomic<std::size_t> done_{0};
  std::atomic<uint64_t> bytes_{0};
  double busy_s_ = 0;
  double cpu_s_ = 0;
  // Per file of the layout: its writer while open, and its keys not yet written.
  std::vector<std::unique_ptr<SafetensorsWriter>> open_;
  std::vector<int> keys_left_;
  std::vector<uint64_t> key_offset_;  // per key of the layout: its offset in its file's data
  std::vector<std::string> finished_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace weightsync::trainer
