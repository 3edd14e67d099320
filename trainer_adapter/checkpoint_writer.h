// The writer side of Publisher::save_hf on one rank: where each key it writes
// is assembled (the arena), when it is complete, and the thread that streams
// the rank's files to disk while the next buckets arrive.
//
// A rank writes its keys in writing order (WriterLayout::stream_of), each
// file with the streaming SafetensorsWriter (tmp + rename). Keys arrive in
// buckets (receive k of the rank's receive order), so key i is complete once
// the last bucket carrying it is applied, and it can be handed to the disk
// once every key before it was: its hand-off time is the largest completion
// time of keys 0..i (time -1: before the first bucket). Its bytes may land
// from two receives before the first bucket carrying it (receives are
// posted two ahead) and are read by the disk thread for up to kWriterLag
// receives after its hand-off; the data path waits for the disk when it
// falls further behind. Keys whose lives (those spans) do not meet share
// memory, so the arena holds a few windows of keys plus the largest tensor,
// never the rank's files.
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

// Flushes a file's (or a directory's entries') data to the device:
// Errc::io naming the path when the OS refuses.
void fsync_path(const std::string& path, bool directory = false);

// Streams one rank's files on a thread of its own, key by key in writing
// order; with `sync`, each file is flushed to the device (fsync_path) once
// renamed into place, before its last key counts as done. Unfinished files
// are removed (their .tmp) when it is destroyed.
class FileWriter {
 public:
  FileWriter(const WriterLayout& wl, int rank, std::string dir, bool sync);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // A key's bytes in file order: runs of host memory.
  struct Run {
    const char* data = nullptr;
    std::size_t bytes = 0;
  };
  // Hands stream position i over (positions in order): the memory of its
  // runs stays valid and unchanged until done() > i.
  void push(size_t i, std::vector<Run> runs);
  // Positions written so far (a prefix of the stream).
  std::size_t done() const noexcept { return done_.load(std::memory_order_acquire); }
  std::size_t size() const noexcept { return stream_.size(); }
  // Rethrows the disk thread's error, if it failed.
  void check() const;
  std::vector<std::string> written_files() const;  // finished so far, full paths
  uint64_t bytes_written() const noexcept { return bytes_.load(std::memory_order_relaxed); }
  // Seconds the thread spent writing (after done() == size()).
  double busy_seconds() const noexcept { return busy_s_; }

 private:
  void run();
  void write_one(size_t i, const std::vector<Run>& runs);

  const WriterLayout& wl_;
  std::string dir_;
  bool sync_ = false;
  std::vector<int> stream_;
  std::vector<std::vector<Run>> tasks_;
  std::vector<bool> ready_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::atomic<std::size_t> done_{0};
  std::atomic<uint64_t> bytes_{0};
  double busy_s_ = 0;
  std::unique_ptr<SafetensorsWriter> file_;
  std::vector<std::string> finished_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace weightsync::trainer
