// cuda_ipc between real processes, beyond the conformance suite: a sender or
// a receiver killed mid-transfer fails the other side with Errc::peer_failure
// (never a timeout) in bounded time; registered regions; a freed and
// reallocated receive buffer; sends to oneself; a rank taken over by a new
// process and reconnected. Each runs over "ipc_host" (the protocol over shared
// host memory, everywhere) and "cuda_ipc" (one GPU; skipped without one).
#include "harness.h"
#include "transport/staging.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

namespace weightsync::transport_test {

// Defined in cuda_ipc_test.cpp (CUDA only).
void cuda_ipc_vmm(ScenarioContext& c);

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWait = std::chrono::milliseconds(60000);
// How long a dead peer may take to surface: the socket closes with the
// process, so this is generous.
constexpr auto kDeathBound = std::chrono::seconds(10);
constexpr Tag kBye = 0xB1E;
constexpr std::size_t kBig = 64u << 20;

void bye(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer b(1, c.memory);
  b.zero();
  if (t.rank() == 0)
    for (int r = 1; r < t.world(); ++r) t.send(r, kBye, b.buffer())->wait(kWait);
  else
    t.recv(0, kBye, b.buffer())->wait(kWait);
}

// Waits for `r` to fail with peer_failure naming `peer` within kDeathBound;
// true when it did, false when it completed (it had been delivered already).
bool fails_with_peer_failure(Request& r, int peer) {
  const auto start = Clock::now();
  try {
    r.wait(std::chrono::duration_cast<std::chrono::milliseconds>(kDeathBound));
    return false;
  } catch (const Error& e) {
    require(e.code() == Errc::peer_failure,
            cat("expected peer_failure, got ", errc_name(e.code()), ": ", e.what()));
    require(std::string(e.what()).find(cat("rank ", peer)) != std::string::npos,
            cat("'", e.what(), "' names rank ", peer));
    require(Clock::now() - start < kDeathBound, "reported within the bound");
    return true;
  }
}

// Rank 1 streams 64 MiB messages; rank 0 kills it with a receive posted.
void ipc_sender_dies(ScenarioContext& c) {
  Transport& t = c.transport;
  if (t.rank() == 1) {
    TestBuffer out(kBig, c.memory);
    out.fill(3);
    for (;;) t.send(0, 1, out.buffer())->wait(kWait);
  }
  TestBuffer in(kBig, c.memory);
  require(t.recv(1, 1, in.buffer())->wait(kWait) == kBig, "first message");
  auto r = t.recv(1, 1, in.buffer());
  c.kill_peer(1);
  // At most the message being copied when it died may still complete.
  int completed = 0;
  while (!fails_with_peer_failure(*r, 1)) {
    require(++completed <= 2, "receives from a killed sender kept completing");
    r = t.recv(1, 1, in.buffer());
  }
  require(t.peer_failed(1), "peer_failed(1)");
  require_error([&] { (void)t.recv(1, 1, in.buffer()); }, Errc::peer_failure, {"rank 1"});
  require_error([&] { (void)t.send(1, 1, in.buffer()); }, Errc::peer_failure, {"rank 1"});
}

// Rank 1 receives 64 MiB messages; rank 0 sends, and kills it mid-stream.
void ipc_receiver_dies(ScenarioContext& c) {
  Transport& t = c.transport;
  if (t.rank() == 1) {
    TestBuffer in(kBig, c.memory);
    for (;;) t.recv(0, 2, in.buffer())->wait(kWait);
  }
  TestBuffer out(kBig, c.memory);
  out.fill(4);
  t.send(1, 2, out.buffer())->wait(kWait);
  c.kill_peer(1);
  for (int sent = 0;; ++sent) {
    require(sent <= 2, "sends to a killed receiver kept completing");
    std::unique_ptr<Request> s;
    try {
      s = t.send(1, 2, out.buffer());
    } catch (const Error& e) {
      require(e.code() == Errc::peer_failure, cat("posting: ", e.what()));
      break;
    }
    if (fails_with_peer_failure(*s, 1)) break;
  }
  require(t.peer_failed(1), "peer_failed(1)");
}

// Receives into registered memory at unaligned offsets; then the registration
// goes and the same memory receives unregistered.
void ipc_registered(ScenarioContext& c) {
  Transport& t = c.transport;
  constexpr int kCount = 8;
  constexpr std::size_t kStride = 512 << 10;
  auto size_of = [](int i) { return std::size_t(100000 + 7 * i); };
  if (t.rank() == 1) {
    for (int round = 0; round < 2; ++round)
      for (int i = 0; i < kCount; ++i) {
        TestBuffer out(size_of(i), c.memory);
        out.fill(round * 100 + i);
        t.send(0, 10 + i, out.buffer())->wait(kWait);
      }
  } else {
    TestBuffer area(kCount * kStride, c.memory);
    area.zero();
    auto region = t.register_memory(area.buffer());
    for (int round = 0; round < 2; ++round) {
      std::vector<std::unique_ptr<Request>> recvs;
      for (int i = 0; i < kCount; ++i) {
        Buffer b = area.buffer();
        b.data = static_cast<char*>(b.data) + i * kStride + i;
        b.bytes = kStride - i;
        b.region = round == 0 ? region.get() : nullptr;
        recvs.push_back(t.recv(1, 10 + i, b));
      }
      wait_all(recvs, kWait);
      const auto bytes = area.read();
      for (int i = 0; i < kCount; ++i) {
        require(recvs[i]->transferred() == size_of(i), cat("message ", i, " size"));
        for (std::size_t k = 0; k < size_of(i); ++k)
          if (bytes[i * kStride + i + k] != pattern_byte(round * 100 + i, k))
            require(false, cat("round ", round, " message ", i, " byte ", k, " differs"));
      }
      region.reset();  // round 1 receives into the same memory, unregistered
    }
  }
  bye(c);
}

// A receive buffer freed and allocated again (often at the same address)
// receives into the new allocation, not into a stale mapping of the old one.
void ipc_realloc(ScenarioContext& c) {
  Transport& t = c.transport;
  constexpr std::size_t kBytes = 3 << 20;
  for (int round = 0; round < 4; ++round) {
    if (t.rank() == 1) {
      TestBuffer out(kBytes, c.memory);
      out.fill(round + 20);
      t.send(0, 30, out.buffer())->wait(kWait);
    } else {
      TestBuffer in(kBytes, c.memory);
      in.zero();
      const std::size_t got = t.recv(1, 30, in.buffer())->wait(kWait);
      require(got == kBytes && in.holds(round + 20, kBytes),
              cat("round ", round, ": ", in.differing(round + 20, kBytes), " bytes differ"));
    }
  }
  bye(c);
}

// A rank sends to itself, the send posted before and after the receive.
void ipc_self(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer out(1 << 20, c.memory), in(1 << 20, c.memory);
  out.fill(40);
  in.zero();
  auto s = t.send(t.rank(), 40, out.buffer());
  auto r = t.recv(t.rank(), 40, in.buffer());
  require(r->wait(kWait) == (1u << 20) && in.holds(40, 1 << 20), "self message, send first");
  s->wait(kWait);
  out.fill(41);
  r = t.recv(t.rank(), 41, in.buffer());
  t.send(t.rank(), 41, out.buffer())->wait(kWait);
  require(r->wait(kWait) == (1u << 20) && in.holds(41, 1 << 20), "self message, receive first");
}

// Rank 1 of the reconnect test (each of its two processes): one message,
// then it waits for rank 0's goodbye.
void ipc_reconnect_peer(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer out(4096, c.memory);
  out.fill(50);
  t.send(0, 50, out.buffer())->wait(kWait);
  bye(c);
}

// A send that settles as it is posted (zero bytes; too large for the
// receive) tells the receiver at once, even if its sender never progresses
// again: rank 1 posts such sends once rank 0's receives have reached it,
// then stops progressing for 3 s; rank 0's receives must settle before rank
// 1 resumes (the steady clock is one for every process of the machine).
void ipc_settled_sends(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer small(16, c.memory), big(32, c.memory), note(8, c.memory);
  Buffer none{nullptr, 0, c.memory, -1, nullptr};
  if (t.rank() == 0) {
    auto empty = t.recv(1, 60, none);
    auto short_one = t.recv(1, 61, small.buffer());
    // Sent after the receives: when it arrives, they have arrived.
    t.send(1, 59, note.buffer())->wait(kWait);
    require(empty->wait(kWait) == 0, "the zero-byte message");
    require_error([&] { short_one->wait(kWait); }, Errc::mismatch, {"32 bytes", "16-byte"});
    const auto done = Clock::now().time_since_epoch().count();
    t.recv(1, 62, note.buffer())->wait(kWait);
    int64_t resumed = 0;
    std::memcpy(&resumed, note.read().data(), sizeof resumed);
    require(done < resumed, cat("the receives settled ", (done - resumed) / 1000000,
                                " ms after the sender progressed again, not before"));
  } else {
    t.recv(0, 59, note.buffer())->wait(kWait);
    require(t.send(0, 60, none)->test(), "a zero-byte send into a posted receive settles at once");
    auto long_one = t.send(0, 61, big.buffer());
    require_error([&] { long_one->test(); }, Errc::mismatch, {"32 bytes"});
    std::this_thread::sleep_for(std::chrono::seconds(3));  // no progress
    const int64_t resumed = Clock::now().time_since_epoch().count();
    TestBuffer out(8, c.memory);
    out.write(&resumed, sizeof resumed);
    t.send(0, 62, out.buffer())->wait(kWait);
  }
  bye(c);
}

// Rank 0 lends rank 1 parts of two buffers (one registered) and an empty
// one; rank 1 maps them, writes each through its address and says so with a
// message; rank 0 finds exactly those bytes written. Twice: the second loan
// reuses the regions.
void ipc_lent_memory(ScenarioContext& c) {
  Transport& t = c.transport;
  require(t.capabilities().maps_peer_memory, "cuda_ipc lends memory");
  constexpr std::size_t kA = 1 << 20, kB = 4096;
  struct Part {
    std::size_t offset, bytes;
    bool in_a;
  };
  const std::vector<Part> parts{
      {100, 5000, true}, {0, 0, true}, {0, kB, false}, {200000, 300000, true}};
  TestBuffer note(8, c.memory);
  for (int round = 0; round < 2; ++round) {
    const Tag tag = 70 + 2 * static_cast<Tag>(round);
    if (t.rank() == 0) {
      TestBuffer a(kA, c.memory), b(kB, c.memory);
      a.zero();
      b.zero();
      auto reg = t.register_memory(a.buffer());
      std::vector<Buffer> lent;
      std::size_t total = 0;
      for (const Part& p : parts) {
        Buffer x = p.in_a ? a.buffer() : b.buffer();
        x.data = static_cast<char*>(x.data) + p.offset;
        x.bytes = p.bytes;
        x.region = p.in_a && p.bytes > 0 ? reg.get() : nullptr;
        if (p.bytes == 0) x.data = nullptr;
        lent.push_back(x);
        total += p.bytes;
      }
      require(t.expose(1, tag, lent)->wait(kWait) == total, "the loan reports its bytes");
      t.recv(1, tag + 1, note.buffer())->wait(kWait);  // rank 1 wrote them all
      const auto got_a = a.read(), got_b = b.read();
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const Part& p = parts[i];
        const auto& got = p.in_a ? got_a : got_b;
        for (std::size_t k = 0; k < p.bytes; ++k)
          require(got[p.offset + k] == pattern_byte(round * 10 + i, k),
                  cat("round ", round, ", part ", i, ": byte ", k, " differs"));
      }
      std::size_t written = 0;
      for (uint8_t v : got_a) written += v != 0;
      std::size_t expected = 0;  // pattern bytes may be zero too: count them
      for (std::size_t i = 0; i < parts.size(); ++i)
        if (parts[i].in_a)
          for (std::size_t k = 0; k < parts[i].bytes; ++k)
            expected += pattern_byte(round * 10 + i, k) != 0;
      require(written == expected, cat("round ", round, ": ", written, " nonzero bytes in A, ",
                                       expected, " written by rank 1"));
    } else {
      std::vector<void*> at;
      t.map_exposed(0, tag, &at)->wait(kWait);
      require(at.size() == parts.size(), cat(at.size(), " addresses for ", parts.size()));
      require(at[1] == nullptr, "an empty buffer has no address");
      for (std::size_t i = 0; i < parts.size(); ++i) {
        if (parts[i].bytes == 0) continue;
        TestBuffer src(parts[i].bytes, c.memory);
        src.fill(round * 10 + i);
        src.copy_to(at[i], parts[i].bytes);
      }
      t.send(0, tag + 1, note.buffer())->wait(kWait);
    }
  }
  bye(c);
}

class IpcScenarios : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (const std::string why = not_built_reason(GetParam()); !why.empty()) GTEST_SKIP() << why;
    TempDir dir;
    try {
      make_test_transport(GetParam(), dir.path, 0, 1, "probe");
    } catch (const Error& e) {
      if (e.code() == Errc::unsupported) GTEST_SKIP() << e.what();
      FAIL() << "creating " << GetParam() << ": " << e.what();
    }
  }
  void run(const std::string& scenario, int world = 2) {
    std::string failures;
    try {
      failures = run_scenario(scenario, GetParam(), world);
    } catch (const std::exception& e) {
      FAIL() << scenario << " over " << GetParam() << ", rank 0: " << e.what();
    }
    EXPECT_EQ(failures, "") << scenario << " over " << GetParam();
  }
};

TEST_P(IpcScenarios, SenderKilledMidTransferIsAPeerFailure) {
  run("ipc_sender_dies");
}

TEST_P(IpcScenarios, ReceiverKilledMidTransferIsAPeerFailure) {
  run("ipc_receiver_dies");
}

TEST_P(IpcScenarios, RegisteredRegionsAtUnalignedOffsets) {
  run("ipc_registered");
}

TEST_P(IpcScenarios, ReallocatedReceiveBufferGetsTheMessage) {
  run("ipc_realloc");
}

TEST_P(IpcScenarios, SendsSettledAtPostingTellTheReceiverAtOnce) {
  run("ipc_settled_sends");
}

TEST_P(IpcScenarios, LentMemoryIsWrittenThroughTheMappedAddresses) {
  run("ipc_lent_memory");
}

TEST_P(IpcScenarios, SendToSelf) {
  run("ipc_self", 1);
}

TEST_P(IpcScenarios, RankTakenByANewProcessIsReconnected) {
  TempDir dir;
  auto first = std::make_unique<PeerProcesses>("ipc_reconnect_peer", GetParam(), 2, dir.path, "t");
  auto t = make_test_transport(GetParam(), dir.path, 0, 2);
  const MemoryKind memory = t->capabilities().host_memory ? MemoryKind::host : MemoryKind::cuda;
  TestBuffer in(4096, memory);
  auto receive = [&] {
    in.zero();
    ASSERT_EQ(t->recv(1, 50, in.buffer())->wait(kWait), 4096u);
    EXPECT_TRUE(in.holds(50, 4096));
  };
  receive();
  auto pending = t->recv(1, 51, in.buffer());
  first->kill(1);
  EXPECT_TRUE(fails_with_peer_failure(*pending, 1));
  pending.reset();
  EXPECT_EQ(first->join(std::chrono::seconds(30)), "");
  // A new process takes rank 1 and publishes its own address.
  PeerProcesses second("ipc_reconnect_peer", GetParam(), 2, dir.path, "t");
  t->reconnect(1);
  EXPECT_FALSE(t->peer_failed(1));
  receive();
  TestBuffer b(1, memory);
  b.zero();
  t->send(1, kBye, b.buffer())->wait(kWait);
  EXPECT_EQ(second.join(std::chrono::seconds(60)), "");
}

INSTANTIATE_TEST_SUITE_P(Transports, IpcScenarios, ::testing::Values("ipc_host", "cuda_ipc"),
                         [](const auto& info) { return info.param; });

}  // namespace

Scenario find_ipc_scenario(const std::string& name) {
  static const std::map<std::string, Scenario> scenarios{
      {"ipc_sender_dies", ipc_sender_dies},
      {"ipc_receiver_dies", ipc_receiver_dies},
      {"ipc_registered", ipc_registered},
      {"ipc_realloc", ipc_realloc},
      {"ipc_self", ipc_self},
      {"ipc_settled_sends", ipc_settled_sends},
      {"ipc_lent_memory", ipc_lent_memory},
      {"ipc_reconnect_peer", ipc_reconnect_peer},
      {"cuda_ipc_vmm", cuda_ipc_vmm},
  };
  auto it = scenarios.find(name);
  return it == scenarios.end() ? nullptr : it->second;
}

}  // namespace weightsync::transport_test
