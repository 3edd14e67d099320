// The transport registry and the UCX transport's argument checks, in one
// process (a world of one talks to itself over UCX "self").
#include "harness.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace weightsync::transport_test {
namespace {

void expect_error(const std::function<void()>& op, Errc code,
                  const std::vector<std::string>& parts) {
  try {
    require_error(op, code, parts);
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
}

bool built(const std::string& name) {
  const auto names = transport_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

TEST(TransportRegistry, UnknownNameListsTheBuiltOnes) {
  TempDir dir;
  expect_error([&] { make_test_transport("carrier-pigeon", dir.path, 0, 1); },
               Errc::invalid_argument, {"carrier-pigeon", "fault"});
}

TEST(TransportRegistry, FaultWrapperNeedsAnInnerTransport) {
  TempDir dir;
  expect_error([&] { make_test_transport("fault", dir.path, 0, 1); }, Errc::invalid_argument,
               {"fault:ucx"});
}

TEST(TransportRegistry, OptionsMustBeKeyValue) {
  TempDir dir;
  expect_error([&] { make_test_transport("fault:ucx?seed", dir.path, 0, 1); },
               Errc::invalid_argument, {"seed", "key=value"});
}

TEST(TransportRegistry, UnknownOptionsAreRefusedWithTheAcceptedOnes) {
  TempDir dir;
  // Before, each of these was ignored: the transport ran as if it were not there.
  if (built("ucx")) {
    expect_error([&] { make_test_transport("ucx?tls=tcp,self&bogus=1", dir.path, 0, 1); },
                 Errc::invalid_argument,
                 {"'ucx'", "unknown option 'bogus'", "cuda", "keepalive_interval", "peer_errors",
                  "tls", "UCX_*"});
    // A misspelt fault key: the drill would have injected nothing.
    expect_error([&] { make_test_transport("fault:ucx?corrupt_after=3", dir.path, 0, 1); },
                 Errc::invalid_argument,
                 {"'fault:ucx'", "unknown option 'corrupt_after'", "fault takes", "corrupt_send",
                  "fail_after", "ucx takes", "tls"});
  }
  expect_error([&] { make_test_transport("ipc_host?socket_dirr=/x", dir.path, 0, 1); },
               Errc::invalid_argument, {"unknown option 'socket_dirr'", "local, socket_dir"});
  expect_error([&] { make_test_transport("fault:ipc_host?seed=2&locl=1", dir.path, 0, 1); },
               Errc::invalid_argument, {"unknown option 'locl'", "ipc_host takes local"});
}

TEST(TransportRegistry, AcceptedOptionsPass) {
  TempDir dir;
  if (built("ucx")) {
    EXPECT_NO_THROW(make_test_transport(
        "fault:ucx?tls=tcp,self&peer_errors=auto&keepalive_interval=2s&UCX_RNDV_THRESH=64k&seed=3",
        dir.path, 0, 1));
  }
  EXPECT_NO_THROW(make_test_transport("fault:ipc_host?local=1&seed=2", dir.path, 0, 1));
}

TEST(TransportRegistry, ABackendOfTheUsersReadsItsOwnOptions) {
  std::map<std::string, std::string> seen;
  register_transport("registry-test-own",
                     [&](const TransportOptions& o) -> std::unique_ptr<Transport> {
                       seen = o.params;
                       fail(Errc::unsupported, "registry-test-own: created");
                     });
  TempDir dir;
  expect_error([&] { make_test_transport("registry-test-own?anything=1", dir.path, 0, 1); },
               Errc::unsupported, {"created"});
  EXPECT_EQ(seen.at("anything"), "1");
}

TEST(TransportRegistry, NeedsAStoreAndARankInsideTheWorld) {
  TransportOptions o;
  expect_error([&] { make_transport(o); }, Errc::invalid_argument, {"Store"});
  TempDir dir;
  expect_error([&] { make_test_transport("ucx", dir.path, 2, 2); }, Errc::invalid_argument,
               {"rank 2", "size 2"});
}

TEST(TransportRegistry, NcclWithoutAGpuIsUnsupported) {
  if (!built("nccl")) GTEST_SKIP() << not_built_reason("nccl");
  TempDir dir;
  try {
    make_test_transport("nccl", dir.path, 0, 1);
    GTEST_SKIP() << "a GPU is usable here; the no-GPU error path cannot be observed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("cudaGetDeviceCount"), std::string::npos) << e.what();
  }
}

class UcxSelf : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!built("ucx")) GTEST_SKIP() << not_built_reason("ucx");
    t = make_test_transport("ucx?tls=tcp,self", dir.path, 0, 1);
  }
  TempDir dir;
  std::unique_ptr<Transport> t;
};

TEST_F(UcxSelf, Capabilities) {
  const auto caps = t->capabilities();
  EXPECT_TRUE(caps.host_memory);
  EXPECT_FALSE(caps.native_broadcast);
  EXPECT_EQ(caps.tag_bits, 48);
  EXPECT_EQ(t->name(), "ucx");
  EXPECT_EQ(t->world(), 1);
}

TEST_F(UcxSelf, RejectsBadArguments) {
  TestBuffer b(8, MemoryKind::host);
  expect_error([&] { (void)t->send(1, 0, b.buffer()); }, Errc::invalid_argument, {"rank 1"});
  expect_error([&] { (void)t->recv(-1, 0, b.buffer()); }, Errc::invalid_argument, {"rank -1"});
  expect_error([&] { (void)t->send(0, Tag{1} << 48, b.buffer()); }, Errc::invalid_argument,
               {"48-bit"});
  expect_error(
      [&] {
        (void)t->send(0, 0, Buffer{nullptr, 8});
      },
      Errc::invalid_argument, {"null buffer"});
}

TEST_F(UcxSelf, CudaMemoryNeedsCudaInUcx) {
  if (t->capabilities().cuda_memory) GTEST_SKIP() << "this UCX supports CUDA memory";
  Buffer device{reinterpret_cast<void*>(0x1000), 64, MemoryKind::cuda, 0, nullptr};
  expect_error([&] { (void)t->send(0, 0, device); }, Errc::unsupported, {"CUDA"});
  expect_error([&] { t->register_memory(device); }, Errc::unsupported, {"CUDA"});
}

TEST_F(UcxSelf, RegisteredRegionsCarryMessages) {
  TestBuffer in(1 << 20, MemoryKind::host), out(1 << 20, MemoryKind::host);
  out.fill(11);
  auto in_region = t->register_memory(in.buffer());
  auto out_region = t->register_memory(out.buffer());
  Buffer rb = in.buffer(), sb = out.buffer();
  rb.region = in_region.get();
  sb.region = out_region.get();
  auto r = t->recv(0, 3, rb);
  auto s = t->send(0, 3, sb);
  s->wait(std::chrono::seconds(30));
  EXPECT_EQ(r->wait(std::chrono::seconds(30)), std::size_t{1} << 20);
  EXPECT_TRUE(in.holds(11, 1 << 20));
  Buffer outside = out.buffer();
  outside.region = in_region.get();
  expect_error([&] { (void)t->send(0, 3, outside); }, Errc::invalid_argument, {"region"});
}

TEST_F(UcxSelf, SmallerMessageReportsItsSize) {
  TestBuffer in(1000, MemoryKind::host), out(10, MemoryKind::host);
  out.fill(4);
  auto r = t->recv(0, 9, in.buffer());
  t->send(0, 9, out.buffer())->wait(std::chrono::seconds(30));
  EXPECT_EQ(r->wait(std::chrono::seconds(30)), 10u);
  EXPECT_TRUE(in.holds(4, 10));
}

TEST_F(UcxSelf, DestroyingAPendingReceiveCancelsIt) {
  TestBuffer in(64, MemoryKind::host), out(64, MemoryKind::host);
  out.fill(6);
  t->recv(0, 12, in.buffer()).reset();  // cancelled, buffer released
  auto r = t->recv(0, 12, in.buffer());
  t->send(0, 12, out.buffer())->wait(std::chrono::seconds(30));
  EXPECT_EQ(r->wait(std::chrono::seconds(30)), 64u);
  EXPECT_TRUE(in.holds(6, 64));
}

}  // namespace
}  // namespace weightsync::transport_test
