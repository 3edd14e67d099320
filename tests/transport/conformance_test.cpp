// The transport conformance suite: the same scenarios (scenarios_test.cpp)
// over every transport, between real processes on this machine.
#include "harness.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace weightsync::transport_test {
namespace {

class Conformance : public ::testing::TestWithParam<TransportSpec> {
 protected:
  void SetUp() override {
    const std::string& name = GetParam().name;
    const std::string base = name.substr(0, name.find_first_of(":?"));
    const auto built = transport_names();
    if (std::find(built.begin(), built.end(), base) == built.end())
      GTEST_SKIP() << "transport '" << base << "' is not built in (WEIGHTSYNC_WITH_*)";
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

INSTANTIATE_TEST_SUITE_P(
    Transports, Conformance,
    ::testing::Values(TransportSpec{"ucx_tcp", "ucx?tls=tcp,self", false},
                      TransportSpec{"ucx_shm", "ucx?tls=posix,sysv,cma,self", true},
                      TransportSpec{"fault_passthrough_ucx", "fault:ucx?tls=tcp,self&seed=7",
                                    false},
                      TransportSpec{"nccl", "nccl", false}),
    [](const ::testing::TestParamInfo<TransportSpec>& info) { return info.param.label; });

}  // namespace
}  // namespace weightsync::transport_test
