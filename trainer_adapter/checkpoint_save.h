// The data path of Publisher::save_hf on one trainer rank: it sends the
// pieces other writers need from its shards and receives, assembles and
// writes the keys of its own files, both at once, over one transport world
// of the trainer ranks.
//
// The plan (trainer layout -> writer windows, core/writer_layout.h) is run
// in one global order of its buckets, the same on every rank: by the
// window's place among its writer's windows, then (writer - sender) mod
// world (so that at each level every sender feeds a different writer: no
// incast), then writer, sender and bucket id. Each rank sends its buckets in
// that order (two in flight, packed into two slots or sent straight from the
// shards) and receives its own in that order (two posted ahead, landing in
// two slots or straight in the arena), in one loop that never blocks one
// side on the other: the earliest unfinished bucket is always posted by its
// sender and its receiver, so the save cannot deadlock. Keys the writer
// holds itself are copied from its own shards (or written straight from
// them) when they are handed to the disk thread (checkpoint_writer.h).
#pragma once

#include "checkpoint_writer.h"
#include "core/copy_program.h"
#include "core/writer_layout.h"
#include "pipeline/copier.h"
#include "pipeline/loop.h"
#include "pipeline/setup.h"

#include <weightsync/backend/transport.h>
#include <weightsync/plan.h>
#include "pipeline/wire.h"
#include "transport/staging.h"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace weightsync::trainer {

struct SaveStats {
  uint64_t bytes_sent = 0;         // to other writers
  uint64_t bytes_received = 0;     // from other ranks
  uint64_t bytes_local = 0;        // of this rank's files, from its own shards
  uint64_t bytes_written = 0;      // payload of this rank's files
  std::vector<std::string> files;  // written by this rank (full paths)
  std::size_t arena_bytes = 0;
  std::size_t staging_bytes = 0;  // the four slots
  double disk_wait_s = 0;         // the data path waiting for the disk thread
  double disk_s = 0;              // the disk thread writing (and flushing)
  double disk_cpu_s = 0;          // CPU time of the disk thread
  double data_cpu_s = 0;          // CPU time of the thread running the transfers
};

// Host memory a publisher keeps from one save to the next for the arena: a
// save reuses it when it fits, so periodic saves fault in (and the kernel
// zeroes) no fresh pages for it.
struct SaveArenaCache {
  std::shared_ptr<char[]> raw;
  std::size_t bytes = 0;
};

// The buckets of `plan` in the save's global order (see above).
std::vector<int32_t> save_order(const Plan& plan, const WriterLayout& wl);

class SavePipeline {
 public:
  // `plan`: nullptr when no bytes move (every writer holds its keys). The
  // tensors are this rank's registered shards (TrainerLayout::params order),
  // all in `memory`; `caps` are the transport's.
  SavePipeline(const WriterLayout& wl, const Plan* plan, int rank,
               const std::vector<TensorView>& tensors, const pipeline::RankMemory& memory,
               const Capabilities& caps, int64_t direct_min_bytes);
  ~SavePipeline();

  // Allocates the arena (host arenas from `cache` when given) and the slots
  // (registered with `transport` when there is one) and uploads the copy
  // programs for CUDA shards.
  void prepare(Transport* transport, const std::string& who, SaveArenaCache* cache = nullptr);
  // Runs the save into `dir` (with `sync`, every file and then `dir` flushed
  // to the device before it returns; `direct_io`: SaveHfOptions::direct_io). `poll` is called about
  // every millisecond and throws to abandon it; `tag_step` separates saves on one transport.
  SaveStats run(const std::string& dir, bool sync, bool direct_io, int64_t tag_step,
                Transport* transport, const std::function<void()>& poll,
                std::chrono::steady_clock::time_point deadline);
  void cancel_all();
  // The ranks this one sends buckets to or receives buckets from, ascending.
  std::vector<int> peers() const;

 private:
  struct SendAction {
    int32_t bucket = 0;
    int peer = 0;  // the writer's trainer rank
    CopyProgram pack;
    std::vector<FragmentRoute> fragments;
    int64_t packed_bytes = 0, bytes = 0;
  };
  struct RecvAction {
    int32_t bucket = 0;
    int peer = 0;  // the sender
    CopyProgram apply;
    std::vector<FragmentRoute> fragments;
    int64_t slot_bytes = 0, bytes = 0;
  };
  struct Slot {
    StagingBuffer buffer;
    std::vector<std::unique_ptr<Request>> posted;
    size_t action = 0;
  };
  // What a key this rank writes is made of, in file order: runs straight
  // from its own shards (parts that are dense runs of both the shard and the
  // key), the rest from its place in the arena, where the other ranks' parts
  // land and its other parts are copied (`copy`) when it is handed off.
  struct Local {
    struct Run {
      const char* shard = nullptr;    // nullptr: from the arena
      int64_t offset = 0, bytes = 0;  // in the key
    };
    std::vector<Run> runs;
    std::vector<size_t> copied;  // wl_.local[key] parts that go through the arena
    CopyProgram copy;
    bool straight = false;  // every byte from the shards: no arena place
    int program = -1;       // index of `copy` in the local copier
  };
  void compile_sends(const std::vector<int32_t>& order);
  void compile_receives();
  void allocate_arena(Transport* transport, SaveArenaCache* cache);
  void compile_local_copies();
  void allocate_slots(Transport& transport);
  void compile_locals();
  bool sends_step(int64_t tag_step);
  bool receives_step(int64_t tag_step);
  void post_receive(size_t k, int64_t tag_step);
  void settle(size_t k);
  void hand_off(int64_t t);
  void wait_disk(int64_t t);
  void wait(const std::function<bool()>& ready, const std::function<std::string()>& what);
  static bool complete(Slot& slot);

  const WriterLayout& wl_;
  const Plan* plan_;
  int rank_;
  std::vector<TensorView> tensors_;
  pipeline::RankMemory memory_;
  Capabilities caps_;
  WireOptions wire_;
  std::vector<SendAction> sends_;
  std::vector<RecvAction> receives_;
  ArenaPlan arena_plan_;
  std::vector<Local> locals_;  // per stream position
  std::shared_ptr<void> arena_owner_;
  char* arena_ = nullptr;
  std::unique_ptr<MemoryRegion> arena_region_;
  std::size_t send_slot_bytes_ = 0, recv_slot_bytes_ = 0;
  Slot send_slots_[2], recv_slots_[2];
  pipeline::Copier pack_copier_, apply_copier_, local_copier_;
  // Set for the duration of run().
  std::unique_ptr<FileWriter> writer_;
  std::optional<pipeline::Loop> loop_;
  Transport* transport_ = nullptr;
  std::function<void()> poll_;
  std::chrono::steady_clock::time_point deadline_;
  std::string who_;
  size_t next_send_ = 0, next_post_ = 0, next_settle_ = 0;
  SaveStats stats_;
};

}  // namespace weightsync::trainer
