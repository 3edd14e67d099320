// The NCCL transport's plumbing on one GPU: a one-rank communicator (NCCL
// refuses two ranks of one communicator on one GPU, so this is what a
// one-GPU machine can run): self send/receive grouped in either order,
// broadcast, the abort after a timed-out wait, and host memory refused.
#include "gpu/gpu_test_util.h"

#include <weightsync/backend/transport.h>
#include <weightsync/error.h>
#include <weightsync/store.h>

#include <filesystem>
#include <vector>

#include <unistd.h>

namespace weightsync::gpu_test {
namespace {

using namespace std::chrono_literals;

class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_TRANSPORT("nccl");
    REQUIRE_GPU();
    dir_ = std::filesystem::temp_directory_path() /
           ("ws-nccl-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    store_ = make_file_store(dir_.string());
    TransportOptions o;
    o.name = "nccl";
    o.store = store_.get();
    o.prefix = "one";
    o.rank = 0;
    o.world = 1;
    o.device = 0;
    o.bootstrap_timeout = 30s;
    try {
      transport_ = make_transport(o);
    } catch (const Error& e) {
      // e.g. no libnccl.so.2 the loader can find (NCCL inside a torch wheel).
      if (e.code() == Errc::unsupported) GTEST_SKIP() << e.what();
      throw;
    }
  }
  void TearDown() override {
    transport_.reset();
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  std::filesystem::path dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Transport> transport_;
};

std::vector<unsigned char> pattern(size_t n, int seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 13 + seed);
  return v;
}

Buffer device_buffer(const gpu::Memory& m) {
  return Buffer{m.data(), m.bytes(), MemoryKind::cuda, 0, nullptr};
}

TEST_F(NcclOneRank, SelfSendAndReceiveGroupedInEitherOrder) {
  for (size_t n : {size_t{1}, size_t{4096}, size_t{3} << 20}) {
    for (bool recv_first : {true, false}) {
      gpu::Memory src(n, gpu::MemoryPlace::device, 0), dst(n, gpu::MemoryPlace::device, 0);
      const auto bytes = pattern(n, static_cast<int>(n % 251));
      gpu::copy_to_device(src.data(), bytes.data(), n);
      // Both posted before any progress: issued in one group, so a rank may
      // talk to itself without deadlocking its stream.
      std::unique_ptr<Request> r, s;
      if (recv_first) r = transport_->recv(0, 5, device_buffer(dst));
      s = transport_->send(0, 5, device_buffer(src));
      if (!recv_first) r = transport_->recv(0, 5, device_buffer(dst));
      EXPECT_EQ(s->wait(30s), n);
      EXPECT_EQ(r->wait(30s), n);
      std::vector<unsigned char> got(n);
      gpu::copy_to_host(got.data(), dst.data(), n);
      EXPECT_EQ(got, bytes) << n << " bytes, receive posted " << (recv_first ? "first" : "second");
    }
  }
}

TEST_F(NcclOneRank, BroadcastOverTheWholeWorld) {
  gpu::Memory buf(1 << 20, gpu::MemoryPlace::device, 0);
  const auto bytes = pattern(buf.bytes(), 3);
  gpu::copy_to_device(buf.data(), bytes.data(), bytes.size());
  EXPECT_EQ(transport_->broadcast(device_buffer(buf), 0, {0}, 9)->wait(30s), buf.bytes());
  std::vector<unsigned char> got(buf.bytes());
  gpu::copy_to_host(got.data(), buf.data(), got.size());
  EXPECT_EQ(got, bytes);
}

TEST_F(NcclOneRank, ATimedOutWaitAbortsTheCommunicator) {
  gpu::Memory dst(4096, gpu::MemoryPlace::device, 0);
  auto r = transport_->recv(0, 1, device_buffer(dst));  // no send will match it
  try {
    r->wait(200ms);
    FAIL() << "a receive nobody sends to completed";
  } catch (const Error& e) {
    // A timeout, or NCCL's own error should it reject an unmatched receive
    // to self at issue: either way the wait is bounded and ends in an abort.
    EXPECT_TRUE(e.code() == Errc::timeout || e.code() == Errc::transport) << e.what();
  }
  EXPECT_TRUE(transport_->peer_failed(0)) << "aborted after the failed wait";
  try {
    transport_->send(0, 2, device_buffer(dst));
    FAIL() << "an aborted communicator accepted a send";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::peer_failure) << e.what();
  }
}

TEST_F(NcclOneRank, HostMemoryIsRefusedAtPosting) {
  std::vector<char> host(64);
  EXPECT_FALSE(transport_->capabilities().host_memory);
  try {
    transport_->send(0, 1, host_buffer(host.data(), host.size()));
    FAIL() << "host memory accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported) << e.what();
  }
}

}  // namespace
}  // namespace weightsync::gpu_test
