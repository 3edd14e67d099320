// The transport conformance suite: the same scenarios (scenarios_test.cpp)
// over every transport, between real processes on this machine.
#include "harness.h"

#include "core/cuda/gpu.h"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>

namespace weightsync::transport_test {
namespace {

class Conformance : public ::testing::TestWithParam<TransportSpec> {
 protected:
  void SetUp() override {
    if (const std::string why = not_built_reason(GetParam().name); !why.empty())
      GTEST_SKIP() << why;
    // A world of one shows whether the transport can run here at all.
    TempDir dir;
    try {
      make_test_transport(GetParam().name, dir.path, 0, 1, "probe");
    } catch (const Error& e) {
      if (e.code() == Errc::unsupported) GTEST_SKIP() << e.what();
      FAIL() << "creating " << GetParam().name << ": " << e.what();
    }
  }

  void run(const std::string& scenario, int world = 2) {
    if (GetParam().name.rfind("nccl", 0) == 0 && gpu::device_count() < world)
      GTEST_SKIP() << "NCCL refuses two ranks of one communicator on one GPU (\"Duplicate GPU "
                      "detected\"): "
                   << scenario << " needs " << world << " GPUs, this machine has "
                   << gpu::device_count();
    std::string failures;
    try {
      failures = run_scenario(scenario, GetParam().name, world);
    } catch (const std::exception& e) {
      FAIL() << scenario << " over " << GetParam().name << ", rank 0: " << e.what();
    }
    EXPECT_EQ(failures, "") << scenario << " over " << GetParam().name;
  }

  // NCCL pairs messages by posting order, not by tag, and cannot tell a size
  // mismatch (see nccl_transport.h).
  bool matches_by_tag() const { return GetParam().name.rfind("nccl", 0) != 0; }
};

TEST_P(Conformance, PerTagOrderingBetweenAPair) {
  if (!matches_by_tag()) GTEST_SKIP() << "NCCL matches messages by order, not by tag";
  run("ordering");
}

TEST_P(Conformance, SixtyFourMessagesInFlightEachWay) {
  run("in_flight");
}

TEST_P(Conformance, SizesFromZeroBytesTo128MiB) {
  run("sizes");
}

TEST_P(Conformance, OneGiBMessage) {
  if (!GetParam().big)
    GTEST_SKIP() << "1 GiB runs over shared memory only, to keep the suite short";
  run("one_gib");
}

TEST_P(Conformance, UnalignedBuffers) {
  run("unaligned");
}

TEST_P(Conformance, ReceiveTimesOutNamingPeerTagAndSize) {
  if (!matches_by_tag()) GTEST_SKIP() << "a timed-out NCCL receive aborts the communicator";
  run("recv_timeout");
}

TEST_P(Conformance, PeerKilledMidTransferFailsTheReceive) {
  run("peer_death");
}

TEST_P(Conformance, MessageLargerThanReceiveBufferIsAnError) {
  if (!matches_by_tag()) GTEST_SKIP() << "NCCL cannot detect a size mismatch";
  run("truncation");
}

TEST_P(Conformance, BroadcastToAllAndToASubset) {
  run("broadcast", 3);
}

// A sender that learned its messages arrived (sends_settled) closes without
// waiting for the peer: rank 1 receives a small and a large message, answers,
// then does not progress its transport until rank 0's close has returned. A
// graceful UCX close waits for the peer to progress (10 s at most, then it
// forces the close); settled, it does not wait at all.
TEST_P(Conformance, ClosingAfterSettledSendsDoesNotWaitForAnIdlePeer) {
  if (GetParam().name.rfind("nccl", 0) == 0 && gpu::device_count() < 2)
    GTEST_SKIP() << "NCCL refuses two ranks of one communicator on one GPU";
  TempDir dir;
  PeerProcesses peer("idle_after_answer", GetParam().name, 2, dir.path, "t");
  double close_seconds = 0;
  {
    auto t = make_test_transport(GetParam().name, dir.path, 0, 2);
    const MemoryKind memory = memory_for(*t);
    TestBuffer small(64, memory), large(8 << 20, memory), answer(1, memory);
    small.fill(1);
    large.fill(2);
    auto sent_small = t->send(1, 1, small.buffer());
    auto sent_large = t->send(1, 2, large.buffer());
    EXPECT_EQ(t->recv(1, 3, answer.buffer())->wait(std::chrono::seconds(60)), 1u);
    EXPECT_EQ(sent_small->wait(std::chrono::seconds(60)), 64u);
    EXPECT_EQ(sent_large->wait(std::chrono::seconds(60)), std::size_t{8} << 20);
    sent_small.reset();
    sent_large.reset();
    t->sends_settled();
    const auto start = std::chrono::steady_clock::now();
    t.reset();
    close_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::ofstream(dir.path + "/closed") << "closed\n";
  EXPECT_EQ(peer.join(std::chrono::seconds(120)), "");
  // Far below UCX's bounded wait for a peer (10 s): the close did not wait.
  EXPECT_LT(close_seconds, 5.0) << GetParam().name << ": closing waited for the idle peer";
}

// A transport lends memory (rank 0 to itself here: the loan is used in place)
// or refuses to with Errc::unsupported naming itself; what it says in
// capabilities() decides which.
TEST_P(Conformance, LendsMemoryExactlyWhenItSaysItCan) {
  if (GetParam().name.rfind("nccl", 0) == 0 && gpu::device_count() < 1)
    GTEST_SKIP() << "NCCL needs a GPU";
  TempDir dir;
  auto t = make_test_transport(GetParam().name, dir.path, 0, 1, "lend");
  const Capabilities caps = t->capabilities();
  const MemoryKind memory = caps.host_memory ? MemoryKind::host : MemoryKind::cuda;
  TestBuffer b(4096, memory);
  Buffer part = b.buffer();
  part.data = static_cast<char*>(part.data) + 64;
  part.bytes = 1000;
  std::vector<void*> at;
  if (!caps.maps_peer_memory) {
    for (const auto& call : std::vector<std::function<void()>>{
             [&] { (void)t->expose(0, 1, {part}); }, [&] { (void)t->map_exposed(0, 1, &at); }}) {
      try {
        call();
        ADD_FAILURE() << GetParam().name << " lent memory it says it cannot";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::unsupported) << e.what();
        EXPECT_NE(std::string(e.what()).find(t->name()), std::string::npos) << e.what();
      }
    }
    return;
  }
  auto loan = t->expose(0, 1, {part, Buffer{nullptr, 0, memory, -1, nullptr}});
  auto map = t->map_exposed(0, 1, &at);
  EXPECT_EQ(map->wait(std::chrono::seconds(30)), 1000u);
  EXPECT_EQ(loan->wait(std::chrono::seconds(30)), 1000u);
  EXPECT_EQ(at, (std::vector<void*>{part.data, nullptr}));
}

INSTANTIATE_TEST_SUITE_P(
    Transports, Conformance,
    ::testing::Values(TransportSpec{"ucx_tcp", "ucx?tls=tcp,self", false},
                      TransportSpec{"ucx_shm", "ucx?tls=posix,sysv,cma,self", true},
                      TransportSpec{"fault_passthrough_ucx", "fault:ucx?tls=tcp,self&seed=7",
                                    false},
                      TransportSpec{"nccl", "nccl", false},
                      // cuda_ipc's protocol between processes over shared host
                      // memory (test-only), and cuda_ipc itself on one GPU.
                      TransportSpec{"ipc_host", "ipc_host", false},
                      TransportSpec{"cuda_ipc", "cuda_ipc", true}),
    [](const ::testing::TestParamInfo<TransportSpec>& info) { return info.param.label; });

}  // namespace
}  // namespace weightsync::transport_test
