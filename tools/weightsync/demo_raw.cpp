#include "demo_raw.h"

#include <nlohmann/json.hpp>

#include "demo_device.h"

#include <weightsync/backend/transport.h>
#include <weightsync/error.h>

#include "transport/staging.h"

namespace weightsync::demo {
namespace {

using Clock = std::chrono::steady_clock;
constexpr Tag kRawTagBase = Tag{1} << 46;

// bytes[t][g]: what the plan moves from trainer rank t to engine rank g.
std::vector<std::vector<int64_t>> link_bytes(const Plan& plan) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(plan.trainer_world()),
                                        std::vector<int64_t>(plan.engine_world(), 0));
  for (const Bucket& b : plan.buckets()) {
    auto& row = out[static_cast<size_t>(b.src_rank)];
    if (b.dst_rank >= 0) {
      row[static_cast<size_t>(b.dst_rank)] += b.bytes;
    } else {
      for (auto& v : row) v += b.bytes;
    }
  }
  return out;
}

}  // namespace

nlohmann::json run_raw_rounds(const JobSpec& job, const Plan& plan, control::Client& client,
                              const std::string& role, int rank) {
  const int trainers = plan.trainer_world(), engines = plan.engine_world();
  const bool trainer = role == "trainer";
  const auto links = link_bytes(plan);
  const auto chunk = static_cast<size_t>(job.bucket_bytes);
  const std::chrono::milliseconds timeout(job.timeout_ms);
  TransportOptions o;
  o.name = job.transport;
  o.store = &client;
  o.prefix = "raw/transport";
  o.rank = trainer ? rank : trainers + rank;
  o.world = trainers + engines;
  o.bootstrap_timeout = timeout;
  o.device = on_gpu(job) ? gpu_of(o.rank) : -1;
  auto transport = make_transport(o);
  // The barriers below wait while UCX may still owe a peer a protocol
  // message (the end of a rendezvous): progress it meanwhile.
  auto progress = client.while_waiting([&transport] { transport->progress(); });
  for (int p = 0; p < o.world; ++p)
    if (p != o.rank) transport->connect(p);

  int64_t total = 0;
  if (trainer) {
    for (int64_t v : links[static_cast<size_t>(rank)]) total += v;
  } else {
    for (const auto& row : links) total += row[static_cast<size_t>(rank)];
  }
  // A trainer sends every chunk from one buffer; an engine receives into
  // distinct memory, as the real thing would. The memory is the sync's: GPU
  // memory for a CUDA job over a transport that reaches it, pinned host
  // memory over one that does not, host memory otherwise.
  const size_t buffer_bytes = std::max<size_t>(
      trainer ? std::min<size_t>(chunk, static_cast<size_t>(total)) : static_cast<size_t>(total),
      1);
  const Capabilities caps = transport->capabilities();
  const SlotMemory memory = !on_gpu(job)       ? SlotMemory::host
                            : caps.cuda_memory ? SlotMemory::device
                                               : SlotMemory::pinned;
  StagingBuffer buffer = allocate_staging(*transport, buffer_bytes, memory, gpu_of(o.rank));

  nlohmann::json seconds = nlohmann::json::array();
  for (int round = 0; round < job.raw_rounds; ++round) {
    client.barrier(cat("raw start ", round), trainers + engines, timeout);
    const auto start = Clock::now();
    std::vector<std::unique_ptr<Request>> requests;
    size_t offset = 0;
    const int peers = trainer ? engines : trainers;
    for (int p = 0; p < peers; ++p) {
      int64_t left = trainer ? links[static_cast<size_t>(rank)][static_cast<size_t>(p)]
                             : links[static_cast<size_t>(p)][static_cast<size_t>(rank)];
      for (Tag c = 0; left > 0; ++c) {
        const size_t n = std::min<size_t>(chunk, static_cast<size_t>(left));
        if (trainer) {
          requests.push_back(transport->send(trainers + p, kRawTagBase + c, buffer.buffer(0, n)));
        } else {
          requests.push_back(transport->recv(p, kRawTagBase + c, buffer.buffer(offset, n)));
          offset += n;
        }
        left -= static_cast<int64_t>(n);
      }
    }
    wait_all(requests, timeout);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    requests.clear();
    client.barrier(cat("raw end ", round), trainers + engines, timeout);
  }
  buffer = StagingBuffer{};  // before its transport
  progress = {};
  return {{"bytes", total},
          {"seconds", seconds},
          {"memory", slot_memory_name(memory)},
          {"cuda_memory", caps.cuda_memory},
          {"library", caps.library}};
}

}  // namespace weightsync::demo
